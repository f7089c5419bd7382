"""The forward pass on the CPU, in numpy with this package's attention kernels, and the door to
the torch path. RMSNorm (Zhang and Sennrich, 2019), rotary positions (Su et al., 2021), SwiGLU
(Shazeer, 2020) and grouped-query attention (Ainslie et al., 2023), as in LLaMA.

Shapes: T new tokens, d model width, H query heads, K KV heads, Dh head size.
"""
from __future__ import annotations

import math

import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels import attention as attention_kernels
from infra_lab.kernels import attention_decode
from infra_lab.model import weights as weight_files
from infra_lab.model.config import ModelConfig
from infra_lab.model.kv_cache import ContiguousKVCache


def rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gain


def rope_tables(config: ModelConfig, start: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (T, Dh/2), for positions start .. start + T - 1."""
    half = config.head_dim // 2
    inverse = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(start, start + steps, dtype=np.float64)[:, None] * inverse[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, Dh): rotate the pairs (x[..., i], x[..., i + Dh/2])."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _attention_after_prefix(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """T > 1 new queries after `start` cached tokens, in numpy: query t sees keys 0 .. start + t.
    q (T, H, Dh); keys, values (start + T, K, Dh) -> (T, H, Dh)."""
    steps, heads, head_dim = q.shape
    group = heads // keys.shape[1]
    k = np.repeat(keys.transpose(1, 0, 2), group, axis=0)  # (H, start + T, Dh)
    v = np.repeat(values.transpose(1, 0, 2), group, axis=0)
    scores = q.transpose(1, 0, 2) @ k.transpose(0, 2, 1) / math.sqrt(head_dim)  # (H, T, start + T)
    future = np.arange(start + steps)[None, :] > np.arange(start, start + steps)[:, None]
    scores[:, future] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).astype(np.float32)


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict, figures: dict | None = None):
        self.config = config
        self.w = {name: np.ascontiguousarray(value, np.float32) for name, value in weights.items()}
        self.figures = figures or {}
        self._torch_models: dict = {}

    @property
    def n_params(self) -> int:
        return sum(value.size for value in self.w.values())

    def new_cache(self, max_len: int | None = None, backend: backends.Backend | None = None) -> ContiguousKVCache:
        """An empty contiguous cache for this model, of the backend's kind."""
        backend = backend or backends.current()
        c = self.config
        zeros = None
        if backend.name == "torch":
            import torch

            zeros = lambda shape: torch.zeros(shape, device=backend.device)  # noqa: E731
        return ContiguousKVCache(c.n_layers, c.n_kv_heads, c.head_dim, max_len or c.context, zeros)

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, prefix_sharing: bool = False,
                        backend: backends.Backend | None = None):
        """An empty PagedKVCache for this model, on the backend's device."""
        from infra_lab.kv.paged import PagedKVCache

        backend = backend or backends.current()
        zeros = None
        if backend.name == "torch":
            import torch

            zeros = lambda shape: torch.zeros(shape, device=backend.device)  # noqa: E731
        c = self.config
        return PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, num_blocks, block_size, prefix_sharing, zeros=zeros)

    def forward(self, tokens, cache=None, backend: backends.Backend | None = None) -> np.ndarray:
        """Logits (T, vocab) for `tokens` (T,), which continue whatever `cache` holds; their
        keys and values are added to it. Without a cache the tokens are a whole sequence."""
        tokens = np.asarray(tokens, np.int64)
        start = cache.length if cache is not None else 0
        if tokens.ndim != 1 or len(tokens) < 1:
            raise ValueError(f"tokens must be a non-empty 1-D sequence; got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab}); got {tokens.min()}..{tokens.max()}")
        if start + len(tokens) > self.config.context:
            raise ValueError(f"{start} cached + {len(tokens)} new tokens exceed the context of "
                             f"{self.config.context}")
        backend = backend or backends.current()
        if backend.name == "torch":
            return self._forward_torch(tokens, cache, backend.device)
        return self._forward_numpy(tokens, cache, backend)

    def _forward_numpy(self, tokens: np.ndarray, cache, backend: backends.Backend) -> np.ndarray:
        c, w = self.config, self.w
        steps = len(tokens)
        start = cache.length if cache is not None else 0
        cos, sin = rope_tables(c, start, steps)
        x = w["embed"][tokens]  # (T, d)
        for i in range(c.n_layers):
            q, k, v = self._qkv(x, i, cos, sin)
            if cache is not None:
                cache.append(i, k, v)
            if cache is not None and steps == 1 and hasattr(cache, "attend_decode"):
                attended = cache.attend_decode(i, q, backend)  # the cache reads itself (paged)
            else:
                if cache is not None:
                    k, v = cache.keys(i), cache.values(i)  # (start + T, K, Dh)
                attended = self._attend(q, k, v, start, backend)  # (T, H, Dh)
            x = self._mlp(x + attended.reshape(steps, c.d_model) @ w[f"layers.{i}.wo"], i)
        if cache is not None:
            cache.advance(steps, tokens)
        return rmsnorm(x, w["final_norm"]) @ w["lm_head"]

    def _qkv(self, x: np.ndarray, i: int, cos: np.ndarray, sin: np.ndarray) -> tuple:
        """Layer i's queries (T, H, Dh), rotated keys (T, K, Dh) and values (T, K, Dh) for x (T, d)."""
        c, w = self.config, self.w
        h = rmsnorm(x, w[f"layers.{i}.attn_norm"])
        q = apply_rope((h @ w[f"layers.{i}.wq"]).reshape(len(x), c.n_heads, c.head_dim), cos, sin)
        k = apply_rope((h @ w[f"layers.{i}.wk"]).reshape(len(x), c.n_kv_heads, c.head_dim), cos, sin)
        return q, k, (h @ w[f"layers.{i}.wv"]).reshape(len(x), c.n_kv_heads, c.head_dim)

    def _mlp(self, x: np.ndarray, i: int) -> np.ndarray:
        """x plus layer i's SwiGLU MLP of x: (T, d) -> (T, d)."""
        w = self.w
        h = rmsnorm(x, w[f"layers.{i}.mlp_norm"])
        gate = h @ w[f"layers.{i}.w_gate"]
        return x + (gate / (1 + np.exp(-gate)) * (h @ w[f"layers.{i}.w_up"])) @ w[f"layers.{i}.w_down"]

    @staticmethod
    def _attend(q, k, v, start: int, backend: backends.Backend) -> np.ndarray:
        steps = q.shape[0]
        if steps == 1:  # decode: one query against the cache
            out = attention_decode.decode_attention(q, k[None], v[None], np.array([start + 1]), backend)
            return np.asarray(out, np.float32)  # (1, H, Dh): the one token is the batch
        if start == 0:  # prefill from nothing: causal attention over the prompt
            out = attention_kernels.attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2),
                                              v.transpose(1, 0, 2), causal=True, backend=backend)
            return np.asarray(out, np.float32).transpose(1, 0, 2)
        return _attention_after_prefix(q, k, v, start)

    def decode_batch(self, tokens, caches: list, backend: backends.Backend | None = None) -> np.ndarray:
        """One decode step for several sequences at once: token b continues caches[b]. The
        matmuls see all the tokens together; attention reads each sequence's own cache, in one
        paged-kernel call when the caches are views of one PagedKVCache. Returns (B, vocab)."""
        from infra_lab.kernels import paged_attention
        from infra_lab.kv.paged import SequenceView

        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim != 1 or len(tokens) != len(caches) or not len(caches):
            raise ValueError(f"need one token per cache; got {tokens.shape} tokens for {len(caches)} caches")
        backend = backend or backends.current()
        full = [cache.length for cache in caches if cache.length + 1 > self.config.context]
        if full:
            raise ValueError(f"a sequence of {full[0]} tokens is at the context of {self.config.context}")
        if backend.name == "torch":  # one sequence at a time on the torch path
            return np.stack([self.forward(tokens[b:b + 1], caches[b], backend)[0] for b in range(len(caches))])
        c, w = self.config, self.w
        batch = len(tokens)
        starts = np.array([cache.length for cache in caches])
        half = c.head_dim // 2
        angles = starts[:, None] * (c.rope_theta ** (-np.arange(half) / half))[None, :]  # (B, Dh/2)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        paged = all(isinstance(cache, SequenceView) and cache.cache is caches[0].cache for cache in caches)
        x = w["embed"][tokens]  # (B, d): one new token per sequence
        for i in range(c.n_layers):
            q, k, v = self._qkv(x, i, cos, sin)  # the B tokens stand where T tokens do in forward
            for b, cache in enumerate(caches):
                cache.append(i, k[b:b + 1], v[b:b + 1])
            if paged:
                pool = caches[0].cache
                tables = pool.block_table_array([cache.seq for cache in caches])
                attended = paged_attention.paged_decode(q, pool.k[i], pool.v[i], tables, starts + 1, backend)
            else:
                attended = np.concatenate([self._attend(q[b:b + 1], caches[b].keys(i), caches[b].values(i),
                                                        int(starts[b]), backend) for b in range(batch)])
            x = self._mlp(x + np.asarray(attended, np.float32).reshape(batch, c.d_model) @ w[f"layers.{i}.wo"], i)
        for b, cache in enumerate(caches):
            cache.advance(1, tokens[b:b + 1])
        return rmsnorm(x, w["final_norm"]) @ w["lm_head"]

    def _forward_torch(self, tokens: np.ndarray, cache, device: str) -> np.ndarray:
        import torch

        from infra_lab.model.torch_model import TorchTransformer

        if device not in self._torch_models:
            self._torch_models[device] = TorchTransformer(self.config, self.w).to(device).eval()
        with torch.no_grad():
            logits = self._torch_models[device](torch.from_numpy(tokens)[None].to(device), cache)
        return logits[0].float().cpu().numpy()


def load(size: str = "target") -> Transformer:
    """The shipped model `size` ("target" or "draft")."""
    weights, config, figures = weight_files.load(weight_files.path_for(size))
    return Transformer(config, weights, figures)
