"""Shapes of the two shipped models. The roofline chapter's preset `infra-lab-tiny` is the target."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int  # fewer than n_heads: grouped-query attention
    d_ff: int  # SwiGLU hidden size
    vocab: int = 256  # bytes: nothing to download
    context: int = 512  # tokens
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


CONFIGS: dict[str, ModelConfig] = {
    "target": ModelConfig("target", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=512),
    "draft": ModelConfig("draft", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256),
}
