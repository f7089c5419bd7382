"""Quantizing the KV cache: int8 and int4 with a scale per group of values, and fp8 e4m3. The
formats themselves are `quant.formats`, which the weights (chapter 08) share.

Group-wise quantization (as in KIVI, Liu et al., 2024, and the int4 schemes of Dettmers and
Zettlemoyer, 2023) stores, for every `group` consecutive values of a token's head vector, one
scale s = max|x| / q_max and the integers round(x / s). Fewer bits per value, plus the scales'
overhead, is the memory; the rounding error is what the model pays in quality.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab.kv.contiguous import ContiguousKVCache
from infra_lab.quant.formats import SCALE_BYTES, dequantize_int, quantize_int, round_e4m3

__all__ = ["FORMATS", "Format", "QuantizedKVCache", "dequantize_int", "quantize_int", "round_e4m3", "roundtrip"]


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
