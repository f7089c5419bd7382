"""Chapter 03, the paged KV cache: how much of its memory a KV cache fills with real tokens."""
from __future__ import annotations

import functools

from infra_lab.claims.entry import Entry, Figure, computed
from infra_lab.kv import accounting

VLLM = "https://arxiv.org/abs/2309.06180"
ORCA = "https://www.usenix.org/conference/osdi22/presentation/yu"
CONTIGUOUS = ("max", "pow2", "oracle")


@functools.cache
def usage() -> dict:
    """Chapter 03's stream: 300 ShareGPT-like requests through a pool of 40,000 token slots."""
    requests = accounting.synthetic_requests("sharegpt", 300, seed=0)
    return {policy: accounting.simulate(requests, 40_000, policy) for policy in accounting.RESERVATION_POLICIES}


def contiguous_real() -> Figure:
    real = [usage()[policy].real for policy in CONTIGUOUS]
    return computed(f"{min(real):.1%} to {max(real):.1%} in real tokens for three contiguous policies (first "
                    "fit; chapter 03's ShareGPT-like stream, simulated)")


def paged_waste() -> Figure:
    paged = usage()["paged"]
    return computed(f"{1 - paged.real - paged.free:.1%} lost to partly filled last blocks (blocks of 16, the "
                    "same stream)")


def article_b() -> Figure:
    found = usage()
    real = [found[policy].real for policy in CONTIGUOUS]
    return computed(f"contiguous {min(real):.0%} to {max(real):.0%} real tokens, paged "
                    f"{found['paged'].real:.0%} (the same stream); the throughput half: chapter 05's rows")


def stream_means() -> Figure:
    found = {}
    for dataset in accounting.DATASETS:
        requests = accounting.synthetic_requests(dataset, 300, seed=0)
        found[dataset] = (sum(r.prompt for r in requests) / 300, sum(r.output for r in requests) / 300)
    return computed("chapter 03's streams of 300 requests average " + "; ".join(
        f"{prompt:.0f} and {output:.0f} ({name})" for name, (prompt, output) in found.items())
        + ": log-normal around the paper's means, clipped to 2,048 tokens")


ENTRIES = [
    Entry("03.vllm-figure-2", "03",
          "in existing systems only 20.4% to 38.2% of the KV cache memory stores real token states (Orca's "
          "three reservation policies)", "Kwon et al., SOSP 2023, Figure 2", "20.4% to 38.2%",
          contiguous_real, links=(VLLM, ORCA)),
    Entry("03.vllm-under-4", "03", "vLLM's paging wastes under 4% of the KV cache memory",
          "Kwon et al., SOSP 2023", "under 4%", paged_waste, links=(VLLM,)),
    Entry("03.dataset-lengths", "03",
          "the datasets' mean prompt and output lengths: " + "; ".join(
              f"{name} {prompt} and {output} tokens" for name, (prompt, output) in accounting.DATASETS.items()),
          "Kwon et al., SOSP 2023, Section 6.1 and Figure 11", "; ".join(
              f"{prompt} and {output}" for prompt, output in accounting.DATASETS.values()), stream_means,
          links=(VLLM,)),
    Entry("03.article-contiguous-20-40", "03",
          "contiguous KV allocation uses only 20-40% of memory (60-80% wasted); PagedAttention brings it "
          "near 100% and throughput up 2-4×", "B", "20-40%, near 100%, 2-4×", article_b),
]
