"""The model in torch: for training, and for inference on a GPU (or on the CPU, as a peer).

Weights are stored as (in, out) matrices and applied as x @ W, the same layout the numpy path
reads, so one weight file serves both. Every matrix is applied through one method, `mm(h, name)`,
so that a subclass can change how (model.quantized fake-quantizes activations there).
Shapes: B batch, T tokens, d model width, H heads, K KV heads, Dh head size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infra_lab.model.config import ModelConfig, weight_shapes
from infra_lab.moe import torch_moe


def rope_tables(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (T, Dh/2), for rotary embeddings (Su et al., RoFormer, 2021)."""
    half = config.head_dim // 2
    inverse = config.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
    angles = positions.to(torch.float64)[:, None] * inverse[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) by the position's angles; x (..., Dh), with cos
    and sin (..., Dh/2) broadcasting against it."""
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
            elif name.endswith("router_bias"):
                value = torch.zeros(shape)
            else:  # scaled so each residual branch starts small (GPT-2's 1/sqrt(2 n_layers))
                std = 0.02 / (2 * config.n_layers) ** 0.5 if name.endswith(("wo", "w_down")) else 0.02
                value = torch.randn(shape, generator=generator) * std
            # the balancing bias is moved by load counts, not gradients (moe.routing.update_bias)
            self.weights[name.replace(".", "__")] = nn.Parameter(value, requires_grad=not name.endswith("router_bias"))
        self.capacity_factor: float | None = None  # a mixture of experts is dropless unless set
        self.record_routing = False  # training sets it: then each MoE layer's (routing, logits) lands in
        self.routings: list = []  # ... here, until the caller clears it
        self.choose_experts = None  # moe.torch_moe.route's `choose`: who picks each token's experts

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "__")]

    def mm(self, h: torch.Tensor, name: str) -> torch.Tensor:
        """h (..., n_in) @ the weight `name` (n_in, n_out) -> (..., n_out): the one place the model
        multiplies by a weight matrix (wq, wk, wv, wo, w_gate, w_up, w_down, lm_head)."""
        return h @ self.w(name)

    def numpy_weights(self) -> dict:
        return {name.replace("__", "."): p.detach().cpu().numpy() for name, p in self.weights.items()}

    def _layer_inputs(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Layer i's rotated queries (..., T, H, Dh), rotated keys and values (..., T, K, Dh)."""
        c = self.config
        h = rmsnorm(x, self.w(f"layers.{i}.attn_norm"), self.config.norm_eps)
        q = self.mm(h, f"layers.{i}.wq").unflatten(-1, (c.n_heads, c.head_dim))
        k = self.mm(h, f"layers.{i}.wk").unflatten(-1, (c.n_kv_heads, c.head_dim))
        v = self.mm(h, f"layers.{i}.wv").unflatten(-1, (c.n_kv_heads, c.head_dim))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, Dh/2): the same angle for every head
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish_layer(self, x: torch.Tensor, attended: torch.Tensor, i: int) -> torch.Tensor:
        """x plus attention's output projected, plus the SwiGLU MLP: (..., T, d). In a mixture of
        experts, the routed experts' MLPs (moe.torch_moe)."""
        x = x + self.mm(attended.flatten(-2), f"layers.{i}.wo")
        h = rmsnorm(x, self.w(f"layers.{i}.mlp_norm"), self.config.norm_eps)
        if self.config.n_experts > 1:
            name = f"layers.{i}"
            y, routing, logits = torch_moe.moe_forward(
                h.reshape(-1, h.shape[-1]), self.w(f"{name}.router"), self.w(f"{name}.w_gate"), self.w(f"{name}.w_up"),
                self.w(f"{name}.w_down"), self.config.experts_per_token, self.capacity_factor,
                self.w(f"{name}.router_bias"), self.choose_experts)
            if self.record_routing:
                self.routings.append((routing, logits))
            return x + y.reshape(x.shape)
        gated = F.silu(self.mm(h, f"layers.{i}.w_gate")) * self.mm(h, f"layers.{i}.w_up")  # (..., T, d_ff)
        return x + self.mm(gated, f"layers.{i}.w_down")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training and scoring: tokens (B, T), whole sequences -> logits (B, T, vocab)."""
        cos, sin = rope_tables(self.config, torch.arange(tokens.shape[1], device=tokens.device))
        x = self.w("embed")[tokens]  # (B, T, d)
        for i in range(self.config.n_layers):
            x = self.block(x, i, cos, sin)
        return self.head(x)

    def block(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Transformer block i on whole sequences: x (B, T, d) -> (B, T, d). Pipeline stages and
        activation checkpointing (infra_lab.parallel) call it one block at a time."""
        c = self.config
        q, k, v = (t.transpose(1, 2) for t in self._layer_inputs(x, i, cos, sin))  # (B, heads, T, Dh)
        k, v = k.repeat_interleave(c.group, dim=1), v.repeat_interleave(c.group, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        return self._finish_layer(x, attended.transpose(1, 2), i)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: x (..., d) -> logits (..., vocab)."""
        return self.mm(rmsnorm(x, self.w("final_norm"), self.config.norm_eps), "lm_head")

    def step(self, tokens: torch.Tensor, meta, kv) -> torch.Tensor:
        """Inference: one step over a batch laid out by `meta` (kv.metadata.StepMetadata), tokens
        (N,) -> logits (N, vocab). Keys and values go into `kv`'s pool at their slots; attention
        reads the pool through the block tables with the kernels' torch faces (Triton on CUDA)."""
        from infra_lab.kernels import extend_attention, paged_attention

        c = self.config
        starts, context, tables, slots = meta.on(tokens.device)
        cos, sin = rope_tables(c, torch.as_tensor(meta.positions, device=tokens.device))
        x = self.w("embed")[tokens]  # (N, d)
        for i in range(c.n_layers):
            q, k, v = self._layer_inputs(x, i, cos, sin)  # (N, H, Dh), (N, K, Dh), (N, K, Dh)
            kv.store(i, slots, k, v)
            if meta.is_decode:
                attended = paged_attention.paged_decode_torch(q, kv.k[i], kv.v[i], tables, context)
            else:
                attended = extend_attention.extend_attention_torch(q, kv.k[i], kv.v[i], tables, starts, context)
            x = self._finish_layer(x, attended, i)
        return self.mm(rmsnorm(x, self.w("final_norm"), self.config.norm_eps), "lm_head")
