"""Dequantizing matrix products (chapter 08): y = x W for small batches, reading W quantized.

A decode step is a GEMV per weight matrix, bound by the bytes it reads (chapter 01), so a weight
read in 4 bits instead of 32 can make it up to 8x faster, if the kernel turns the codes back
into numbers faster than memory delivers them. W (n_in, n_out), as the model applies it, is kept
transposed: row o holds output o's n_in weights, quantized along n_in in groups that each have
one fp16 scale (formats.quantize_int), int8 as one byte per value or int4 packed two to a byte.
Each output is then a sum over groups of scale times an integer dot product, and a row is one
contiguous stream of bytes.

Three faces: numpy dequantizes W and multiplies (the reference); numba streams the codes, a task
per four output rows so that each load of x serves four of them; torch dequantizes on the
tensors' device and multiplies there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.quant import formats

ROWS_PER_TASK = 4


@dataclass(frozen=True)
class QuantizedMatrix:
    """W (n_in, n_out) stored as its transpose, quantized along n_in."""
    n_in: int
    n_out: int
    bits: int  # 8, or 4 (packed two to a byte)
    group: int  # inputs sharing a scale (n_in for one scale per output: per channel)
    codes: np.ndarray  # int8 (n_out, n_in), or uint8 (n_out, n_in / 2) for int4
    scales: np.ndarray  # fp16 (n_out, n_in / group)

    @classmethod
    def quantize(cls, weights: np.ndarray, bits: int, group: int | None = None) -> QuantizedMatrix:
        """Round-to-nearest of W (n_in, n_out) to `bits` (8 or 4) with a scale per `group`
        inputs of each output (None: per channel)."""
        weights = np.asarray(weights, np.float32)
        if weights.ndim != 2:
            raise ValueError(f"need a matrix (n_in, n_out); got shape {weights.shape}")
        if bits not in (4, 8):
            raise ValueError(f"the matrix kernels read 8-bit or packed 4-bit codes; got bits={bits!r}")
        n_in, n_out = weights.shape
        values, scales = formats.quantize_int(weights.T, bits, group)  # (n_out, n_in), (n_out, n_groups)
        codes = formats.pack_int4(values) if bits == 4 else values
        return cls(n_in, n_out, bits, group or n_in, np.ascontiguousarray(codes), np.ascontiguousarray(scales))

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of W: the codes and the scales."""
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """W (n_in, n_out) as the codes and scales give it back, float32."""
        values = formats.unpack_int4(self.codes, self.n_in) if self.bits == 4 else self.codes
        return formats.dequantize_int(values, self.scales, self.group).T


def _check(x, matrix: QuantizedMatrix) -> None:
    if not isinstance(matrix, QuantizedMatrix):
        raise TypeError(f"need a QuantizedMatrix (QuantizedMatrix.quantize(W, bits, group)); got "
                        f"{type(matrix).__name__}")
    if len(x.shape) != 2 or x.shape[1] != matrix.n_in:
        raise ValueError(f"x must be (batch, {matrix.n_in}) for a ({matrix.n_in}, {matrix.n_out}) matrix; "
                         f"got {tuple(x.shape)}")


def matmul_numpy(x: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    """Reference: (batch, n_in) @ W -> (batch, n_out), W dequantized first."""
    _check(x, matrix)
    return np.asarray(x, np.float32) @ matrix.dequantize()


@numba.njit(parallel=True, fastmath=True, cache=True)
def _int8_rows(x, codes, scales, group, out):  # (B, n_in) f32, (n_out, n_in) i8, (n_out, G) f32, (B, n_out)
    batch, n_in = x.shape
    n_out = codes.shape[0]
    for task in numba.prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for row in range(task * ROWS_PER_TASK, min(task * ROWS_PER_TASK + ROWS_PER_TASK, n_out)):
            for b in range(batch):
                total = np.float32(0)
                for g in range(n_in // group):
                    partial = np.float32(0)  # the group's integer codes times x, then one scale
                    for i in range(g * group, (g + 1) * group):
                        partial += np.float32(codes[row, i]) * x[b, i]
                    total += partial * scales[row, g]
                out[b, row] = total


@numba.njit(parallel=True, fastmath=True, cache=True)
def _int4_rows(x, packed, scales, group, out):  # (B, n_in) f32, (n_out, n_in/2) u8, (n_out, G) f32, (B, n_out)
    batch, n_in = x.shape
    n_out = packed.shape[0]
    half = group // 2  # bytes per group
    for task in numba.prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for row in range(task * ROWS_PER_TASK, min(task * ROWS_PER_TASK + ROWS_PER_TASK, n_out)):
            for b in range(batch):
                total = np.float32(0)
                for g in range(n_in // group):
                    partial = np.float32(0)
                    for j in range(g * half, (g + 1) * half):
                        byte = np.int32(packed[row, j])
                        low = np.float32(((byte & 15) ^ 8) - 8)  # two's complement nibbles
                        high = np.float32(((byte >> 4) ^ 8) - 8)
                        partial += low * x[b, 2 * j] + high * x[b, 2 * j + 1]
                    total += partial * scales[row, g]
                out[b, row] = total


def matmul_numba(x: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    """CPU: each task streams four rows of codes once for every row of x."""
    _check(x, matrix)
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], matrix.n_out), np.float32)
    scales = matrix.scales.astype(np.float32)
    if matrix.bits == 4 and matrix.group % 2:
        return matmul_numpy(x, matrix)  # a group that splits a byte: the reference's order
    kernel = _int4_rows if matrix.bits == 4 else _int8_rows
    kernel(x, matrix.codes, scales, matrix.group, out)
    return out


def matmul_torch(x, matrix: QuantizedMatrix):
    """torch, on x's device (numpy x goes to the backend's): dequantize there, then multiply."""
    import torch

    _check(x, matrix)
    given_numpy = isinstance(x, np.ndarray)
    backend = backends.current()
    device = (backend.device if backend.name == "torch" else "cpu") if given_numpy else x.device
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device) if given_numpy else x.float()
    codes = torch.from_numpy(matrix.codes).to(device)
    if matrix.bits == 4:
        nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).to(torch.int16)  # (n_out, n_in)
        values = (nibbles ^ 8) - 8
    else:
        values = codes.to(torch.int16)
    scales = torch.from_numpy(matrix.scales.astype(np.float32)).to(device)
    weights = (values.float().unflatten(-1, (-1, matrix.group)) * scales[..., None]).flatten(-2)  # (n_out, n_in)
    result = xt @ weights.T
    return result.cpu().numpy() if given_numpy else result


FACES = {"numpy": matmul_numpy, "numba": matmul_numba, "torch": matmul_torch}


def matmul(x, matrix: QuantizedMatrix, backend: backends.Backend | None = None):
    """y = x W (batch, n_out) with W quantized, on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(x, matrix)
