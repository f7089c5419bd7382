"""y = x W for a few rows of x: a decode step's matrix product at a small batch, reading W once.

A decode step of B requests multiplies B rows of activations by every weight matrix. At B = 1
numpy's BLAS runs a GEMV that streams W from memory once. From B = 2 or 3 on it runs a GEMM,
which first copies blocks of W into packed buffers to reuse them across many rows of x; with a
handful of rows there is nothing to reuse, and the copy reads and writes W again. On a 2-core
AMD EPYC a decode step of SmolLM2-135M (538 MB of float32 weights) took 39 ms at batches of 1
and 2 but 77 ms at 3 or 4: the step stopped being flat in the batch exactly where continuous
batching needs it to be (chapter 05). These kernels read W once for all B rows, so that a step
of a few requests costs about what one costs while it is bound by memory.

The model stores each matrix W (n_in, n_out) as the transpose of a row-major (n_out, n_in) array,
as torch's Linear keeps its weight and as a tied LM head is (the embedding table), so that each
output's weights are one contiguous row. The kernels take blocks of outputs per thread: at B = 1
one dot product per row (a GEMV); from B = 2 on, four rows at a time against two rows of x, eight
running sums for six loads, each row of weights read from memory once. On the machine above they
took SmolLM2's 121 matrices in 20, 29, 34, 39 and 53 ms at B = 1, 2, 4, 8 and 16, against BLAS's
23, 56, 57, 61 and 76. Within the engine's decode step, one row ran as fast through BLAS's GEMV,
so the model sends these kernels 2 to MOST_ROWS rows (Transformer.linear). Three faces: numpy
multiplies in float64 (the reference), numba runs the kernels, and torch multiplies on the
tensors' device.
"""
from __future__ import annotations

import numba
import numpy as np

BLOCK = 128  # outputs a task owns
MOST_ROWS = 16  # the largest batch the model sends here; beyond it BLAS's GEMM reuses W well
# The smallest matrix the model sends here: a smaller one stays in the caches, where BLAS's copy
# costs little, and waking the threads for it would cost more (the book's small GPTs' matrices).
SMALLEST_BYTES = 1 << 20


def _check(x: np.ndarray, w: np.ndarray) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"skinny_matmul needs x (B, n_in) and W (n_in, n_out); got x {tuple(x.shape)} and W "
                         f"{tuple(w.shape)}")


def matmul_numpy(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Reference: x (B, n_in) @ W (n_in, n_out) in float64 -> (B, n_out) float64."""
    _check(x, w)
    return x.astype(np.float64) @ w.astype(np.float64)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _one_row(x, w_t, out):  # x (1, n_in), W^T (n_out, n_in) row-major, out (1, n_out): a GEMV
    n_out, n_in = w_t.shape
    for task in numba.prange((n_out + BLOCK - 1) // BLOCK):
        for o in range(task * BLOCK, min((task + 1) * BLOCK, n_out)):
            total = np.float32(0)
            for i in range(n_in):
                total += w_t[o, i] * x[0, i]
            out[0, o] = total


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _few_rows(x, w_t, out):  # x (B, n_in), W^T (n_out, n_in) row-major, out (B, n_out)
    batch, n_in = x.shape
    n_out = w_t.shape[0]
    for task in numba.prange((n_out + BLOCK - 1) // BLOCK):
        o, stop = task * BLOCK, min((task + 1) * BLOCK, n_out)
        while o + 4 <= stop:  # 4 outputs' rows of weights, each read from memory once ...
            r0, r1, r2, r3 = w_t[o], w_t[o + 1], w_t[o + 2], w_t[o + 3]
            b = 0
            while b + 2 <= batch:  # ... meet 2 rows of x at a time: 8 sums for 6 loads
                xa, xb = x[b], x[b + 1]
                a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = np.float32(0)
                for i in range(n_in):
                    u, v = xa[i], xb[i]
                    a0 += r0[i] * u
                    a1 += r1[i] * u
                    a2 += r2[i] * u
                    a3 += r3[i] * u
                    c0 += r0[i] * v
                    c1 += r1[i] * v
                    c2 += r2[i] * v
                    c3 += r3[i] * v
                out[b, o], out[b, o + 1], out[b, o + 2], out[b, o + 3] = a0, a1, a2, a3
                out[b + 1, o], out[b + 1, o + 1], out[b + 1, o + 2], out[b + 1, o + 3] = c0, c1, c2, c3
                b += 2
            if b < batch:  # an odd row left
                a0 = a1 = a2 = a3 = np.float32(0)
                for i in range(n_in):
                    u = x[b, i]
                    a0 += r0[i] * u
                    a1 += r1[i] * u
                    a2 += r2[i] * u
                    a3 += r3[i] * u
                out[b, o], out[b, o + 1], out[b, o + 2], out[b, o + 3] = a0, a1, a2, a3
            o += 4
        for o in range(o, stop):  # fewer than 4 outputs left
            for b in range(batch):
                total = np.float32(0)
                for i in range(n_in):
                    total += w_t[o, i] * x[b, i]
                out[b, o] = total


def matmul_numba(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (B, n_in) float32 @ W (n_in, n_out) float32 -> (B, n_out) float32. W is best the
    transpose of a row-major (n_out, n_in) array, as the model stores its matrices; another
    layout is copied into that one first."""
    _check(x, w)
    x = np.ascontiguousarray(x, np.float32)
    w_t = np.ascontiguousarray(w.T, np.float32)  # no copy for the model's matrices
    out = np.empty((x.shape[0], w.shape[1]), np.float32)
    (_one_row if x.shape[0] == 1 else _few_rows)(x, w_t, out)
    return out


def matmul_torch(x, w):
    """The torch face: x @ W on the tensors' device (numpy arrays are taken onto the CPU)."""
    import torch

    x, w = torch.as_tensor(x), torch.as_tensor(w)
    _check(x, w)
    return x @ w
