"""Chapter 01, the roofline: the critical batch and the KV cache per token of published models."""
from __future__ import annotations

from infra_lab import hardware, roofline
from infra_lab.claims.entry import Entry, Figure, computed

SCALING_BOOK = "https://jax-ml.github.io/scaling-book/roofline/"
LLAMA_2 = "https://arxiv.org/abs/2307.09288"
LLAMA_3 = "https://arxiv.org/abs/2407.21783"


def critical_batch() -> Figure:
    h100, llama = hardware.get("H100 SXM"), roofline.preset("llama-3-8b")
    batch = roofline.critical_batch(llama, h100, "bf16")
    return computed(f"Llama-3-8B's decode step turns compute-bound at batch {batch} on an H100 "
                    f"(ridge {roofline.ridge_point(h100, 'bf16'):.1f} FLOP/byte; the step model counts the "
                    "new tokens' KV writes and the LM head)")


def kv_per_token() -> Figure:
    kib = {name: roofline.kv_bytes_per_token(roofline.preset(name), "fp16") / 1024
           for name in ("llama-2-7b", "llama-3-8b")}
    return computed(f"{kib['llama-2-7b']:.0f} KiB and {kib['llama-3-8b']:.0f} KiB, from the models' shapes")


ENTRIES = [
    Entry("01.critical-batch", "01",
          "a bf16 matmul on an H100 SXM turns compute-bound at a batch of 9.89e14 / 3.35e12",
          "Austin et al., How to Scale Your Model (2025), the roofline chapter, question 5", "295",
          critical_batch, links=(SCALING_BOOK,)),
    Entry("01.kv-per-token", "01",
          "the KV cache in fp16 takes 512 KiB per token for LLaMA-2-7B (32 layers, 32 KV heads of 128) and "
          "128 KiB for LLaMA-3-8B (8 KV heads: grouped-query attention)",
          "Touvron et al., 2023; Meta, 2024 (the models' shapes)", "512 KiB and 128 KiB", kv_per_token,
          links=(LLAMA_2, LLAMA_3)),
]
