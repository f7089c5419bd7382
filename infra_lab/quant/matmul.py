"""Dequantizing matrix products (chapter 08): y = x W for small batches, reading W quantized.

A decode step is a GEMV per weight matrix, bound by the bytes it reads (chapter 01), so a weight
read in 4 bits instead of 32 can make it up to 8x faster, if the kernel turns the codes back
into numbers faster than memory delivers them. W (n_in, n_out), as the model applies it, is kept
transposed: row o holds output o's n_in weights, quantized along n_in in groups that each have
one fp16 scale (formats.quantize_int), int8 as one byte per value, int4 (and 3-bit codes, which
fit in a nibble) packed two to a byte. A method that rescales W's inputs first (AWQ's salient
channels, SmoothQuant's migrated outliers) leaves an `input_scale` that multiplies x.
Each output is then a sum over groups of scale times an integer dot product. Within a group of g
int4 values, value j sits in byte j's low nibble and value j + g/2 in its high one (not
formats.pack_int4's neighbours), each as v + 8 in 0..15, so that both nibbles of a run of bytes
meet runs of x, and the kernel takes the 8 back out once per group with the sum of x.

`codes` shows the matrix row by row (output o's bytes in a row), but it is stored in tiles of up
to 64 outputs (`TILE_ROWS`) that interleave them: tile t holds, for each input byte j, the bytes of
its outputs side by side, (n_out / rows, bytes per output, rows). A CPU kernel then makes the
outputs its vector lanes: it reads one 64-byte cache line per input byte, multiplies every lane by
the same x, and keeps 64 running sums, with no sum across lanes at the end of every group (which
cost the row-by-row kernel more than its arithmetic). The scales are tiled alike, as float32.

Three faces: numpy dequantizes W and multiplies (the reference); numba streams each tile once per
row of x in plain loops over its lanes, which LLVM vectorizes (for int4 it never splits a byte
into two nibbles: byte * x_j + (byte >> 4) * (x_(j+g/2) - 16 x_j) is low * x_j + high * x_(j+g/2),
so one shift per byte does, with x's side prepared once per call). A tile is one stream of
lines, but the kernel spends long enough on each that the hardware prefetchers fall behind, so it
asks for the line AHEAD lines on (kernels.prefetch) as it goes. The tiles are shared among the
threads, except for a product too small to pay for waking them (ONE_THREAD_BYTES), which one
thread runs. torch dequantizes on the tensors' device and multiplies there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels.prefetch import prefetch_l2
from infra_lab.quant import formats

MATRIX_BITS = (3, 4, 8)
TILE_ROWS = 64  # outputs per tile: one 64-byte cache line of codes per input byte
AHEAD = 32  # lines of a tile a kernel asks for before it reads them (kernels.prefetch)
# Below this many bytes read (codes times rows of x) a product runs on one thread. Between kernels
# the threads sleep (OMP_WAIT_POLICY=PASSIVE, infra_lab/__init__.py), and waking them took about
# 46 us on a 2-core VM, as long as one thread takes for 0.4 MB of int4 codes: SmolLM2-135M's int4
# decode at batch 1 (120 products of 0.17 to 0.9 MB) ran 1.3x faster on one thread.
ONE_THREAD_BYTES = 1 << 20


@dataclass(frozen=True)
class QuantizedMatrix:
    """W (n_in, n_out) stored as its transpose, quantized along n_in, in tiles of outputs."""
    n_in: int
    n_out: int
    bits: int  # 8; or 4 or 3, packed two to a byte
    group: int  # inputs sharing a scale (n_in for one scale per output: per channel)
    tiles: np.ndarray  # int8 (n_out / rows, n_in, rows), or uint8 (n_out / rows, n_in / 2, rows) for 4 and 3 bits
    tile_scales: np.ndarray  # float32 (n_out / rows, n_in / group, rows): fp16 values
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
        q_max = 2 ** (bits - 1) - 1
        formats.groups_of(values, group)  # names a group that does not divide the row
        if values.size and (values.min() < -q_max - 1 or values.max() > q_max):
            raise ValueError(f"{bits}-bit values must be in [{-q_max - 1}, {q_max}]; got "
                             f"{values.min()}..{values.max()}")
        values = values.astype(np.int8)
        codes = values if bits == 8 else _pack_halves(values, group)
        return cls.from_codes(codes, scales, bits, group, input_scale)

    @classmethod
    def from_codes(cls, codes: np.ndarray, scales: np.ndarray, bits: int, group: int | None,
                   input_scale: np.ndarray | None = None) -> QuantizedMatrix:
        """Wrap codes as `codes` shows them: int8 (n_out, n_in), or for 4 and 3 bits uint8
        (n_out, n_in / 2) with each group's halves in the low and high nibbles as v + 8."""
        check_bits(bits)
        codes = np.asarray(codes)
        want = np.int8 if bits == 8 else np.uint8
        if codes.ndim != 2 or codes.dtype != want:
            raise ValueError(f"need {np.dtype(want).name} codes (n_out, bytes per output); got "
                             f"{codes.dtype} {codes.shape}")
        n_out, n_in = codes.shape[0], codes.shape[1] * (1 if bits == 8 else 2)
        group = group or n_in
        if n_in % group or (bits != 8 and group % 2):
            raise ValueError(f"groups of {group} must divide the row of {n_in} inputs"
                             f"{'' if bits == 8 else ' and be even'}")
        scales = np.asarray(scales, np.float16)
        if scales.shape != (n_out, n_in // group):
            raise ValueError(f"need scales ({n_out}, {n_in // group}) for groups of {group}; got {scales.shape}")
        if input_scale is not None:
            input_scale = np.ascontiguousarray(input_scale, np.float32)
            if input_scale.shape != (n_in,):
                raise ValueError(f"input_scale must be ({n_in},); got {input_scale.shape}")
        rows = tile_rows(n_out)
        return cls(n_in, n_out, bits, group, _tile(codes, rows), _tile(scales.astype(np.float32), rows),
                   input_scale)

    @property
    def codes(self) -> np.ndarray:
        """The codes row by row: int8 (n_out, n_in), or uint8 (n_out, n_in / 2) for 4 and 3 bits."""
        return _untile(self.tiles)

    @property
    def scales(self) -> np.ndarray:
        """fp16 (n_out, n_in / group): one scale per output and group."""
        return _untile(self.tile_scales).astype(np.float16)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of W: the codes, the (float32) scales and any input scale."""
        extra = 0 if self.input_scale is None else self.input_scale.nbytes
        return self.tiles.nbytes + self.tile_scales.nbytes + extra

    @property
    def packed_nbytes(self) -> float:
        """The size at `bits` per value, packed densely (3-bit codes sit in nibbles here), with the
        fp16 scales and any input scale stored in fp16."""
        extra = 0 if self.input_scale is None else formats.SCALE_BYTES * self.n_in
        return self.n_in * self.n_out * self.bits / 8 + self.tile_scales.size * formats.SCALE_BYTES + extra

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


def tile_rows(n_out: int) -> int:
    """Outputs per tile: the largest power of two up to TILE_ROWS that divides n_out."""
    return int(np.gcd(n_out, TILE_ROWS)) if n_out else 1


def _tile(by_row: np.ndarray, rows: int) -> np.ndarray:
    """(n_out, k) -> (n_out / rows, k, rows): each tile's outputs side by side for every column."""
    n_out, k = by_row.shape
    return np.ascontiguousarray(by_row.reshape(n_out // rows, rows, k).transpose(0, 2, 1))


def _untile(tiles: np.ndarray) -> np.ndarray:
    n_tiles, k, rows = tiles.shape
    return np.ascontiguousarray(tiles.transpose(0, 2, 1)).reshape(n_tiles * rows, k)


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


@numba.njit(fastmath=True, cache=True, inline="always")
def _int8_tile(t, x, tiles, scales, group, out):
    # tile t of W for every row of x: x (B, n_in) f32; tiles (T, n_in, rows) i8; scales
    # (T, n_in / group, rows) f32; out (B, n_out)
    batch, n_in = x.shape
    rows = tiles.shape[2]
    flat = tiles.reshape(-1)
    ahead = t * n_in * rows + AHEAD * rows  # the line AHEAD lines on, in flat
    total = np.empty(rows, np.float32)  # the tile's outputs: its vector lanes
    partial = np.empty(rows, np.float32)  # each output's codes times x over the group
    for b in range(batch):
        total[:] = 0
        for g in range(n_in // group):
            partial[:] = 0
            i, stop = g * group, (g + 1) * group
            while i + 4 <= stop:  # four inputs per pass: a quarter of the trips through `partial`
                for line in range(4):
                    prefetch_l2(flat, min(ahead + (i + line) * rows, flat.size - 1))
                l0, l1, l2, l3 = tiles[t, i], tiles[t, i + 1], tiles[t, i + 2], tiles[t, i + 3]
                x0, x1, x2, x3 = x[b, i], x[b, i + 1], x[b, i + 2], x[b, i + 3]
                for r in range(rows):  # input i's codes for the tile's outputs, and the next three
                    partial[r] += (np.float32(np.int32(l0[r])) * x0 + np.float32(np.int32(l1[r])) * x1) + \
                        (np.float32(np.int32(l2[r])) * x2 + np.float32(np.int32(l3[r])) * x3)  # via int32:
                    # LLVM vectorizes that widening (1.6x faster on a 2-core EPYC than int8 -> float)
                i += 4
            for i in range(i, stop):
                line, xi = tiles[t, i], x[b, i]
                for r in range(rows):
                    partial[r] += np.float32(line[r]) * xi
            scale = scales[t, g]
            for r in range(rows):
                total[r] += partial[r] * scale[r]
        out[b, t * rows:(t + 1) * rows] = total


@numba.njit(fastmath=True, cache=True, inline="always")
def _int4_tile(t, x_first, x_rest, x_sums, tiles, scales, group, out):
    # tile t of W for every row of x: x_first (B, n_in / 2), each group's first half of x;
    # x_rest, its second half minus 16 times the first; x_sums (B, G), each group's sum of x;
    # tiles (T, n_in / 2, rows) u8; scales (T, G, rows) f32; out (B, n_out)
    batch = x_first.shape[0]
    half = group // 2
    rows, n_bytes = tiles.shape[2], tiles.shape[1]
    flat = tiles.reshape(-1)
    ahead = t * n_bytes * rows + AHEAD * rows  # the line AHEAD lines on, in flat
    total = np.empty(rows, np.float32)
    partial = np.empty(rows, np.float32)
    for b in range(batch):
        total[:] = 0
        for g in range(x_first.shape[1] // half):
            partial[:] = 0
            j, stop = g * half, (g + 1) * half
            while j + 2 <= stop:  # two bytes per pass: half the trips through `partial`
                prefetch_l2(flat, min(ahead + j * rows, flat.size - 1))
                prefetch_l2(flat, min(ahead + (j + 1) * rows, flat.size - 1))
                l0, f0, r0 = tiles[t, j], x_first[b, j], x_rest[b, j]
                l1, f1, r1 = tiles[t, j + 1], x_first[b, j + 1], x_rest[b, j + 1]
                for r in range(rows):  # byte = low + 16 high, so byte * first + high * rest
                    b0, b1 = np.int32(l0[r]), np.int32(l1[r])  # = low * first + high * second
                    partial[r] += (np.float32(b0) * f0 + np.float32(b0 >> 4) * r0) + \
                        (np.float32(b1) * f1 + np.float32(b1 >> 4) * r1)
                j += 2
            for j in range(j, stop):
                line, first, rest = tiles[t, j], x_first[b, j], x_rest[b, j]
                for r in range(rows):
                    byte = np.int32(line[r])
                    partial[r] += np.float32(byte) * first + np.float32(byte >> 4) * rest
            correction, scale = np.float32(8) * x_sums[b, g], scales[t, g]  # nibbles hold v + 8
            for r in range(rows):
                total[r] += (partial[r] - correction) * scale[r]
        out[b, t * rows:(t + 1) * rows] = total


@numba.njit(fastmath=True, cache=True, nogil=True)
def _int4_inputs(x, group):
    """x (B, n_in) -> x_first, x_rest (B, n_in / 2) and x_sums (B, G): each group's first half
    of x, its second half minus 16 times the first, and its sum (what _int4_tile meets)."""
    batch, n_in = x.shape
    half = group // 2
    x_first = np.empty((batch, n_in // 2), np.float32)
    x_rest = np.empty((batch, n_in // 2), np.float32)
    x_sums = np.zeros((batch, n_in // group), np.float32)
    for b in range(batch):
        for g in range(n_in // group):
            for j in range(half):
                first, second = x[b, g * group + j], x[b, g * group + half + j]
                x_first[b, g * half + j] = first
                x_rest[b, g * half + j] = second - 16 * first
                x_sums[b, g] += first + second
    return x_first, x_rest, x_sums


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _int8_threads(x, tiles, scales, group, out):
    for t in numba.prange(tiles.shape[0]):
        _int8_tile(t, x, tiles, scales, group, out)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _int8_one_thread(x, tiles, scales, group, out):
    for t in range(tiles.shape[0]):
        _int8_tile(t, x, tiles, scales, group, out)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _int4_threads(x, tiles, scales, group, out):
    x_first, x_rest, x_sums = _int4_inputs(x, group)
    for t in numba.prange(tiles.shape[0]):
        _int4_tile(t, x_first, x_rest, x_sums, tiles, scales, group, out)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _int4_one_thread(x, tiles, scales, group, out):
    x_first, x_rest, x_sums = _int4_inputs(x, group)
    for t in range(tiles.shape[0]):
        _int4_tile(t, x_first, x_rest, x_sums, tiles, scales, group, out)


def matmul_numba(x: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    """CPU: each thread streams its tiles of codes once for every row of x; a product that reads
    fewer than ONE_THREAD_BYTES (its codes times the rows of x) runs on the calling thread."""
    _check(x, matrix)
    x = np.ascontiguousarray(_scaled(x, matrix), np.float32)
    out = np.empty((x.shape[0], matrix.n_out), np.float32)
    one_thread = x.shape[0] * matrix.tiles.nbytes < ONE_THREAD_BYTES
    if matrix.bits != 8:
        (_int4_one_thread if one_thread else _int4_threads)(x, matrix.tiles, matrix.tile_scales, matrix.group, out)
    else:
        (_int8_one_thread if one_thread else _int8_threads)(x, matrix.tiles, matrix.tile_scales, matrix.group, out)
    return out


def matmul_torch(x, matrix: QuantizedMatrix):
    """torch, on x's device (numpy x goes to the backend's): dequantize there, then multiply."""
    import torch

    _check(x, matrix)
    given_numpy = isinstance(x, np.ndarray)
    device = backends.torch_device() if given_numpy else x.device
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device) if given_numpy else x.float()
    by_row = lambda tiles: torch.from_numpy(tiles).to(device).transpose(1, 2).flatten(0, 1)  # noqa: E731
    codes = by_row(matrix.tiles)  # (n_out, bytes per output): the tiles laid out row by row on the device
    if matrix.input_scale is not None:
        xt = xt * torch.from_numpy(matrix.input_scale).to(device)
    if matrix.bits != 8:  # per group: the low nibbles are its first half, the high ones its second
        nibbles = torch.stack([codes & 15, codes >> 4], dim=1).to(torch.int16)  # (n_out, 2, n_in / 2)
        halves = nibbles.unflatten(-1, (-1, matrix.group // 2)).transpose(1, 2)  # (n_out, G, 2, group / 2)
        values = (halves - 8).flatten(1)
    else:
        values = codes.to(torch.int16)
    scales = by_row(matrix.tile_scales)  # (n_out, G) float32
    weights = (values.float().unflatten(-1, (-1, matrix.group)) * scales[..., None]).flatten(-2)  # (n_out, n_in)
    result = xt @ weights.T
    return result.cpu().numpy() if given_numpy else result


FACES = {"numpy": matmul_numpy, "numba": matmul_numba, "torch": matmul_torch}


def matmul(x, matrix: QuantizedMatrix, backend: backends.Backend | None = None):
    """y = x W (batch, n_out) with W quantized, on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(x, matrix)
