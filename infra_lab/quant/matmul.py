"""Dequantizing matrix products (chapter 08): y = x W for small batches, reading W quantized.

A decode step is a GEMV per weight matrix, bound by the bytes it reads (chapter 01), so a weight
read in 4 bits instead of 32 can make it up to 8x faster, if the kernel turns the codes back
into numbers faster than memory delivers them. W (n_in, n_out), as the model applies it, is kept
transposed: row o holds output o's n_in weights, quantized along n_in in groups that each have
one fp16 scale (formats.quantize_int), int8 as one byte per value, int4 (and 3-bit codes, which
fit in a nibble) packed two to a byte. A method that rescales W's inputs first (AWQ's salient
channels, SmoothQuant's migrated outliers) leaves an `input_scale` that multiplies x.
Each output is then a sum over groups of scale times an integer dot product, and a row is one
contiguous stream of bytes. Within a group of g int4 values, byte j holds value j in its low
nibble and value j + g/2 in its high one (not formats.pack_int4's neighbours), each as v + 8 in
0..15, so that both nibbles of a run of bytes meet runs of x, and the kernel takes the 8 back out
once per group with the sum of x.

Three faces: numpy dequantizes W and multiplies (the reference); numba streams each row's codes
in plain loops over contiguous runs, which LLVM vectorizes (for int4 it never splits a byte into
two nibbles: byte * x_j + (byte >> 4) * (x_(j+g/2) - 16 x_j) is low * x_j + high * x_(j+g/2), so
one shift per byte does, with x's side prepared once per call); torch dequantizes on the tensors'
device and multiplies there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.quant import formats

MATRIX_BITS = (3, 4, 8)


@dataclass(frozen=True)
class QuantizedMatrix:
    """W (n_in, n_out) stored as its transpose, quantized along n_in."""
    n_in: int
    n_out: int
    bits: int  # 8; or 4 or 3, packed two to a byte
    group: int  # inputs sharing a scale (n_in for one scale per output: per channel)
    codes: np.ndarray  # int8 (n_out, n_in), or uint8 (n_out, n_in / 2) for 4 and 3 bits
    scales: np.ndarray  # fp16 (n_out, n_in / group)
    input_scale: np.ndarray | None = None  # float32 (n_in,): x * input_scale is what meets the codes

    @classmethod
    def quantize(cls, weights: np.ndarray, bits: int, group: int | None = None) -> QuantizedMatrix:
        """Round-to-nearest of W (n_in, n_out) to `bits` (8, 4 or 3) with a scale per `group`
        inputs of each output (None: per channel)."""
        weights = np.asarray(weights, np.float32)
        if weights.ndim != 2:
            raise ValueError(f"need a matrix (n_in, n_out); got shape {weights.shape}")
        check_bits(bits)
        values, scales = formats.quantize_int(weights.T, bits, group)  # (n_out, n_in), (n_out, n_groups)
        return cls.from_values(values, scales, bits, group)

    @classmethod
    def from_values(cls, values: np.ndarray, scales: np.ndarray, bits: int, group: int | None,
                    input_scale: np.ndarray | None = None) -> QuantizedMatrix:
        """Wrap integer values (n_out, n_in) and fp16 scales (n_out, n_in / group) that a method
        chose (round-to-nearest, GPTQ, AWQ): W (n_in, n_out) = diag(input_scale) (values * scales)^T."""
        check_bits(bits)
        values = np.asarray(values)
        if values.ndim != 2:
            raise ValueError(f"need values (n_out, n_in); got shape {values.shape}")
        n_out, n_in = values.shape
        group = group or n_in
        if bits != 8 and group % 2:
            raise ValueError(f"{bits}-bit groups hold whole bytes: the group size must be even; got {group}")
        scales = np.asarray(scales, np.float16)
        formats.groups_of(values, group)  # names a group that does not divide the row
        if scales.shape != (n_out, n_in // group):
            raise ValueError(f"need scales ({n_out}, {n_in // group}) for groups of {group}; got {scales.shape}")
        q_max = 2 ** (bits - 1) - 1
        if values.size and (values.min() < -q_max - 1 or values.max() > q_max):
            raise ValueError(f"{bits}-bit values must be in [{-q_max - 1}, {q_max}]; got "
                             f"{values.min()}..{values.max()}")
        if input_scale is not None:
            input_scale = np.ascontiguousarray(input_scale, np.float32)
            if input_scale.shape != (n_in,):
                raise ValueError(f"input_scale must be ({n_in},); got {input_scale.shape}")
        values = values.astype(np.int8)
        codes = values if bits == 8 else _pack_halves(values, group)
        return cls(n_in, n_out, bits, group, np.ascontiguousarray(codes), np.ascontiguousarray(scales), input_scale)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of W: the codes, the scales and any input scale."""
        extra = 0 if self.input_scale is None else self.input_scale.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra

    @property
    def packed_nbytes(self) -> float:
        """The size at `bits` per value, packed densely (3-bit codes sit in nibbles here), with the
        fp16 scales and any input scale stored in fp16."""
        extra = 0 if self.input_scale is None else formats.SCALE_BYTES * self.n_in
        return self.n_in * self.n_out * self.bits / 8 + self.scales.nbytes + extra

    def values(self) -> np.ndarray:
        """The integer codes as int8 (n_out, n_in), unpacked."""
        return self.codes if self.bits == 8 else _unpack_halves(self.codes, self.group)

    def dequantize(self) -> np.ndarray:
        """W (n_in, n_out) as the codes and scales give it back, float32, the input scale folded
        in: x @ dequantize() is the product."""
        weights = formats.dequantize_int(self.values(), self.scales, self.group).T
        return weights if self.input_scale is None else weights * self.input_scale[:, None]


