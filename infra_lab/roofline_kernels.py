"""Real kernels, timed on this machine and held against roofs measured back to back with them.

Each run pairs what a kernel must do (a roofline Cost: FLOPs and compulsory bytes) with how long
it took. Its share of the roof is achieved FLOP/s over attainable FLOP/s at its intensity, where
the roof is measured in the same call: on the CPU, a memory-bound kernel's timings alternate with
its roof's over arrays of the same size, since this machine's bandwidth drifts from minute to
minute and a roof from another run would not do. A kernel that reads and writes is held against
the copy roof (STREAM copy: one read and one write counted); one that only reads (a GEMV, decode
attention) against the read roof, which it could pass otherwise. The chapter runs the small
sizes; `benchmarks/roofline.py` runs the full ones.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace

import numpy as np

from infra_lab import hardware, roofline
from infra_lab.kernels import attention_decode, gemv

SIZES = {
    "small": {"matmul": [64, 128, 256, 512, 1024], "gemv": 4096, "triad_bytes": 64 * 2**20,
              "attention_context": 16384, "roof_matmuls": hardware.BLAS_SIZES},
    "full": {"matmul": [64, 128, 256, 512, 1024, 2048], "gemv": 8192, "triad_bytes": 256 * 2**20,
             "attention_context": 65536, "roof_matmuls": hardware.BLAS_SIZES},
    "cuda": {"matmul": [256, 512, 1024, 2048, 4096, 8192], "gemv": 16384, "triad_bytes": 2**30,
             "attention_context": 131072, "roof_matmuls": (8192,), "roof_bytes": 2**30},
}
MEMORY_ROOFS = ("copy", "read")


@dataclass(frozen=True)
class Roofs:
    """Roofs measured with a kernel: bandwidth in bytes/s per kind ("copy", "read") and peak
    FLOP/s per dtype. A roof left out is not measured, and does not bind."""

    bandwidth: dict[str, float] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)
    how: str = ""

    def device(self, kind: str, dtype: str, name: str = "") -> hardware.Device:
        """A Device with the `kind` bandwidth and `dtype` compute roof, for roofline.plot."""
        if kind not in self.bandwidth or dtype not in self.compute:
            raise ValueError(f"no {kind!r} roof with a {dtype!r} peak in this run; it has "
                             f"{', '.join(self.bandwidth)} and {', '.join(self.compute)}")
        return hardware.Device(name=name or f"{kind} roof", memory_bytes=0.0,
                               peak_flops={dtype: self.compute[dtype]},
                               memory_bandwidth=self.bandwidth[kind],
                               source=f"measured in this run: {self.how}")


def median_roofs(roofs: list[Roofs]) -> Roofs:
    """Each roof's median over runs that measured it: one picture for a table of ratios."""
    def median(attribute: str) -> dict[str, float]:
        keys = {key for r in roofs for key in getattr(r, attribute)}
        return {key: statistics.median(getattr(r, attribute)[key] for r in roofs
                                       if key in getattr(r, attribute)) for key in sorted(keys)}

    return Roofs(median("bandwidth"), median("compute"), "median of the roofs measured beside "
                 "each kernel")


@dataclass(frozen=True)
class KernelRun:
    label: str
    cost: roofline.Cost
    seconds: float
    dtype: str = "fp32"
    memory_roof: str = "copy"  # "read" for a kernel that only reads (GEMV, decode attention)
    roofs: Roofs = field(default_factory=Roofs)  # measured back to back with this run

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds

    def roof(self) -> tuple[float, str]:
        """(attainable FLOP/s at this kernel's intensity, which roof sets it): the
        lower of its dtype's compute roof and its memory roof, measured with it."""
        bandwidth = self.roofs.bandwidth.get(self.memory_roof, math.inf)
        memory = self.cost.intensity * bandwidth
        compute = self.roofs.compute.get(self.dtype, math.inf)
        if math.isinf(min(memory, compute)):
            raise ValueError(f"{self.label}: no {self.memory_roof} or {self.dtype} "
                             "roof was measured with this run")
        if compute < memory:
            return compute, f"{self.dtype} compute"
        return memory, self.memory_roof

    def fraction_of_roof(self, device: hardware.Device | None = None) -> float:
        """Achieved over attainable FLOP/s: against the roofs measured with this run, or, given
        a `device`, against its (copy) bandwidth and its peak for this dtype."""
        if device is not None:
            return roofline.fraction_of_roof(self.cost, self.seconds, device, self.dtype)
        return self.flops_per_s / self.roof()[0]

    def point(self) -> roofline.Point:
        """The run on a roofline plot; matmuls form one series, labelled by their size."""
        name, _, size = self.label.rpartition(" ")
        if name == "matmul":
            return roofline.Point(size, self.cost.intensity, self.flops_per_s,
                                  series="matmul n x n x n")
        return roofline.Point(self.label, self.cost.intensity, self.flops_per_s)


