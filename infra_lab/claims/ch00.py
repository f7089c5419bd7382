"""Chapter 00, the stack: what the articles say about idle GPUs, and the H100's ridge point."""
from __future__ import annotations

from infra_lab import hardware, measured, roofline
from infra_lab.claims.entry import Entry, Figure, committed, computed

SCALING_BOOK = "https://jax-ml.github.io/scaling-book/roofline/"


def decode_share_of_peak() -> Figure:
    h100, llama = hardware.get("H100 SXM"), roofline.preset("llama-3-8b")
    step = roofline.step_cost(llama, batch=1, new_tokens=1, context=1024, dtype="bf16")
    seconds, bound = roofline.time_lower_bound(step, h100, "bf16")
    used = step.flops / seconds / h100.flops("bf16")
    return computed(f"batch-1 decode of Llama-3-8B (1,024-token context) is {bound}-bound on an H100 "
                    f"and can use at most {used:.2%} of its bf16 peak, at the roofline")


def execution_idle_on_h200() -> Figure | None:
    gpu = measured.load("gpu_check_h200")
    if gpu is None:
        return None
    shares = gpu["idle_fraction_cuda"]
    return committed(gpu, None, "a toy batch-1 decode on an H200 spent " + ", ".join(
        f"{share:.0%} (width {width})" for width, share in shares.items()) + " of its run between kernels")


def h100_ridge() -> Figure:
    h100 = hardware.get("H100 SXM")
    return computed(f"{roofline.ridge_point(h100, 'bf16'):.1f} FLOP/byte, from the datasheet's "
                    f"{h100.flops('bf16') / 1e12:.1f} TFLOP/s and {h100.memory_bandwidth / 1e12:.2f} TB/s")


ENTRIES = [
    Entry("00.utilization-below-40", "00",
          "GPU utilization under mixed loads is usually below 40%; memory bandwidth is the key limit",
          "A", "below 40%", decode_share_of_peak),
    Entry("00.execution-idle", "00",
          "a month of monitoring at CMU found GPUs much of the time \"execution-idle\"; over 50% of the "
          "energy of LLM inference is wasted waiting", "C", "over 50%", execution_idle_on_h200),
    Entry("00.h100-ridge", "00",
          "the H100 SXM's bf16 matmul turns compute-bound at 9.89e14 / 3.35e12 FLOP per byte",
          "Austin et al., How to Scale Your Model (2025), the roofline chapter, question 5", "295",
          h100_ridge, links=(SCALING_BOOK,)),
]