def check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in MATRIX_BITS:
        raise ValueError(f"the matrix kernels read 8-bit codes, or 4- and 3-bit codes packed two to a byte; "
                         f"got bits={bits!r}")
    return bits


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


def _scaled(x, matrix: QuantizedMatrix):
    return x if matrix.input_scale is None else np.asarray(x, np.float32) * matrix.input_scale


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
def _int4_rows(x_first, x_rest, x_sums, packed, scales, group, out):
    # x_first (B, n_in / 2): each group's first half of x; x_rest: its second half minus 16 times
    # the first; x_sums (B, G): each group's sum of x; packed (n_out, n_in / 2) u8; out (B, n_out)
    batch = x_first.shape[0]
    half = group // 2
    for row in numba.prange(packed.shape[0]):
        for b in range(batch):
            total = np.float32(0)
            for g in range(x_first.shape[1] // half):
                run = packed[row, g * half:(g + 1) * half]  # 1-D views: loops LLVM vectorizes
                first, rest = x_first[b, g * half:(g + 1) * half], x_rest[b, g * half:(g + 1) * half]
                partial = np.float32(0)
                for j in range(half):  # byte = low + 16 high, so byte * first + high * rest
                    byte = np.int32(run[j])  # = low * first + high * second
                    partial += np.float32(byte) * first[j] + np.float32(byte >> 4) * rest[j]
                total += (partial - np.float32(8) * x_sums[b, g]) * scales[row, g]  # nibbles hold v + 8
            out[b, row] = total


def matmul_numba(x: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    """CPU: each thread streams its rows of codes once for every row of x."""
    _check(x, matrix)
    x = np.ascontiguousarray(_scaled(x, matrix), np.float32)
    out = np.empty((x.shape[0], matrix.n_out), np.float32)
    scales = matrix.scales.astype(np.float32)
    if matrix.bits != 8:
        halves = x.reshape(x.shape[0], -1, 2, matrix.group // 2)  # (B, G, 2, group / 2)
        x_first = np.ascontiguousarray(halves[:, :, 0]).reshape(x.shape[0], -1)
        x_rest = np.ascontiguousarray(halves[:, :, 1] - 16 * halves[:, :, 0]).reshape(x.shape[0], -1)
        x_sums = halves.sum((2, 3))  # (B, G)
        _int4_rows(x_first, x_rest, x_sums, matrix.codes, scales, matrix.group, out)
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
    if matrix.input_scale is not None:
        xt = xt * torch.from_numpy(matrix.input_scale).to(device)
    if matrix.bits != 8:  # per group: the low nibbles are its first half, the high ones its second
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