def best_in_turns(runs: list, repeats: int) -> list[float]:
    """Fastest seconds of each call in `runs`, timed in turns (a, b, a, b, ...) after one
    warm-up call of each, so all of them see the same machine."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    for run in runs:
        run()
    best = [math.inf] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _beside_roof(kind: str, bytes_per_array: int, run,
                 repeats: int) -> tuple[float, Roofs]:
    """Seconds of `run`, and the `kind` roof over arrays of `bytes_per_array`, timed
    in turns with it."""
    roof_run, moved = hardware.stream_kernel(kind, bytes_per_array, bytes_per_timing=0)
    seconds, roof_seconds = best_in_turns([run, roof_run], repeats)
    how = f"numba {kind} over {bytes_per_array // 2**20} MiB, in turns with the kernel"
    return seconds, Roofs({kind: moved / roof_seconds}, how=how)


def time_matmul(n: int, repeats: int = 5) -> KernelRun:
    """numpy BLAS fp32, (n, n) @ (n, n); run_all adds the compute roof measured after."""
    rng = np.random.default_rng(0)
    left, right = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    out = np.empty((n, n), np.float32)
    seconds = hardware.best_seconds(lambda: np.matmul(left, right, out=out), repeats)
    return KernelRun(f"matmul {n}", roofline.gemm(n, n, n, "fp32"), seconds)


def time_gemv(n: int, repeats: int = 10) -> KernelRun:
    """numba GEMV fp32, (n, n) @ (n,): decode's matrix-vector product. It reads the weights
    and writes n numbers, so it is held against the read roof over as many bytes."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((n, n)).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    seconds, roofs = _beside_roof("read", weights.nbytes,
                                  lambda: gemv.gemv_numba(weights, x), repeats)
    return KernelRun(f"GEMV {n}x{n}", roofline.gemv(n, n, "fp32"), seconds, memory_roof="read",
                     roofs=roofs)


def time_triad(bytes_per_array: int, repeats: int = 10) -> KernelRun:
    """numba STREAM triad a = b + s c over float32 arrays: 2 FLOPs per 12 bytes, two reads and
    a write, held against the copy roof (one read and a write) over arrays of the same size."""
    n = bytes_per_array // 4
    triad, _ = hardware.stream_kernel("triad", bytes_per_array, bytes_per_timing=0)
    seconds, roofs = _beside_roof("copy", bytes_per_array, triad, repeats)
    return KernelRun(f"triad {bytes_per_array // 2**20} MiB", roofline.Cost(2 * n, 12 * n),
                     seconds, roofs=roofs)


