"""The model in torch: for training, and for inference on a GPU (or on the CPU, as a peer).

Weights are stored as (in, out) matrices and applied as x @ W, the same layout the numpy path
reads, so one weight file serves both. Shapes: B batch, T tokens, d model width, H heads,
K KV heads, Dh head size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infra_lab.model.config import ModelConfig


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dh = config.d_model, config.head_dim
    shapes = {"embed": (config.vocab, d)}
    for i in range(config.n_layers):
        shapes |= {f"layers.{i}.attn_norm": (d,), f"layers.{i}.wq": (d, config.n_heads * dh),
                   f"layers.{i}.wk": (d, config.n_kv_heads * dh), f"layers.{i}.wv": (d, config.n_kv_heads * dh),
                   f"layers.{i}.wo": (config.n_heads * dh, d), f"layers.{i}.mlp_norm": (d,),
                   f"layers.{i}.w_gate": (d, config.d_ff), f"layers.{i}.w_up": (d, config.d_ff),
                   f"layers.{i}.w_down": (config.d_ff, d)}
    return shapes | {"final_norm": (d,), "lm_head": (d, config.vocab)}


def rope_tables(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (T, Dh/2), for rotary embeddings (Su et al., RoFormer, 2021)."""
    half = config.head_dim // 2
    inverse = config.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
    angles = positions.to(torch.float64)[:, None] * inverse[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) by the position's angles; x (..., T, Dh)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


class TorchTransformer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict | None = None, seed: int = 0):
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterDict()
        for name, shape in weight_shapes(config).items():
            if weights is not None:
                value = torch.as_tensor(weights[name], dtype=torch.float32).clone()
            elif name.endswith("norm"):
                value = torch.ones(shape)
            else:  # scaled so each residual branch starts small (GPT-2's 1/sqrt(2 n_layers))
                std = 0.02 / (2 * config.n_layers) ** 0.5 if name.endswith(("wo", "w_down")) else 0.02
                value = torch.randn(shape, generator=generator) * std
            self.weights[name.replace(".", "__")] = nn.Parameter(value)

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "__")]

    def numpy_weights(self) -> dict:
        return {name.replace("__", "."): p.detach().cpu().numpy() for name, p in self.weights.items()}

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). With a cache (B = 1), the tokens continue
        the cached sequence and their keys and values are appended to it."""
        c = self.config
        batch, steps = tokens.shape
        start = cache.length if cache is not None else 0
        cos, sin = rope_tables(c, torch.arange(start, start + steps, device=tokens.device))
        x = self.w("embed")[tokens]  # (B, T, d)
        for i in range(c.n_layers):
            h = rmsnorm(x, self.w(f"layers.{i}.attn_norm"))
            q = (h @ self.w(f"layers.{i}.wq")).view(batch, steps, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Dh)
            k = (h @ self.w(f"layers.{i}.wk")).view(batch, steps, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, K, T, Dh)
            v = (h @ self.w(f"layers.{i}.wv")).view(batch, steps, c.n_kv_heads, c.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if cache is not None:
                cache.append(i, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (T, K, Dh)
                k = cache.keys(i).transpose(0, 1)[None]  # (1, K, start + T, Dh)
                v = cache.values(i).transpose(0, 1)[None]
            k, v = k.repeat_interleave(c.group, dim=1), v.repeat_interleave(c.group, dim=1)
            if start == 0:
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # query t sees keys 0 .. start + t
                visible = torch.arange(start + steps, device=tokens.device)[None, :] <= \
                    torch.arange(start, start + steps, device=tokens.device)[:, None]
                attended = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            x = x + attended.transpose(1, 2).reshape(batch, steps, c.d_model) @ self.w(f"layers.{i}.wo")
            h = rmsnorm(x, self.w(f"layers.{i}.mlp_norm"))
            x = x + (F.silu(h @ self.w(f"layers.{i}.w_gate")) * (h @ self.w(f"layers.{i}.w_up"))) @ self.w(f"layers.{i}.w_down")
        if cache is not None:
            cache.advance(steps, tokens[0].tolist())
        return rmsnorm(x, self.w("final_norm")) @ self.w("lm_head")
