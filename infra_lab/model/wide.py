"""A model too wide for a CPU's caches, for measuring what batching gains when a decode step is
bound by reading the weights, as it is on a GPU: the shipped target's depth, 8 times as wide
(d_model 1,024 in 8 heads, SwiGLU width 4,096), about 245 MB in float32, against the 4 MB of the shipped
model that sit in cache. Its weights are random (scaled as GPT-2 initializes them): its tokens
mean nothing, and what it is for is its step times. Chapter 05 serves it next to the target.
"""
from __future__ import annotations

import numpy as np

from infra_lab.model.config import ModelConfig, weight_shapes
from infra_lab.model.transformer import Transformer

WIDE = ModelConfig("wide", n_layers=4, d_model=1024, n_heads=8, n_kv_heads=2, d_ff=4096)
INIT_STD = 0.02  # GPT-2's initial weights' standard deviation


def wide_model(seed: int = 0) -> Transformer:
    """WIDE with random normal weights (norms at 1), the same for the same seed."""
    rng = np.random.default_rng(seed)
    weights = {name: (np.ones(shape, np.float32) if name.endswith("norm") else
                      rng.standard_normal(shape, np.float32) * np.float32(INIT_STD))
               for name, shape in weight_shapes(WIDE).items()}
    return Transformer(WIDE, weights)
