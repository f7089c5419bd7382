"""Attention, softmax(Q K^T / sqrt(d)) V, three ways: a numpy reference, FlashAttention's tiled
online softmax in numba, and torch's scaled_dot_product_attention.

FlashAttention (Dao et al., NeurIPS 2022) never writes the L x L score matrix: it walks over
blocks of keys, keeping for each query row a running max m, a running sum l of exp(s - m) and a
running output, and rescales them by exp(m_old - m_new) whenever the max grows (the online
softmax of Milakov and Gimelshein, 2018). Shapes: q (H, L, D); k, v (H_kv, L, D) with H a
multiple of H_kv (grouped-query attention); out (H, L, D).
"""
from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numba
import numpy as np
from threadpoolctl import ThreadpoolController

import scipy.linalg.cython_blas  # noqa: F401  the BLAS numba's np.dot calls: loaded before we limit it

from infra_lab import backend as backends

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
BLOCK_Q = BLOCK_K = 256  # query rows and key rows per tile of the numba kernel


@functools.cache
def _numba_blas():
    """scipy's BLAS, the one numba's np.dot calls, set to one thread for good (numpy's own BLAS,
    a separate library in pip wheels, keeps its threads). Changing a BLAS's thread count costs
    about a millisecond, too much to pay on every kernel call. None where scipy shares numpy's
    BLAS (conda's MKL, say): then each call limits it and puts it back."""
    controller = ThreadpoolController()
    own = controller.select(filepath=[lib.filepath for lib in controller.lib_controllers
                                      if lib.user_api == "blas" and "scipy" in Path(lib.filepath).parent.name])
    if not own.lib_controllers:
        return None
    own.limit(limits=1)
    return own


def single_threaded_blas():
    """A context in which the BLAS that numba calls runs on one thread, for kernels that call it
    from each of numba's threads, so that the two thread pools do not fight."""
    if _numba_blas() is not None:
        return contextlib.nullcontext()
    return ThreadpoolController().limit(limits=1, user_api="blas")


def _check(q_shape, k_shape, v_shape) -> None:
    if len(q_shape) != 3 or tuple(k_shape) != tuple(v_shape) or len(k_shape) != 3:
        raise ValueError(f"need q (H, L, D) and k, v (H_kv, L, D); got q {tuple(q_shape)}, "
                         f"k {tuple(k_shape)}, v {tuple(v_shape)}")
    if q_shape[1:] != k_shape[1:] or q_shape[0] % k_shape[0]:
        raise ValueError(f"q {tuple(q_shape)} does not fit k {tuple(k_shape)}: L and D must match "
                         "and H must be a multiple of H_kv")
    if q_shape[1] < 1 or q_shape[2] < 1:
        raise ValueError(f"need L >= 1 and D >= 1; got q {tuple(q_shape)}")


