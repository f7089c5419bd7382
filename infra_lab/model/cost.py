"""What one forward step of a transformer costs: FLOPs and compulsory bytes (chapter 01's
roofline model), for a uniform batch or for a mixed one (chapter 05's engine steps mix prefill
chunks and decodes). `infra_lab.roofline` builds its plots on these; the serving simulator times
steps with them.
"""
from __future__ import annotations

from dataclasses import dataclass

from infra_lab.model.config import ModelConfig

BYTES_PER_ELEMENT: dict[str, float] = {
    "fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
}


def bytes_per_element(dtype: str) -> float:
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(BYTES_PER_ELEMENT)}")
    return BYTES_PER_ELEMENT[dtype]


def _positive(**sizes: float) -> None:
    for name, value in sizes.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0; got {value}")


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:  # FLOP/byte
        return self.flops / self.bytes

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> float:
    """K and V for every layer: 2 * n_layers * n_kv_heads * head_dim elements."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element(dtype)


def step_cost(config: ModelConfig, batch: int, new_tokens: int, context: int,
              dtype: str) -> Cost:
    """One forward step: `batch` sequences each add `new_tokens` after `context`
    cached ones.

    Prefill of a P-token prompt is (batch=1, new_tokens=P, context=0); a decode step
    is (batch=B, new_tokens=1, context=C). Bytes count the weights read once (for a
    mixture of experts, only the experts some token routes to), the KV cache read and
    the new KV written; activations are left out, which flatters only tiny steps.
    """
    for label, value, least in (("batch", batch, 1), ("new_tokens", new_tokens, 1),
                                ("context", context, 0)):
        if value < least:
            raise ValueError(f"{label} must be >= {least}; got {value}")
    # batch_cost's sums for `batch` equal sequences, in closed form: O(1) at any batch
    attended = new_tokens * context + new_tokens * (new_tokens + 1) / 2  # causal pairs each
    return forward_cost(config, batch * new_tokens, batch * attended,
                        batch * (context + new_tokens), dtype)


def batch_cost(config: ModelConfig, sequences: list[tuple[int, int]], dtype: str) -> Cost:
    """One forward over a mixed batch, as an engine step runs it: sequence b adds
    sequences[b] = (context, new_tokens) new tokens after `context` cached ones (a prefill
    chunk, or a decode's one token). The weights are read once for the whole batch; each
    sequence reads its own cached K and V and writes its new ones."""
    if not sequences:
        raise ValueError("a step needs at least one sequence")
    tokens = attended = kv_tokens = 0
    for context, new_tokens in sequences:
        if context < 0 or new_tokens < 1:
            raise ValueError(f"each sequence needs context >= 0 and new_tokens >= 1; got "
                             f"({context}, {new_tokens})")
        tokens += new_tokens
        attended += new_tokens * context + new_tokens * (new_tokens + 1) / 2  # causal pairs
        kv_tokens += context + new_tokens
    return forward_cost(config, tokens, attended, kv_tokens, dtype)


def forward_cost(config: ModelConfig, tokens: int, attended: float, kv_tokens: int,
                 dtype: str) -> Cost:
    """A forward's FLOPs and bytes from its totals: new tokens, (query, key) pairs attended,
    and tokens whose K and V are read or written."""
    if tokens < 1 or attended < 0 or kv_tokens < tokens:
        raise ValueError(f"a forward needs tokens >= 1, attended >= 0 and kv_tokens >= tokens; got "
                         f"tokens={tokens}, attended={attended}, kv_tokens={kv_tokens}")
    element = bytes_per_element(dtype)
    attention_flops = 4 * config.n_layers * config.d_model * attended  # QK^T, PV
    flops = 2 * tokens * config.active_params + attention_flops
    experts = config.experts_touched(tokens) * config.expert_params
    weights = (config.n_layers * (config.attention_params + config.router_params + experts)
               + config.vocab * config.d_model)
    kv_traffic = kv_tokens * kv_bytes_per_token(config, dtype)
    return Cost(flops=flops, bytes=weights * element + kv_traffic)
