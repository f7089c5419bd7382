"""Chapter 02, attention: FlashAttention's memory, and what a 70B model weighs."""
from __future__ import annotations

from infra_lab import hardware, roofline
from infra_lab.claims.entry import Entry, Figure, computed

FLASH_ATTENTION = "https://arxiv.org/abs/2205.14135"


def seventy_b_weights() -> Figure:
    llama = roofline.preset("llama-3-70b")
    h100 = hardware.get("H100 SXM")
    weights = 2 * llama.total_params
    return computed(f"Llama-3-70B's weights alone take {weights / 1e9:.0f} GB in bf16, "
                    f"{weights / h100.memory_bytes:.2f}× an H100's {h100.memory_bytes / 1e9:.0f} GB")


ENTRIES = [
    Entry("02.flashattention-memory", "02",
          "standard attention needs Θ(L²) extra memory for the score matrix, FlashAttention Θ(L) beyond its "
          "inputs and output", "Dao et al., NeurIPS 2022, Theorem 2 and Section 3",
          "extra memory Θ(L²) against Θ(L)",
          not_here="chapter 02 measures the growth exponents of peak memory live on the reader's machine "
                   "(tens of seconds); no run of it is kept in benchmarks/results/",
          links=(FLASH_ATTENTION,)),
    Entry("02.seventy-b-140-gb", "02", "a 70B model needs over 140 GB of memory", "B", "over 140 GB",
          seventy_b_weights),
]