def attention_numpy(q, k, v, causal: bool = True, dtype=np.float64):
    """Reference: materializes the (L, L) scores per head, in `dtype` (float64 default)."""
    _check(q.shape, k.shape, v.shape)
    heads, length, d = q.shape
    group = heads // k.shape[0]
    q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    out = np.empty((heads, length, d), dtype)
    future = np.triu(np.ones((length, length), bool), 1)  # (L, L): key after query
    for h in range(heads):
        scores = q[h] @ k[h // group].T / math.sqrt(d)  # (L, L)
        if causal:
            scores[future] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[h] = weights @ v[h // group] / weights.sum(axis=1, keepdims=True)
    return out


@numba.njit(fastmath=True, cache=True)
def _exp_nonpositive(x, out, bits):  # x, out (n,) float32, x <= 0; bits (n,) int32
    """exp(x) in a loop LLVM can vectorize: exp(x) = 2^n e^u with n = round(x log2 e)
    and u = x - n ln 2 in [-0.35, 0.35], e^u by its degree-6 Taylor polynomial (relative
    error below 2e-7) and 2^n written straight into a float's exponent bits."""
    for i in range(x.shape[0]):
        t = max(x[i] * LOG2_E, -126.0)
        n = np.floor(t + 0.5)
        u = (t - n) * LN_2
        out[i] = 1 + u * (1 + u * (0.5 + u * (1 / 6 + u * (1 / 24 + u * (1 / 120
                                                                    + u / 720)))))
        bits[i] = (np.int32(n) + 127) << 23
    scale = bits.view(np.float32)
    for i in range(x.shape[0]):
        out[i] *= scale[i]


@numba.njit(parallel=True, fastmath=True, cache=True)
def _flash_forward(q, k, v, scale, causal, block_q, block_k, out):
    heads, length, d = q.shape
    group = heads // k.shape[0]
    n_qblocks = (length + block_q - 1) // block_q
    for task in numba.prange(heads * n_qblocks):
        h, qb = task // n_qblocks, task % n_qblocks
        q0, q1 = qb * block_q, min(length, (qb + 1) * block_q)
        rows = q1 - q0
        q_tile = q[h, q0:q1] * scale  # (rows, D)
        top = np.full(rows, -np.inf, np.float32)  # running max per query row
        total = np.zeros(rows, np.float32)  # running sum of exp(score - top)
        acc = np.zeros((rows, d), np.float32)  # running unnormalized output
        bits = np.empty(rows * block_k, np.int32)
        end = q1 if causal else length
        for k0 in range(0, end, block_k):
            k1 = min(end, k0 + block_k)
            cols = k1 - k0
            scores = np.dot(q_tile, k[h // group, k0:k1].T)  # (rows, cols), BLAS
            for r in range(rows):
                row = scores[r]
                visible = min(cols, q0 + r - k0 + 1) if causal else cols  # keys <= q
                if visible <= 0:
                    row[:] = -1e4  # exp gives ~1e-38, zeroed below
                    continue
                row_top = max(top[r], row[:visible].max())
                correction = math.exp(top[r] - row_top)
                top[r] = row_top
                total[r] *= correction
                acc[r] *= correction
                row -= row_top
            flat = scores.reshape(rows * cols)
            _exp_nonpositive(flat, flat, bits[: rows * cols])
            for r in range(rows):
                visible = min(cols, q0 + r - k0 + 1) if causal else cols
                scores[r, max(visible, 0):] = 0.0
                total[r] += scores[r].sum()
            acc += np.dot(scores, v[h // group, k0:k1])  # (rows, D), BLAS
        for r in range(rows):
            out[h, q0 + r] = acc[r] / total[r]


def attention_numba(q, k, v, causal: bool = True, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """FlashAttention forward on the CPU in float32: tiles through BLAS, extra memory
    O(block_q * (block_k + D)) per thread; the (L, L) scores never exist. BLAS runs on one
    thread inside each of numba's threads, so the two thread pools do not fight."""
    _check(q.shape, k.shape, v.shape)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1; got block_q={block_q}, block_k={block_k}")
    out = np.empty(q.shape, np.float32)
    q, k, v = (np.ascontiguousarray(x, np.float32) for x in (q, k, v))
    with single_threaded_blas():
        _flash_forward(q, k, v, np.float32(1 / math.sqrt(q.shape[2])), causal, block_q, block_k, out)
    return out


def work_per_head(length: int, head_dim: int, block_q: int = BLOCK_Q,
                  causal: bool = True) -> dict[str, tuple[int, int]]:
    """FLOPs and elements moved to and from slow memory (DRAM, HBM) by one head's
    attention: {"standard": (flops, elements), "tiled": (flops, elements)}.

    Standard attention (Algorithm 0 of Dao et al., 2022) reads Q and K, writes the (L, L)
    scores S, reads S back, writes P = softmax(S), reads P and V, writes O: 4 L d + 4 L^2
    elements, and computes every score, masked or not: 4 L^2 d FLOPs. The tiled kernel
    (`_flash_forward`) reads each block of `block_q` query rows once, and for each block
    the rows of K and V it attends to (up to the block's last query when causal), and
    writes O; it computes only those blocks' scores. K and V rows read again for a later
    block are counted again, as if no cache kept them.
    """
    if length < 1 or head_dim < 1 or block_q < 1:
        raise ValueError(f"need length, head_dim, block_q >= 1; "
                         f"got {length}, {head_dim}, {block_q}")
    L, d = length, head_dim
    firsts = range(0, L, block_q)
    rows = [min(L, first + block_q) - first for first in firsts]  # query rows per block
    keys = [first + n if causal else L for first, n in zip(firsts, rows)]  # K rows read
    standard = (4 * L * L * d, 4 * L * d + 4 * L * L)
    tiled = (4 * d * sum(n * m for n, m in zip(rows, keys)), 2 * L * d + 2 * d * sum(keys))
    return {"standard": standard, "tiled": tiled}


def attention_torch(q, k, v, causal: bool = True):
    """torch.nn.functional.scaled_dot_product_attention; numpy in, numpy out (on the backend's
    device), or tensors in, tensors out."""
    import torch
    import torch.nn.functional as F

    _check(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    as_numpy = isinstance(q, np.ndarray)
    if as_numpy:
        device = backends.torch_device()
        q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (q, k, v))
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0]
    return out.cpu().numpy() if as_numpy else out


FACES = {"numpy": attention_numpy, "numba": attention_numba, "torch": attention_torch}


def attention(q, k, v, causal: bool = True, backend: backends.Backend | None = None):
    """Attention on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(q, k, v, causal=causal)
