"""Checks for chapter 01's exercises, with their reference answers."""
from __future__ import annotations

import math

import numpy as np

from infra_lab.grading.checks import Check, register


def gemm_intensity(m: int, n: int, k: int, bytes_per_element: float) -> float:
    """FLOP/byte of (m, k) @ (k, n): 2mnk FLOPs over both operands read and the result written."""
    return 2 * m * n * k / ((m * k + k * n + m * n) * bytes_per_element)


def decode_step_seconds(n_params: float, bytes_per_param: float, batch: int,
                        kv_bytes_per_seq: float, peak_flops: float, bandwidth: float) -> float:
    """Lower bound on one decode step: the slower of 2 FLOPs per parameter per sequence at peak,
    and reading the weights once plus every sequence's KV cache at full bandwidth."""
    compute_s = 2 * n_params * batch / peak_flops
    memory_s = (n_params * bytes_per_param + batch * kv_bytes_per_seq) / bandwidth
    return max(compute_s, memory_s)


def critical_batch(peak_flops: float, bandwidth: float, bytes_per_param: float) -> int:
    """Smallest batch whose decode step (weights only) is compute-bound: 2B / b >= peak / bw."""
    return math.ceil(peak_flops * bytes_per_param / (2 * bandwidth))


def max_sequences(memory_bytes: float, n_params: float, bytes_per_param: float,
                  kv_bytes_per_token: float, seq_len: int) -> int:
    """Sequences of `seq_len` tokens whose KV caches fit beside the weights (0 if none)."""
    free = memory_bytes - n_params * bytes_per_param
    return max(0, math.floor(free / (kv_bytes_per_token * seq_len)))


def _gemm_case(rng: np.random.Generator) -> tuple:
    m, n, k = (int(rng.choice([1, 2, 7, 64, 128, 1000, 4096, 8192])) for _ in range(3))
    return m, n, k, float(rng.choice([0.5, 1, 2, 4]))


def _device(rng: np.random.Generator) -> tuple[float, float]:
    return float(rng.uniform(10, 2000) * 1e12), float(rng.uniform(0.3, 6) * 1e12)  # FLOP/s, B/s


def _decode_case(rng: np.random.Generator) -> tuple:
    peak, bandwidth = _device(rng)
    return (float(rng.uniform(0.1, 400) * 1e9), float(rng.choice([0.5, 1, 2])),
            int(rng.choice([1, 8, 64, 256, 1024, 8192])), float(rng.uniform(0, 4) * 2**30),
            peak, bandwidth)


def _critical_case(rng: np.random.Generator) -> tuple:
    peak, bandwidth = _device(rng)
    return peak, bandwidth, float(rng.choice([0.5, 1, 2, 4]))


def _fit_case(rng: np.random.Generator) -> tuple:
    return (float(rng.choice([16, 24, 80, 141, 192]) * 1e9), float(rng.uniform(0.5, 100) * 1e9),
            float(rng.choice([0.5, 1, 2])), float(rng.choice([32, 128, 512]) * 1024),
            int(rng.choice([512, 2048, 8192, 32768])))


register(Check("ch01.gemm_intensity", gemm_intensity, _gemm_case))
register(Check("ch01.decode_step_seconds", decode_step_seconds, _decode_case))
register(Check("ch01.critical_batch", critical_batch, _critical_case, rtol=0, atol=0))
register(Check("ch01.max_sequences", max_sequences, _fit_case, rtol=0, atol=0))