def time_attention_decode(context: int, n_heads: int = 8, head_dim: int = 64,
                          repeats: int = 10) -> KernelRun:
    """numba decode attention, one sequence: one query per head over `context` cached tokens.
    It reads the cache and writes one row per head: held against the read roof."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, context, n_heads, head_dim)).astype(np.float32)
            for _ in range(2))
    lengths = np.array([context])
    seconds, roofs = _beside_roof(
        "read", k.nbytes + v.nbytes,
        lambda: attention_decode.decode_attention_numba(q, k, v, lengths), repeats)
    return KernelRun(f"attention decode {context // 1024}K",
                     roofline.attention_decode(context, n_heads, head_dim, "fp32"), seconds,
                     memory_roof="read", roofs=roofs)


def run_all_torch(plan: dict, device: str = "cuda", repeats: int = 10) -> list[KernelRun]:
    """The same kernels through torch on `device`, after their roofs: a copy and a sum over
    plan["roof_bytes"] (the copy and read roofs), and bf16 and fp32 matmuls of
    the largest of plan["roof_matmuls"] cubed. Then bf16 matmuls and GEMV, an fp32 triad, and bf16 decode
    attention (32 heads of 128) through scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    def seconds(run) -> float:
        if device == "cuda":
            return hardware.cuda_seconds(torch, run, repeats)
        return hardware.best_seconds(run, repeats)

    n = plan["roof_bytes"] // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    copy = 2 * src.nbytes / seconds(lambda: dst.copy_(src))
    read = src.nbytes / seconds(lambda: src.sum())
    del src, dst
    compute = {}
    m = max(plan["roof_matmuls"])
    for dtype, kind in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = (torch.randn(m, m, device=device, dtype=kind) for _ in range(2))
        compute[dtype] = 2 * m**3 / seconds(lambda: a @ b)
        del a, b
    roofs = Roofs({"copy": copy, "read": read}, compute,
                  how=f"torch copy and sum over {plan['roof_bytes'] // 2**20} MiB, torch matmul "
                      f"{m}^3 in bf16 and fp32, just before the kernels")

    def run(label, cost, dtype, work, memory_roof="copy") -> KernelRun:
        return KernelRun(label, cost, seconds(work), dtype, memory_roof, roofs)

    runs = []
    for n in plan["matmul"]:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        runs.append(run(f"matmul {n}", roofline.gemm(n, n, n, "bf16"), "bf16", lambda: a @ b))
    n = plan["gemv"]
    weights = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    runs.append(run(f"GEMV {n}x{n}", roofline.gemv(n, n, "bf16"), "bf16",
                    lambda: torch.mv(weights, x), "read"))
    del weights
    n = plan["triad_bytes"] // 4
    a, b, c = (torch.ones(n, device=device) for _ in range(3))
    runs.append(run(f"triad {plan['triad_bytes'] // 2**20} MiB", roofline.Cost(2 * n, 12 * n),
                    "fp32", lambda: torch.add(b, c, alpha=3.0, out=a)))
    del a, b, c
    context, heads, head_dim = plan["attention_context"], 32, 128
    q = torch.randn(1, heads, 1, head_dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, heads, context, head_dim, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    runs.append(run(f"attention decode {context // 1024}K",
                    roofline.attention_decode(context, heads, head_dim, "bf16"), "bf16",
                    lambda: F.scaled_dot_product_attention(q, k, v), "read"))
    return runs


# a quick run's sizes (infra_lab.sizes): every kernel and roof runs, each for milliseconds
SIZES["quick"] = {"matmul": [64, 256], "gemv": 1024, "triad_bytes": 2**20,
                  "attention_context": 2048, "roof_matmuls": (256,)}


def run_all(size: str = "small", progress: bool = True) -> list[KernelRun]:
    """Every kernel of the chapter at `size`, each with the roofs measured beside it: "small",
    "full" or "quick" on the CPU (numpy, numba), or "cuda" on the GPU (torch). On the CPU the
    matmuls come first, from small to large, then the compute roof, the fastest of a few
    larger cubes (a small call right after a large one can wait for the library's threads),
    then each memory-bound kernel in turns with its roof."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")
    if size == "cuda":
        return run_all_torch(SIZES["cuda"], "cuda")
    from infra_lab import progress as progress_bars

    plan = SIZES[size]
    sizes = plan["roof_matmuls"]
    jobs = [lambda n=n: time_matmul(n) for n in plan["matmul"]]
    jobs += [lambda: hardware.blas_peak("fp32", sizes)]
    jobs += [lambda: time_gemv(plan["gemv"]), lambda: time_triad(plan["triad_bytes"]),
             lambda: time_attention_decode(plan["attention_context"])]
    done = [job() for job in progress_bars.bar(jobs, desc="timing kernels", show=progress,
                                                leave=False)]
    matmuls, peak, memory = done[:len(plan["matmul"])], done[len(plan["matmul"])], done[-3:]
    compute = Roofs(compute={"fp32": peak}, how="the fastest numpy BLAS fp32 matmul of "
                    f"{', '.join(map(str, sizes))} cubes, just after the matmuls")
    return [replace(run, roofs=compute) for run in matmuls] + memory
