"""Dequantizing matrix products (chapter 08): y = x W for small batches, reading W quantized.

A decode step is a GEMV per weight matrix, bound by the bytes it reads (chapter 01), so a weight
read in 4 bits instead of 32 can make it up to 8x faster, if the kernel turns the codes back
into numbers faster than memory delivers them. W (n_in, n_out), as the model applies it, is kept
transposed: row o holds output o's n_in weights, quantized along n_in in groups that each have
one fp16 scale (formats.quantize_int), int8 as one byte per value or int4 packed two to a byte.
Each output is then a sum over groups of scale times an integer dot product, and a row is one
contiguous stream of bytes. Within a group of g int4 values, byte j holds value j in its low
nibble and value j + g/2 in its high one (not formats.pack_int4's neighbours), each as v + 8 in
0..15, so that both nibbles of a run of bytes meet runs of x, and the kernel takes the 8 back out
once per group with the sum of x.

Three faces: numpy dequantizes W and multiplies (the reference); numba streams each row's codes
in plain loops over contiguous runs, which LLVM vectorizes; torch dequantizes on the tensors'
device and multiplies there.
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
        group = group or n_in
        if bits == 4 and group % 2:
            raise ValueError(f"int4 groups hold whole bytes: the group size must be even; got {group}")
        codes = _pack_halves(values, group) if bits == 4 else values
        return cls(n_in, n_out, bits, group, np.ascontiguousarray(codes), np.ascontiguousarray(scales))

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of W: the codes and the scales."""
        return self.codes.nbytes + self.scales.nbytes

    def values(self) -> np.ndarray:
        """The integer codes as int8 (n_out, n_in), unpacked."""
        return _unpack_halves(self.codes, self.group) if self.bits == 4 else self.codes

    def dequantize(self) -> np.ndarray:
        """W (n_in, n_out) as the codes and scales give it back, float32."""
        return formats.dequantize_int(self.values(), self.scales, self.group).T


def _pack_halves(values: np.ndarray, group: int) -> np.ndarray:
    """int4 values (n_out, n_in) -> uint8 (n_out, n_in / 2): in each group, byte j = value j
    (low nibble) and value j + group / 2 (high nibble), each stored as v + 8."""
    n_out, n_in = values.shape
    halves = values.reshape(n_out, n_in // group, 2, group // 2)
    pairs = np.stack([halves[:, :, 0], halves[:, :, 1]], axis=-1)  # (n_out, G, group / 2, 2)
    return formats.pack_int4(pairs.reshape(n_out, n_in)) ^ np.uint8(0x88)  # two's complement -> v + 8


def _unpack_halves(packed: np.ndarray, group: int) -> np.ndarray:
    n_out, n_in = packed.shape[0], 2 * packed.shape[1]
    pairs = formats.unpack_int4(packed ^ np.uint8(0x88), n_in).reshape(n_out, n_in // group, group // 2, 2)
    return np.concatenate([pairs[..., 0], pairs[..., 1]], axis=-1).reshape(n_out, n_in)


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
    for row in numba.prange(codes.shape[0]):
        for b in range(batch):
            total = np.float32(0)
            for g in range(n_in // group):
                run = codes[row, g * group:(g + 1) * group]  # 1-D views: loops LLVM vectorizes
                xs = x[b, g * group:(g + 1) * group]
                partial = np.float32(0)  # the group's codes times x, then one scale
                for i in range(group):
                    partial += np.float32(run[i]) * xs[i]
                total += partial * scales[row, g]
            out[b, row] = total


@numba.njit(parallel=True, fastmath=True, cache=True)
def _int4_rows(x, x_sums, packed, scales, group, out):  # x_sums (B, G): each group's sum of x
    batch, n_in = x.shape
    half = group // 2
    for row in numba.prange(packed.shape[0]):
        for b in range(batch):
            total = np.float32(0)
            for g in range(n_in // group):
                run = packed[row, g * half:(g + 1) * half]
                first, second = x[b, g * group:g * group + half], x[b, g * group + half:(g + 1) * group]
                low, high = np.float32(0), np.float32(0)
                for j in range(half):  # a nibble holds v + 8: x's group sum takes the 8 back out
                    byte = np.int32(run[j])
                    low += np.float32(byte & np.int32(15)) * first[j]
                    high += np.float32(byte >> np.int32(4)) * second[j]
                total += (low + high - np.float32(8) * x_sums[b, g]) * scales[row, g]
            out[b, row] = total


def matmul_numba(x: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    """CPU: each task streams four rows of codes once for every row of x."""
    _check(x, matrix)
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], matrix.n_out), np.float32)
    scales = matrix.scales.astype(np.float32)
    if matrix.bits == 4:
        x_sums = x.reshape(x.shape[0], -1, matrix.group).sum(-1)  # (B, G)
        _int4_rows(x, x_sums, matrix.codes, scales, matrix.group, out)
    else:
        _int8_rows(x, matrix.codes, scales, matrix.group, out)
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
    if matrix.bits == 4:  # per group: the low nibbles are its first half, the high ones its second
        nibbles = torch.stack([codes & 15, codes >> 4], dim=1).to(torch.int16)  # (n_out, 2, n_in / 2)
        halves = nibbles.unflatten(-1, (-1, matrix.group // 2)).transpose(1, 2)  # (n_out, G, 2, group / 2)
        values = (halves - 8).flatten(1)
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
