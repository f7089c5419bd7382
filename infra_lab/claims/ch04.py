"""Chapter 04, the radix KV cache: SGLang's throughput, priced from the hit rate we measure."""
from __future__ import annotations

from infra_lab import hardware, roofline
from infra_lab.claims.entry import Entry, Figure, computed
from infra_lab.serving import workloads

SGLANG = "https://arxiv.org/abs/2312.07104"
CAPACITY, BATCH, ANSWER, DECODE_BATCH = 3000, 16, 64, 64  # chapter 04's reproduction


def end_to_end_gain() -> Figure:
    """Chapter 04's few-shot workload through a radix cache of 3,000 tokens, each (prompt, cached) pair
    priced for LLaMA-3-8B in bf16 on an H100 at the roofline: prefills of 16 requests as one step, then
    64 answer tokens each in decode batches of 64."""
    few = workloads.serve(workloads.WORKLOADS["few-shot"](), CAPACITY, "fcfs")
    h100, llama = hardware.get("H100 SXM"), roofline.preset("llama-3-8b")
    weight_bytes = roofline.step_cost(llama, 1, 1, 0, "bf16").bytes - roofline.kv_bytes_per_token(llama, "bf16")

    def seconds(cost) -> float:
        return roofline.time_lower_bound(cost, h100, "bf16")[0]

    def prefill(cached: bool) -> float:
        total = 0.0
        for first in range(0, len(few.matches), BATCH):
            costs = [roofline.step_cost(llama, 1, p - m, m, "bf16") if cached else
                     roofline.step_cost(llama, 1, p, 0, "bf16") for p, m in few.matches[first:first + BATCH]]
            moved = sum(c.bytes for c in costs) - (len(costs) - 1) * weight_bytes  # one weight read
            total += seconds(roofline.Cost(sum(c.flops for c in costs), moved))
        return total

    decode = sum(ANSWER / DECODE_BATCH * seconds(roofline.step_cost(llama, DECODE_BATCH, 1, p + ANSWER // 2,
                                                                    "bf16")) for p, _ in few.matches)
    cold, warm = prefill(False) + decode, prefill(True) + decode
    return computed(f"{cold / warm:.1f}× end to end at the roofline (few-shot hit rate {few.hit_rate:.1%}, "
                    f"prefill-only bound {1 / (1 - few.hit_rate):.1f}×; LLaMA-3-8B on an H100, "
                    f"{ANSWER}-token answers)")


ENTRIES = [
    Entry("04.sglang-6.4x", "04",
          "SGLang achieves up to 6.4× higher throughput than state-of-the-art systems on workloads such as "
          "few-shot benchmarks, agents, JSON decoding and multi-turn chat; RadixAttention's KV reuse is the main "
          "source on the prefix-heavy ones", "Zheng et al., NeurIPS 2024", "up to 6.4×", end_to_end_gain,
          links=(SGLANG,)),
]
