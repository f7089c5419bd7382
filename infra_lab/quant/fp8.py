"""fp8 matrix products (chapter 08): y = x W with W and x both in fp8 e4m3, each with one fp32
scale, accumulated in fp32: the "W8A8-FP8" scheme of the FP8 formats paper (Micikevicius et al.,
"FP8 Formats for Deep Learning", 2022, Section 4) that Hopper's tensor cores run at twice their
bf16 rate.

W's scale is fixed when it is quantized (max|W| / 448, so its largest weight lands on e4m3's
largest value); x's is taken per call from max|x| (dynamic, per tensor). The product is
(sx · sw) · (x/sx rounded to e4m3) @ (W/sw rounded to e4m3).

Three faces: numpy decodes both through the code table and multiplies in float64 (the reference);
numba streams W's codes through the same 256-entry table; torch runs `torch._scaled_mm` on a CUDA
GPU of compute capability 8.9 or higher (Ada, Hopper), whose tensor cores multiply fp8, and on any
other device decodes to float32 and multiplies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from infra_lab import backend as backends
from infra_lab.quant import formats

E4M3_TABLE = formats.TABLES[formats.E4M3.name]


def tensor_scale(x) -> np.float32:
    """max|x| / 448 as float32 (1 for an all-zero x): x / scale fills e4m3's range."""
    peak = float(np.max(np.abs(x))) if np.size(x) else 0.0
    if not np.isfinite(peak):
        raise ValueError(f"fp8 needs finite values to scale; got max |x| = {peak}")
    return np.float32(peak / formats.E4M3.max_value if peak > 0 else 1.0)


@dataclass(frozen=True)
class Fp8Matrix:
    """W (n_in, n_out) as e4m3 codes (n_in, n_out), as the model applies it, and one scale."""
    codes: np.ndarray  # uint8 (n_in, n_out)
    scale: np.float32

    @classmethod
    def quantize(cls, weights) -> Fp8Matrix:
        weights = np.asarray(weights, np.float32)
        if weights.ndim != 2:
            raise ValueError(f"need a matrix (n_in, n_out); got shape {weights.shape}")
        scale = tensor_scale(weights)
        return cls(np.ascontiguousarray(formats.encode(weights / scale, formats.E4M3)), scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + 4

    def dequantize(self) -> np.ndarray:
        return formats.decode(self.codes, formats.E4M3) * self.scale


def _check(x, matrix: Fp8Matrix) -> None:
    if not isinstance(matrix, Fp8Matrix):
        raise TypeError(f"need an Fp8Matrix (Fp8Matrix.quantize(W)); got {type(matrix).__name__}")
    if len(x.shape) != 2 or x.shape[1] != matrix.shape[0]:
        raise ValueError(f"x must be (batch, {matrix.shape[0]}) for a {matrix.shape} matrix; got {tuple(x.shape)}")


def quantize_input(x) -> tuple[np.ndarray, np.float32]:
    """x (batch, n_in) -> (e4m3 codes, scale): the per-call, per-tensor activation scale."""
    x = np.asarray(x, np.float32)
    scale = tensor_scale(x)
    return formats.encode(x / scale, formats.E4M3), scale


def matmul_numpy(x, matrix: Fp8Matrix) -> np.ndarray:
    """Reference: both operands decoded exactly, products summed in float64."""
    _check(x, matrix)
    codes, x_scale = quantize_input(x)
    exact = formats.decode(codes, formats.E4M3).astype(np.float64) @ \
        formats.decode(matrix.codes, formats.E4M3).astype(np.float64)
    return (exact * (float(x_scale) * float(matrix.scale))).astype(np.float32)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _table_rows(xv, codes, table, out):  # xv (B, n_in) f32 decoded x, codes (n_in, n_out) u8, out (B, n_out)
    batch, n_in = xv.shape
    n_out = codes.shape[1]
    for b in numba.prange(batch):
        for i in range(n_in):
            weight_row = codes[i]
            xi = xv[b, i]
            for o in range(n_out):
                out[b, o] += xi * table[weight_row[o]]


def matmul_numba(x, matrix: Fp8Matrix) -> np.ndarray:
    """CPU: W's codes decoded through the 256-entry table as they stream past."""
    _check(x, matrix)
    codes, x_scale = quantize_input(x)
    out = np.zeros((codes.shape[0], matrix.shape[1]), np.float32)
    _table_rows(formats.decode(codes, formats.E4M3), matrix.codes, E4M3_TABLE, out)
    return out * (x_scale * matrix.scale)


def has_fp8_tensor_cores(device) -> bool:
    import torch

    return torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def matmul_torch(x, matrix: Fp8Matrix):
    """torch on x's device (numpy x goes to the backend's): `torch._scaled_mm` on fp8 tensor cores,
    else float32 after decoding."""
    import torch

    _check(x, matrix)
    given_numpy = isinstance(x, np.ndarray)
    device = backends.torch_device() if given_numpy else x.device
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device) if given_numpy else x.float()
    x_scale = torch.clamp(xt.abs().max() / formats.E4M3.max_value, min=torch.finfo(torch.float32).tiny)
    if not bool((xt.abs().max() > 0).item()):
        x_scale = torch.ones((), device=device)
    x8 = (xt / x_scale).to(torch.float8_e4m3fn)
    w8 = torch.from_numpy(matrix.codes).to(device).view(torch.float8_e4m3fn)
    w_scale = torch.tensor(float(matrix.scale), device=device)
    if has_fp8_tensor_cores(device):  # cuBLASLt wants the second operand column-major
        result = torch._scaled_mm(x8, w8.t().contiguous().t(), scale_a=x_scale.float(), scale_b=w_scale,
                                  out_dtype=torch.bfloat16).float()
    else:
        result = (x8.float() @ w8.float()) * (x_scale * w_scale)
    return result.cpu().numpy() if given_numpy else result


FACES = {"numpy": matmul_numpy, "numba": matmul_numba, "torch": matmul_torch}


def matmul(x, matrix: Fp8Matrix, backend: backends.Backend | None = None):
    """y = x W (batch, n_out), x and W in fp8 e4m3, on the current backend (or the one given)."""
    return backends.pick(FACES, backend)(x, matrix)
