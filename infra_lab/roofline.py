"""The roofline model for a transformer step: FLOPs, bytes moved, and which roof binds.

A kernel doing F FLOPs while moving B bytes has arithmetic intensity F/B. On a device with peak
P FLOP/s and bandwidth W bytes/s it needs at least max(F/P, B/W) seconds; it is memory-bound
when F/B < P/W, the ridge point (Williams, Waterman and Patterson, CACM 2009).
"""
from __future__ import annotations

from dataclasses import dataclass

from infra_lab.hardware import Device

BYTES_PER_ELEMENT: dict[str, float] = {
    "fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int  # SwiGLU hidden size: gate, up and down projections
    vocab: int
    source: str

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def matmul_params(self) -> int:
        """Weights that multiply activations: attention, MLP and the LM head (not the embedding
        table, which a step only indexes)."""
        kv_width = self.n_kv_heads * self.head_dim
        attention = self.d_model * (2 * self.d_model + 2 * kv_width)  # q, o; k, v
        mlp = 3 * self.d_model * self.d_ff
        return self.n_layers * (attention + mlp) + self.vocab * self.d_model


LLAMA_3_8B = ModelConfig(
    name="llama-3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
    vocab=128256, source="config.json of meta-llama/Meta-Llama-3-8B on Hugging Face",
)
LLAMA_2_7B = ModelConfig(
    name="llama-2-7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
    vocab=32000, source="config.json of meta-llama/Llama-2-7b-hf on Hugging Face",
)
PRESETS: dict[str, ModelConfig] = {config.name: config for config in (LLAMA_3_8B, LLAMA_2_7B)}


def bytes_per_element(dtype: str) -> float:
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(BYTES_PER_ELEMENT)}")
    return BYTES_PER_ELEMENT[dtype]


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> float:
    """K and V for every layer: 2 * n_layers * n_kv_heads * head_dim elements."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element(dtype)


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:  # FLOP/byte
        return self.flops / self.bytes


def step_cost(config: ModelConfig, batch: int, new_tokens: int, context: int,
              dtype: str) -> StepCost:
    """One forward step: `batch` sequences each add `new_tokens` after `context` cached ones.

    Prefill of a P-token prompt is (batch=1, new_tokens=P, context=0); a decode step is
    (batch=B, new_tokens=1, context=C). Bytes count weights read once, the KV cache read and
    the new KV written; activations are left out, which flatters only tiny steps.
    """
    for label, value, least in (("batch", batch, 1), ("new_tokens", new_tokens, 1),
                                ("context", context, 0)):
        if value < least:
            raise ValueError(f"{label} must be >= {least}; got {value}")
    element = bytes_per_element(dtype)
    tokens = batch * new_tokens
    attended = new_tokens * context + new_tokens * (new_tokens + 1) / 2  # per sequence
    attention_flops = 4 * config.n_layers * config.d_model * attended * batch  # QK^T and PV
    flops = 2 * tokens * config.matmul_params + attention_flops
    kv_traffic = batch * (context + new_tokens) * kv_bytes_per_token(config, dtype)
    return StepCost(flops=flops, bytes=config.matmul_params * element + kv_traffic)


def ridge_point(device: Device, dtype: str) -> float:
    """FLOP/byte above which `device` is compute-bound for `dtype`."""
    return device.flops(dtype) / device.memory_bandwidth


def time_lower_bound(cost: StepCost, device: Device, dtype: str) -> tuple[float, str]:
    """(seconds, "compute" or "memory"): the larger of the two roofs' times, and which it is."""
    compute_s = cost.flops / device.flops(dtype)
    memory_s = cost.bytes / device.memory_bandwidth
    return (compute_s, "compute") if compute_s >= memory_s else (memory_s, "memory")
