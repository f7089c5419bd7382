"""Quantizing the KV cache: int8 and int4 with a scale per group of values, and an fp8-like
e4m3 format.

Group-wise quantization (as in KIVI, Liu et al., 2024, and the int4 schemes of Dettmers and
Zettlemoyer, 2023) stores, for every `group` consecutive values of a token's head vector, one
scale s = max|x| / q_max and the integers round(x / s). Fewer bits per value, plus the scales'
overhead, is the memory; the rounding error is what the model pays in quality.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab.kv.contiguous import ContiguousKVCache

SCALE_BYTES = 2  # scales kept in fp16


@dataclass(frozen=True)
class Format:
    name: str
    bits: int  # per value
    group: int | None  # values sharing a scale; None: no scales

    @property
    def bytes_per_value(self) -> float:
        return self.bits / 8 + (SCALE_BYTES / self.group if self.group else 0)


FORMATS = {
    "fp32": Format("fp32", 32, None), "fp16": Format("fp16", 16, None),
    "int8": Format("int8", 8, 32), "fp8-e4m3": Format("fp8-e4m3", 8, None),
    "int4": Format("int4", 4, 32),
}


def _groups(x: np.ndarray, group: int) -> np.ndarray:
    if group < 1 or x.shape[-1] % group:
        raise ValueError(f"group size must be >= 1 and divide the last dimension {x.shape[-1]}; got {group}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def quantize_int(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric integer quantization: (values in [-q_max, q_max] as int8, scales (..., n_groups))."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8; got {bits}")
    q_max = 2 ** (bits - 1) - 1
    grouped = _groups(np.asarray(x, np.float32), group)
    exact = np.abs(grouped).max(-1) / q_max  # (..., n_groups)
    scales = exact.astype(np.float16)  # as stored, rounded up so that no value needs clipping
    scales = np.where(scales.astype(np.float32) < exact, np.nextafter(scales, np.float16(np.inf)), scales)
    safe = np.where(scales > 0, scales, 1).astype(np.float32)[..., None]
    values = np.clip(np.rint(grouped / safe), -q_max, q_max).astype(np.int8)
    return values.reshape(x.shape), scales


def dequantize_int(values: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    grouped = _groups(values.astype(np.float32), group)
    return (grouped * scales.astype(np.float32)[..., None]).reshape(values.shape)


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to the nearest fp8 e4m3 value (4 exponent bits, 3 mantissa bits, max 448,
    subnormals down to 2^-9), as in Micikevicius et al., "FP8 Formats for Deep Learning", 2022."""
    x = np.clip(np.asarray(x, np.float32), -448, 448)
    mantissa, exponent = np.frexp(x)  # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    step_exponent = np.maximum(exponent, -5) - 4  # 3 mantissa bits below the leading one
    return (np.rint(x * np.exp2(-step_exponent)) * np.exp2(step_exponent)).astype(np.float32)


def roundtrip(x: np.ndarray, fmt: str) -> np.ndarray:
    """What the cache gives back after storing `x` in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    spec = FORMATS[fmt]
    if fmt == "fp32":
        return np.asarray(x, np.float32)
    if fmt == "fp16":
        return np.asarray(x, np.float16).astype(np.float32)
    if fmt == "fp8-e4m3":
        return round_e4m3(x)
    return dequantize_int(*quantize_int(x, spec.bits, spec.group), spec.group)


class QuantizedKVCache(ContiguousKVCache):
    """A contiguous cache that stores K and V in `fmt` and hands back what that format keeps.
    The arrays here hold the dequantized values (a simulation); `nbytes` counts the real cost."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        super().__init__(n_layers, n_kv_heads, head_dim, max_len)
        self.fmt = fmt

    @property
    def nbytes(self) -> float:
        """Bytes K and V would take for the tokens held, scales included."""
        n_layers, _, _, _, n_kv, head_dim = self.cache.kv.shape
        return 2 * n_layers * self.length * n_kv * head_dim * FORMATS[self.fmt].bytes_per_value

    def store(self, layer: int, slots, k, v) -> None:
        """Write keys and values (T, n_kv_heads, head_dim) at `slots`, as the format keeps them."""
        self.cache.store(layer, slots, roundtrip(k, self.fmt), roundtrip(v, self.fmt))
