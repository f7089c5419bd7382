"""The experts' work: a SwiGLU MLP per expert over its contiguous run of sorted tokens.

After dispatch (moe.dispatch), expert e owns rows offsets[e]:offsets[e + 1] of x_sorted (N, d),
and computes (silu(x W_gate[e]) * (x W_up[e])) W_down[e] on them: three matrix products per expert
over batches of different sizes, a grouped GEMM. Three faces: numpy (the reference, one expert at
a time); numba (one compiled pass over the experts, each product a BLAS call on its rows, the
SwiGLU fused between them); torch (a loop of matmuls on the tensors' device; torch 2.13 has no
public grouped matmul, its `torch._grouped_mm` being private and for recent NVIDIA GPUs only).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from infra_lab import backend as backends


class ExpertWeights(NamedTuple):
    gate: np.ndarray  # (E, d, f) float32
    up: np.ndarray  # (E, d, f)
    down: np.ndarray  # (E, f, d)

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]


def check(x_sorted, offsets, weights: ExpertWeights) -> None:
    n_experts, d, f = weights.gate.shape
    if weights.up.shape != (n_experts, d, f) or weights.down.shape != (n_experts, f, d):
        raise ValueError(f"expert weights must be gate and up (E, d, f), down (E, f, d); got "
                         f"{weights.gate.shape}, {weights.up.shape}, {weights.down.shape}")
    if len(x_sorted.shape) != 2 or x_sorted.shape[1] != d:
        raise ValueError(f"tokens must be (N, {d}) for experts of width {d}; got {tuple(x_sorted.shape)}")
    offsets = np.asarray(offsets)
    if offsets.shape != (n_experts + 1,) or offsets[0] != 0 or offsets[-1] != x_sorted.shape[0] \
            or (np.diff(offsets) < 0).any():
        raise ValueError(f"offsets must rise from 0 to the {x_sorted.shape[0]} rows, one run per each of "
                         f"{n_experts} experts; got {offsets.tolist()}")


def silu(x):
    return x / (1 + np.exp(-x))


def experts_numpy(x_sorted: np.ndarray, offsets: np.ndarray, weights: ExpertWeights) -> np.ndarray:
    """Reference: (N, d) -> (N, d), expert by expert."""
    check(x_sorted, offsets, weights)
    out = np.empty_like(x_sorted, dtype=np.float32)
    for e in range(weights.n_experts):
        rows = x_sorted[offsets[e]:offsets[e + 1]].astype(np.float32)  # (n_e, d)
        out[offsets[e]:offsets[e + 1]] = (silu(rows @ weights.gate[e]) * (rows @ weights.up[e])) @ weights.down[e]
    return out


LOG2E = 1.4426950408889634
# 2^f for f in [0, 1): its Taylor series in f ln 2 to degree 7, relative error below 1.4e-6
EXP2_TAYLOR = tuple(math.log(2) ** k / math.factorial(k) for k in range(7, -1, -1))  # highest power first


@numba.njit(fastmath=True, error_model="numpy", parallel=True, cache=True)
def silu_times(hidden, lifted):
    """hidden <- silu(hidden) * lifted, in place; both (n, f) float32. numba has no vector exp
    here (no SVML), and a scalar call per value cost more than the expert's matrix products, so
    e^-x is computed in the vector lanes: -x log2(e) = n + f, 2^n from its exponent bits and 2^f
    from a polynomial; relative error below 1e-5 (the float32 rounding of n + f dominates).
    (error_model="numpy" lets the division vectorize: Python's would check for zero first.)"""
    c7, c6, c5, c4, c3, c2, c1, c0 = EXP2_TAYLOR
    for i in numba.prange(hidden.shape[0]):
        row, up = hidden[i], lifted[i]
        bits = np.empty(row.shape[0], np.int32)  # 2^n as float32 bits: (n + 127) << 23
        for j in range(row.shape[0]):
            t = min(max(-row[j] * np.float32(LOG2E), np.float32(-126)), np.float32(126))
            bits[j] = (np.int32(np.floor(t)) + np.int32(127)) << 23
        two_n = bits.view(np.float32)
        for j in range(row.shape[0]):
            t = min(max(-row[j] * np.float32(LOG2E), np.float32(-126)), np.float32(126))
            f = t - np.floor(t)
            p = np.float32(c7) * f + np.float32(c6)
            p = p * f + np.float32(c5)
            p = p * f + np.float32(c4)
            p = p * f + np.float32(c3)
            p = p * f + np.float32(c2)
            p = p * f + np.float32(c1)
            p = p * f + np.float32(c0)  # 2^f
            row[j] = row[j] / (np.float32(1) + two_n[j] * p) * up[j]


@numba.njit(fastmath=True, cache=True)
def _grouped_swiglu(x_sorted, offsets, gate, up, down, out):
    # x_sorted (N, d), offsets (E + 1,), gate/up (E, d, f), down (E, f, d), out (N, d); all float32
    for e in range(gate.shape[0]):
        first, last = offsets[e], offsets[e + 1]
        if last == first:
            continue
        rows = x_sorted[first:last]
        hidden = np.dot(rows, gate[e])  # (n_e, f): BLAS
        silu_times(hidden, np.dot(rows, up[e]))
        out[first:last] = np.dot(hidden, down[e])


def experts_numba(x_sorted: np.ndarray, offsets: np.ndarray, weights: ExpertWeights) -> np.ndarray:
    """CPU: one compiled pass over the ragged batches, BLAS for the products."""
    check(x_sorted, offsets, weights)
    out = np.empty((x_sorted.shape[0], x_sorted.shape[1]), np.float32)
    _grouped_swiglu(np.ascontiguousarray(x_sorted, np.float32), np.asarray(offsets, np.int64),
                    *(np.ascontiguousarray(w, np.float32) for w in weights), out)
    return out


def experts_torch(x_sorted, offsets, weights: ExpertWeights):
    """torch, on x's device (numpy x goes to the backend's): one matmul chain per expert."""
    import torch

    check(x_sorted, offsets, weights)
    given_numpy = isinstance(x_sorted, np.ndarray)
    device = backends.torch_device() if given_numpy else x_sorted.device
    x = torch.from_numpy(np.ascontiguousarray(x_sorted, np.float32)).to(device) if given_numpy else x_sorted
    gate, up, down = (w.to(device) if isinstance(w, torch.Tensor) else torch.from_numpy(np.asarray(w, np.float32)).to(device)
                      for w in weights)
    out = torch.empty_like(x)
    bounds = np.asarray(offsets).tolist()
    for e in range(len(bounds) - 1):
        rows = x[bounds[e]:bounds[e + 1]]
        out[bounds[e]:bounds[e + 1]] = (torch.nn.functional.silu(rows @ gate[e]) * (rows @ up[e])) @ down[e]
    return out.cpu().numpy() if given_numpy else out


FACES = {"numpy": experts_numpy, "numba": experts_numba, "torch": experts_torch}


def run_experts(x_sorted, offsets, weights: ExpertWeights, backend: backends.Backend | None = None):
    """(N, d) -> (N, d) on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(x_sorted, offsets, weights)
