"""Real kernels, timed on this machine and placed on its measured roofline.

Each run pairs what a kernel must do (a roofline Cost: FLOPs and compulsory bytes) with how long
it took, so its share of the roof is achieved FLOP/s over attainable FLOP/s at its intensity.
The chapter runs the small sizes; `benchmarks/roofline.py` runs the full ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab import hardware, roofline
from infra_lab.kernels import attention_decode, gemv

SIZES = {
    "small": {"matmul": [64, 128, 256, 512, 1024], "gemv": 4096, "triad_bytes": 64 * 2**20,
              "attention_context": 16384},
    "full": {"matmul": [64, 128, 256, 512, 1024, 2048], "gemv": 8192, "triad_bytes": 256 * 2**20,
             "attention_context": 65536},
    "cuda": {"matmul": [256, 512, 1024, 2048, 4096, 8192], "gemv": 16384, "triad_bytes": 2**30,
             "attention_context": 131072},
}


@dataclass(frozen=True)
class KernelRun:
    label: str
    cost: roofline.Cost
    seconds: float
    dtype: str = "fp32"

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds

    def fraction_of_roof(self, device: hardware.Device) -> float:
        return roofline.fraction_of_roof(self.cost, self.seconds, device, self.dtype)

    def point(self) -> roofline.Point:
        return roofline.Point(self.label, self.cost.intensity, self.flops_per_s)


def time_matmul(n: int, repeats: int = 3) -> KernelRun:
    """numpy BLAS fp32, (n, n) @ (n, n)."""
    rng = np.random.default_rng(0)
    left, right = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    seconds = hardware.best_seconds(lambda: left @ right, repeats)
    return KernelRun(f"matmul {n}", roofline.gemm(n, n, n, "fp32"), seconds)


def time_gemv(n: int, repeats: int = 5) -> KernelRun:
    """numba GEMV fp32, (n, n) @ (n,): decode's matrix-vector product."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((n, n)).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    seconds = hardware.best_seconds(lambda: gemv.gemv_numba(weights, x), repeats)
    return KernelRun(f"GEMV {n}x{n}", roofline.gemv(n, n, "fp32"), seconds)


def time_triad(bytes_per_array: int) -> KernelRun:
    """numba STREAM triad a = b + s c over float32 arrays: 2 FLOPs per 12 bytes."""
    n = bytes_per_array // 4
    bandwidth = hardware.stream_bandwidth("triad", bytes_per_array, bytes_per_timing=0)
    cost = roofline.Cost(flops=2 * n, bytes=12 * n)
    return KernelRun(f"triad {bytes_per_array // 2**20} MiB", cost, cost.bytes / bandwidth)


def time_attention_decode(context: int, n_heads: int = 8, head_dim: int = 64, repeats: int = 5) -> KernelRun:
    """numba decode attention, one sequence: one query per head over `context` cached tokens."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, context, n_heads, head_dim)).astype(np.float32) for _ in range(2))
    lengths = np.array([context])
    seconds = hardware.best_seconds(lambda: attention_decode.decode_attention_numba(q, k, v, lengths), repeats)
    return KernelRun(f"attention decode {context // 1024}K", roofline.attention_decode(context, n_heads, head_dim, "fp32"), seconds)


def _cuda_run(label: str, cost: roofline.Cost, dtype: str, run) -> KernelRun:
    import torch

    return KernelRun(label, cost, hardware.cuda_seconds(torch, run, repeats=10), dtype)


def run_all_cuda(plan: dict) -> list:
    """The same kernels through torch on the GPU: bf16 matmuls and GEMV, an fp32 triad, and
    bf16 decode attention (32 heads of 128) through scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    runs = []
    for n in plan["matmul"]:
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        runs.append(_cuda_run(f"matmul {n}", roofline.gemm(n, n, n, "bf16"), "bf16", lambda: a @ b))
    n = plan["gemv"]
    weights = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    runs.append(_cuda_run(f"GEMV {n}x{n}", roofline.gemv(n, n, "bf16"), "bf16", lambda: torch.mv(weights, x)))
    del weights
    n = plan["triad_bytes"] // 4
    a, b, c = (torch.ones(n, device="cuda") for _ in range(3))
    runs.append(_cuda_run(f"triad {plan['triad_bytes'] // 2**20} MiB", roofline.Cost(2 * n, 12 * n), "fp32",
                          lambda: torch.add(b, c, alpha=3.0, out=a)))
    del a, b, c
    context, heads, head_dim = plan["attention_context"], 32, 128
    q = torch.randn(1, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, heads, context, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs.append(_cuda_run(f"attention decode {context // 1024}K", roofline.attention_decode(context, heads, head_dim, "bf16"),
                          "bf16", lambda: F.scaled_dot_product_attention(q, k, v)))
    return runs


def run_all(size: str = "small", progress: bool = True) -> list[KernelRun]:
    """Every kernel of the chapter at `size`: "small" or "full" on the CPU (numpy, numba), or
    "cuda" on the GPU (torch)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")
    if size == "cuda":
        return run_all_cuda(SIZES["cuda"])
    from tqdm.auto import tqdm

    plan = SIZES[size]
    jobs = [lambda n=n: time_matmul(n) for n in plan["matmul"]]
    jobs += [lambda: time_gemv(plan["gemv"]), lambda: time_triad(plan["triad_bytes"]),
             lambda: time_attention_decode(plan["attention_context"])]
    return [job() for job in tqdm(jobs, desc="timing kernels", disable=not progress, leave=False)]
