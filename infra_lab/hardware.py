"""Devices and their limits: datasheet numbers for accelerators, and a probe of this machine.

A Device holds the two roofs of the roofline model (Williams, Waterman and Patterson, CACM
2009): peak FLOP/s per dtype and memory bandwidth in bytes/s. Catalog numbers are dense (no
2:4 sparsity) and each carries its source.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numba
import numpy as np

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    source: str
    notes: dict[str, str] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; raises if the device has no such unit."""
        if dtype not in self.peak_flops:
            raise ValueError(
                f"{self.name} has no {dtype!r} peak; it has {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[dtype]


H100_SXM = Device(
    name="H100 SXM",
    peak_flops={"fp64": 34 * TERA, "fp32": 67 * TERA, "tf32": 494.7 * TERA,
                "bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "fp8": 1978.9 * TERA,
                "int8": 1978.9 * TERA},
    memory_bandwidth=3.35e12,
    memory_bytes=80e9,
    source="NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column; tensor-core figures "
           "there are quoted with sparsity, the dense rates used here are half of them",
)

T4 = Device(
    name="T4",
    peak_flops={"fp32": 8.1 * TERA, "fp16": 65 * TERA, "int8": 130 * TERA},
    memory_bandwidth=320e9,
    memory_bytes=16e9,
    source="NVIDIA T4 Tensor Core GPU datasheet (2019)",
)

CATALOG: dict[str, Device] = {device.name: device for device in (H100_SXM, T4)}


def get(name: str) -> Device:
    """The catalog Device called `name`."""
    if name not in CATALOG:
        raise KeyError(f"unknown device {name!r}; known devices: {', '.join(CATALOG)}")
    return CATALOG[name]


@numba.njit(parallel=True, cache=True)
def _triad(a, b, c, scalar):  # a[i] = b[i] + scalar * c[i], all (n,)
    for i in numba.prange(a.shape[0]):
        a[i] = b[i] + scalar * c[i]


def measure_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: the best of `repeats` STREAM triads over 3 float32 arrays
    of `n_bytes` each. STREAM counts 3 arrays moved per pass (McCalpin, 1995)."""
    if n_bytes < 4 or repeats < 1:
        raise ValueError(f"need n_bytes >= 4 and repeats >= 1; got {n_bytes}, {repeats}")
    n = n_bytes // 4
    a, b, c = np.empty(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    _triad(a, b, c, np.float32(3.0))  # compile and touch every page
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _triad(a, b, c, np.float32(3.0))
        best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best


def measure_matmul_flops(dtype: str = "fp32", n: int = 1024, repeats: int = 3) -> float:
    """Peak FLOP/s of numpy's BLAS for an n x n x n matmul: the best of `repeats`."""
    numpy_dtypes = {"fp32": np.float32, "fp64": np.float64}
    if dtype not in numpy_dtypes:
        raise ValueError(f"numpy BLAS measures {', '.join(numpy_dtypes)}; got {dtype!r}")
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1; got {n}, {repeats}")
    rng = np.random.default_rng(0)
    left = rng.standard_normal((n, n)).astype(numpy_dtypes[dtype])
    right = rng.standard_normal((n, n)).astype(numpy_dtypes[dtype])
    left @ right  # warm up the BLAS threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        left @ right
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def measure_quick() -> Device:
    """This CPU's roofs, measured in about a second: DRAM triad bandwidth, BLAS fp32/fp64."""
    return Device(
        name="this machine (CPU)",
        peak_flops={"fp32": measure_matmul_flops("fp32"), "fp64": measure_matmul_flops("fp64")},
        memory_bandwidth=measure_bandwidth(),
        memory_bytes=float(_memory_bytes()),
        source="measured here: numba STREAM triad and numpy BLAS matmul",
    )


def _memory_bytes() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
