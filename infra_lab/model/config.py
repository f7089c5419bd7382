"""Shapes of transformer models: the book's two shipped ones and the published presets the
roofline chapter prices (`roofline.PRESETS`, whose `infra-lab-tiny` is the target here).

Parameter counts assume a LLaMA-style decoder: grouped-query attention, SwiGLU MLPs and, for a
mixture of experts, `n_experts` MLPs per layer of which each token uses `experts_per_token`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int  # fewer than n_heads: grouped-query attention
    d_ff: int  # SwiGLU hidden size: gate, up and down projections
    vocab: int = 256  # bytes: nothing to download
    context: int = 512  # tokens
    rope_theta: float = 10000.0
    source: str = ""  # where a published model's numbers come from
    n_experts: int = 1  # mixture of experts: MLPs per layer
    experts_per_token: int = 1
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tied_embeddings: bool = False  # the LM head is the embedding table (a pretrained model's file keeps one)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def attention_params(self) -> int:  # per layer: q, o (d x d); k, v (d x kv_width)
        return self.d_model * (2 * self.d_model + 2 * self.n_kv_heads * self.head_dim)

    @property
    def expert_params(self) -> int:  # one SwiGLU MLP
        return 3 * self.d_model * self.d_ff

    @property
    def router_params(self) -> int:
        return self.d_model * self.n_experts if self.n_experts > 1 else 0

    @property
    def total_params(self) -> int:
        """Every weight, the embedding table and LM head included (norms left out)."""
        per_layer = self.attention_params + self.n_experts * self.expert_params + self.router_params
        return self.n_layers * per_layer + (1 if self.tied_embeddings else 2) * self.vocab * self.d_model

    @property
    def active_params(self) -> int:
        """Weights one token multiplies (the embedding is only indexed, not multiplied)."""
        per_layer = self.attention_params + self.experts_per_token * self.expert_params + self.router_params
        return self.n_layers * per_layer + self.vocab * self.d_model

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per layer that `tokens` tokens route to, under uniform
        routing: E * (1 - (1 - k/E)^tokens)."""
        e, k = self.n_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** tokens) if e > 1 else 1.0


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array in a model's weight file, matrices as (in, out). A mixture of
    experts replaces each layer's MLP by a router (d, E), a balancing bias (E,) that chooses
    experts without weighing them (moe.routing), and the experts' stacked MLPs."""
    d, dh, e, f = config.d_model, config.head_dim, config.n_experts, config.d_ff
    shapes = {"embed": (config.vocab, d)}
    for i in range(config.n_layers):
        shapes |= {f"layers.{i}.attn_norm": (d,), f"layers.{i}.wq": (d, config.n_heads * dh),
                   f"layers.{i}.wk": (d, config.n_kv_heads * dh), f"layers.{i}.wv": (d, config.n_kv_heads * dh),
                   f"layers.{i}.wo": (config.n_heads * dh, d), f"layers.{i}.mlp_norm": (d,)}
        if config.n_experts > 1:
            shapes |= {f"layers.{i}.router": (d, e), f"layers.{i}.router_bias": (e,),
                       f"layers.{i}.w_gate": (e, d, f), f"layers.{i}.w_up": (e, d, f), f"layers.{i}.w_down": (e, f, d)}
        else:
            shapes |= {f"layers.{i}.w_gate": (d, f), f"layers.{i}.w_up": (d, f), f"layers.{i}.w_down": (f, d)}
    return shapes | {"final_norm": (d,), "lm_head": (d, config.vocab)}


CONFIGS: dict[str, ModelConfig] = {
    "target": ModelConfig("target", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=512),
    "draft": ModelConfig("draft", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256),
    # the target's attention, and 8 experts of half its MLP width, 2 per token: its active parameters
    "moe": ModelConfig("moe", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, n_experts=8,
                       experts_per_token=2),
}
