"""The model's forward pass. `step` runs one batch of sequences at different stages (a prefill
chunk, a decode, drafted tokens to verify), laid out by its metadata (kv.metadata): it writes
each new key and value into the KV pool at its slot, then attends through the block tables, on
numpy and numba here or in torch (model.torch_model). RMSNorm (Zhang and Sennrich, 2019),
rotary positions (Su et al., 2021), SwiGLU (Shazeer, 2020) and grouped-query attention
(Ainslie et al., 2023), as in LLaMA.

Every matrix the model applies goes through one method, `linear(x, key, backend)`, so that a
subclass can change how a matrix is applied (model.quantized reads them quantized).

One weight source: `w`, by name (the names and shapes of config.weight_shapes, which the torch
face, the trainers and the weight files use too). Everything else is derived from it: the fused
matrices the numpy and numba faces multiply by, and a torch model per device. `load_weights`
(that is, `prepare_weights` then `swap_weights`) checks a new state, derives every copy from it,
then swaps them all at once and records the version, so no face ever runs on old weights.

Shapes: N or T new tokens, d model width, H query heads, K KV heads, Dh head size.
"""
from __future__ import annotations

import numpy as np

from infra_lab import backend as backends
from infra_lab.kernels import extend_attention, paged_attention, skinny_matmul
from infra_lab.kv.contiguous import ContiguousKVCache
from infra_lab.kv.metadata import StepMetadata
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model import weights as weight_files
from infra_lab.model.config import ModelConfig, weight_shapes
from infra_lab.moe.experts import ExpertWeights
from infra_lab.moe.layer import moe_layer


def rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x * (1 / np.sqrt(np.einsum("td,td->t", x, x)[:, None] / x.shape[-1] + eps)) * gain


def rope_at(config: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (T, Dh/2), for the tokens at `positions` (T,)."""
    half = config.head_dim // 2
    inverse = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.asarray(positions, np.float64)[:, None] * inverse[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# Matrices that read the same input, side by side, so that each is one matmul (vLLM's
# QKVParallelLinear and MergedColumnParallelLinear do the same): key suffix -> the weights it joins
FUSED = {"qkv": ("wq", "wk", "wv"), "gate_up": ("w_gate", "w_up")}
LAYER_MATRICES = ("qkv", "wo", "gate_up", "w_down")  # each layer's, in the order a token meets them


def parts_of(key: str) -> list[str]:
    """The weight names a matrices_of key joins: "layers.0.qkv" -> layers.0.wq, .wk, .wv; "lm_head" -> itself."""
    layer, _, suffix = key.rpartition(".")
    return [f"{layer}.{n}" for n in FUSED[suffix]] if suffix in FUSED else [key]


def layer_matrices(config: ModelConfig) -> tuple[str, ...]:
    """The matrices of a layer that `linear` applies: a mixture of experts runs its MLPs through
    moe.layer instead."""
    return LAYER_MATRICES if config.n_experts == 1 else LAYER_MATRICES[:2]


def matrices_of(config: ModelConfig, weights: dict) -> dict[str, np.ndarray]:
    """Key -> the (n_in, n_out) matrix `linear` applies: per layer i "layers.{i}.qkv" (d, (H + 2K) Dh),
    "layers.{i}.wo" (H Dh, d), "layers.{i}.gate_up" (d, 2 d_ff), "layers.{i}.w_down" (d_ff, d) (the
    last two for dense models); then "lm_head" (d, vocab)."""
    matrices = {}
    for key in [f"layers.{i}.{m}" for i in range(config.n_layers) for m in layer_matrices(config)] + ["lm_head"]:
        # kept as the transpose of a row-major (n_out, n_in) array, each output's weights one row, which
        # the small-batch kernel reads (kernels.skinny_matmul); no copy where a weight is so already
        transposed = [np.asarray(weights[name]).T for name in parts_of(key)]  # (n_out of each, n_in)
        rows = np.empty((sum(t.shape[0] for t in transposed), transposed[0].shape[1]), np.float32)
        matrices[key] = np.concatenate(transposed, axis=0, out=rows).T if len(transposed) > 1 else \
            np.ascontiguousarray(transposed[0], np.float32).T
    return matrices


def split_fused(config: ModelConfig, key: str, matrix: np.ndarray) -> dict[str, np.ndarray]:
    """The inverse of matrices_of for one key: weight name -> its columns of `matrix`."""
    names = parts_of(key)
    widths = [weight_shapes(config)[name][1] for name in names]
    if sum(widths) != matrix.shape[1]:
        raise ValueError(f"{key} joins {', '.join(names)} ({sum(widths)} columns); got shape {matrix.shape}")
    return dict(zip(names, np.split(matrix, np.cumsum(widths)[:-1], axis=1)))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, Dh): rotate the pairs (x[..., i], x[..., i + Dh/2])."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


class PreparedWeights:
    """A checked state and every copy derived from it, ready to swap in (Transformer.swap_weights)."""

    def __init__(self, w: dict, matrices: dict, torch_models: dict, version: int):
        self.w, self.matrices, self.torch_models, self.version = w, matrices, torch_models, version


def check_state(config: ModelConfig, state: dict) -> None:
    """ValueError naming every weight of `state` that is missing, extra, misshapen, not a float
    array, or not finite; nothing else is read."""
    if not isinstance(state, dict):
        raise ValueError(f"weights must be a dict of name -> array; got {type(state).__name__}")
    shapes = weight_shapes(config)
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    wrong = [f"{name} is {np.shape(state[name])}, expected {shape}" for name, shape in shapes.items()
             if name in state and np.shape(state[name]) != shape]
    kinds = [f"{name} is {np.asarray(state[name]).dtype}, not a float array" for name in shapes
             if name in state and np.asarray(state[name]).dtype.kind != "f"]
    problems = ([f"missing: {', '.join(missing)}"] if missing else []) + \
        ([f"not weights of {config.name}: {', '.join(extra)}"] if extra else []) + wrong + kinds
    if not problems:
        problems = [f"{name} holds NaN or infinity" for name in shapes if not np.isfinite(state[name]).all()]
    if problems:
        raise ValueError(f"weights refused for {config.name} (nothing changed): " + "; ".join(problems))


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict, figures: dict | None = None, version: int = 0):
        self.config = config
        self.figures = figures or {}
        self.rope_cos, self.rope_sin = rope_at(config, np.arange(config.context))  # (context, Dh/2) each
        self._torch_models: dict = {}  # device -> TorchTransformer, made when a torch step first runs there
        self.swap_weights(self.prepare_weights(weights, version, check=False))

    def prepare_weights(self, state: dict, version: int, check: bool = True) -> PreparedWeights:
        """Check `state` (check_state), then derive every copy the faces use (the fused matrices,
        a torch model for each device in use): the slow part of a weight update, which may run
        in another thread while this model serves."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"a weight version is a whole number >= 0; got {version!r}")
        if check:
            check_state(self.config, state)
        embed = np.ascontiguousarray(state["embed"], np.float32)
        tied = self.config.tied_embeddings and np.array_equal(state["lm_head"], embed.T)
        w = {name: embed if name == "embed" else embed.T if tied and name == "lm_head"  # tied: one table
             else np.ascontiguousarray(value, np.float32) for name, value in state.items()}
        matrices = matrices_of(self.config, w)
        for key, matrix in matrices.items():  # the weights become views of their matrix: one copy in memory
            w |= split_fused(self.config, key, matrix)
        torch_models = {}
        if self._torch_models:
            from infra_lab.model.torch_model import TorchTransformer

            torch_models = {device: TorchTransformer(self.config, w).to(device).eval()
                            for device in self._torch_models}
        return PreparedWeights(w, matrices, torch_models, int(version))

    def swap_weights(self, prepared: PreparedWeights) -> None:
        """Serve `prepared` from the next step on: every face at once."""
        self.w, self.matrices, self._torch_models = prepared.w, prepared.matrices, prepared.torch_models
        self.version = prepared.version

    def load_weights(self, state: dict, version: int) -> None:
        """Check and swap in new weights (name -> array, every weight of the model) as `version`."""
        self.swap_weights(self.prepare_weights(state, version))

    @property
    def n_params(self) -> int:
        return sum(value.size for value in self.w.values())

    def linear(self, x: np.ndarray, key: str, backend: backends.Backend) -> np.ndarray:
        """x (T, n_in) @ the matrix `key` (matrices_of) -> (T, n_out), on numpy or numba: the one
        place the model multiplies by a weight matrix. On numba, from 2 to a few rows (a decode step
        of a few requests) times a matrix too large for the caches go to kernels.skinny_matmul,
        which reads the matrix once; the rest go to BLAS, whose GEMV reads it once for one row."""
        matrix = self.matrices[key]
        if backend.name == "numba" and 2 <= x.shape[0] <= skinny_matmul.MOST_ROWS and \
                matrix.nbytes >= skinny_matmul.SMALLEST_BYTES:
            return skinny_matmul.matmul_numba(x, matrix)
        return x @ matrix

    # ---- caches ----------------------------------------------------------------------------

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, prefix_sharing: bool = False,
                        backend: backends.Backend | None = None) -> PagedKVCache:
        """An empty pool of KV blocks for this model, on the backend's device."""
        c = self.config
        return PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, num_blocks, block_size, prefix_sharing,
                            zeros=_zeros_for(backend or backends.current()))

    def new_cache(self, max_len: int | None = None, backend: backends.Backend | None = None) -> ContiguousKVCache:
        """An empty contiguous cache for one sequence: a pool of one block of `max_len` tokens."""
        c = self.config
        return ContiguousKVCache(c.n_layers, c.n_kv_heads, c.head_dim, max_len or c.context,
                                 zeros=_zeros_for(backend or backends.current()))

    # ---- the one entry: a step over a batch --------------------------------------------------

    def step(self, tokens, meta: StepMetadata, kv, backend: backends.Backend | None = None) -> np.ndarray:
        """Logits (N, vocab) for a batch of N new tokens laid out by `meta` (kv.metadata): each
        token's key and value are written to `kv` (a PagedKVCache, or a view of one) at its slot,
        then attention reads every sequence through its block table. A step where every sequence
        adds one token runs the paged decode kernel; any other, the extend kernel."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.shape != (meta.n_tokens,):
            raise ValueError(f"need one token per row of the metadata ({meta.n_tokens}); got shape {tokens.shape}")
        self._check_tokens(tokens)
        if int(meta.context_lens.max()) > self.config.context:
            raise ValueError(f"a sequence of {int(meta.context_lens.max())} tokens exceeds the context of "
                             f"{self.config.context}")
        kv.check_step(meta)
        backend = backend or backends.current()
        _check_pool_fits(kv, backend)
        if backend.name == "torch":
            return self._step_torch(tokens, meta, kv, backend.device)
        c, w = self.config, self.w
        where = meta.positions
        cos, sin = self.rope_cos[where], self.rope_sin[where]  # (N, Dh/2)
        attend = self._attention_for(meta, c.n_kv_heads, backend)
        x = w["embed"][tokens]  # (N, d)
        for i in range(c.n_layers):
            q, k, v = self._qkv(x, i, cos, sin, backend)
            kv.store(i, meta.slot_mapping, k, v)
            attended = attend(q, kv.k[i], kv.v[i])  # (N, H, Dh)
            x = self._mlp(x + self.linear(attended.reshape(len(tokens), c.n_heads * c.head_dim),
                                          f"layers.{i}.wo", backend), i, backend)
        return self.linear(rmsnorm(x, w["final_norm"], self.config.norm_eps), "lm_head", backend)

    @staticmethod
    def _attention_for(meta: StepMetadata, n_kv_heads: int, backend: backends.Backend):
        """attend(q (N, H, Dh), k_pool, v_pool) -> (N, H, Dh) for this step, on numpy or numba: the
        paged decode kernel when every sequence adds one token, else the extend kernel. On numba
        the step's plan (which thread reads what) is made once for all layers, and the kernels
        skip the checks that the step's metadata has passed."""
        tables, context, starts = meta.block_tables, meta.context_lens, meta.query_starts
        if backend.name == "numba":
            plan = (paged_attention.plan_decode(tables, context, meta.block_size) if meta.is_decode
                    else extend_attention.plan_extend(starts, context, tables, n_kv_heads))
            kernel = paged_attention.paged_decode_planned if meta.is_decode else extend_attention.extend_planned
            return lambda q, k_pool, v_pool: kernel(q, k_pool, v_pool, plan)
        if meta.is_decode:
            return lambda q, k_pool, v_pool: np.asarray(
                paged_attention.paged_decode(q, k_pool, v_pool, tables, context, backend), np.float32)
        return lambda q, k_pool, v_pool: np.asarray(
            extend_attention.extend_attention(q, k_pool, v_pool, tables, starts, context, backend), np.float32)

    def _qkv(self, x: np.ndarray, i: int, cos: np.ndarray, sin: np.ndarray, backend: backends.Backend) -> tuple:
        """Layer i's queries (T, H, Dh), rotated keys (T, K, Dh) and values (T, K, Dh) for x (T, d):
        one matmul for all three, and one rotation for the queries and keys together."""
        c = self.config
        normed = rmsnorm(x, self.w[f"layers.{i}.attn_norm"], c.norm_eps)
        qkv = self.linear(normed, f"layers.{i}.qkv", backend).reshape(len(x), c.n_heads + 2 * c.n_kv_heads, c.head_dim)
        rotated = apply_rope(qkv[:, : c.n_heads + c.n_kv_heads], cos, sin)
        return rotated[:, : c.n_heads], rotated[:, c.n_heads:], qkv[:, c.n_heads + c.n_kv_heads:]

    def _mlp(self, x: np.ndarray, i: int, backend: backends.Backend) -> np.ndarray:
        """x plus layer i's SwiGLU MLP of x: (T, d) -> (T, d); gate and up in one matmul. In a
        mixture of experts, each token's top-k experts' MLPs, weighted by the router (dropless)."""
        if self.config.n_experts > 1:
            w, name = self.w, f"layers.{i}"
            experts = ExpertWeights(w[f"{name}.w_gate"], w[f"{name}.w_up"], w[f"{name}.w_down"])
            routed = moe_layer(rmsnorm(x, w[f"{name}.mlp_norm"], self.config.norm_eps), w[f"{name}.router"], experts,
                               self.config.experts_per_token, None, w[f"{name}.router_bias"], backend)
            return x + routed.y
        normed = rmsnorm(x, self.w[f"layers.{i}.mlp_norm"], self.config.norm_eps)
        gate_up = self.linear(normed, f"layers.{i}.gate_up", backend)
        gate, up = np.split(gate_up, 2, axis=1)  # (T, d_ff) each
        return x + self.linear(gate / (1 + np.exp(-gate)) * up, f"layers.{i}.w_down", backend)

    def to_torch(self):
        """This model as a TorchTransformer on the CPU: the torch backend's face of `step`."""
        from infra_lab.model.torch_model import TorchTransformer

        return TorchTransformer(self.config, self.w)

    def _step_torch(self, tokens: np.ndarray, meta: StepMetadata, kv, device: str) -> np.ndarray:
        import torch

        if device not in self._torch_models:
            self._torch_models[device] = self.to_torch().to(device).eval()
        with torch.no_grad():
            logits = self._torch_models[device].step(torch.from_numpy(tokens).to(device), meta, kv)
        return logits.float().cpu().numpy()

    def _check_tokens(self, tokens: np.ndarray) -> None:
        if tokens.ndim != 1 or len(tokens) < 1:
            raise ValueError(f"tokens must be a non-empty 1-D sequence; got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab}); got {tokens.min()}..{tokens.max()}")

    # ---- one sequence, or one decode step of many: steps built for the caller ---------------

    def forward(self, tokens, cache=None, backend: backends.Backend | None = None) -> np.ndarray:
        """Logits (T, vocab) for `tokens` (T,), which continue whatever `cache` (a contiguous cache,
        or a view of one sequence of a PagedKVCache) holds; their keys and values are added to
        it. Without a cache the tokens are a whole sequence, in a cache of their own."""
        tokens = np.asarray(tokens, np.int64)
        self._check_tokens(tokens)
        start = cache.length if cache is not None else 0
        if start + len(tokens) > self.config.context:
            raise ValueError(f"{start} cached + {len(tokens)} new tokens exceed the context of "
                             f"{self.config.context}")
        cache = cache if cache is not None else self.new_cache(len(tokens), backend)
        pool, seq = cache.cache, cache.seq
        with pool.undo_on_error([seq]):
            pool.reserve(seq, len(tokens))
            logits = self.step(tokens, pool.step_metadata([seq], [len(tokens)]), cache, backend)
        pool.commit(seq, tokens)
        return logits

    def decode_batch(self, tokens, caches: list, backend: backends.Backend | None = None) -> np.ndarray:
        """One decode step for several sequences at once: token b continues caches[b], views of
        one PagedKVCache (`generate_many` makes contiguous ones as a pool of one block per
        sequence). The matmuls see all the tokens together, and attention is one call of the
        paged decode kernel over every sequence's block table. Returns (B, vocab)."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim != 1 or len(tokens) != len(caches) or not len(caches):
            raise ValueError(f"need one token per cache; got {tokens.shape} tokens for {len(caches)} caches")
        pool = caches[0].cache
        if any(cache.cache is not pool for cache in caches):
            raise ValueError("decode_batch needs views of one pool: one step reads one pool")
        full = [cache.length for cache in caches if cache.length + 1 > self.config.context]
        if full:
            raise ValueError(f"a sequence of {full[0]} tokens is at the context of {self.config.context}")
        seqs = [cache.seq for cache in caches]
        with pool.undo_on_error(seqs):
            pool.reserve_all(seqs, [1] * len(seqs))
            logits = self.step(tokens, pool.step_metadata(seqs, [1] * len(seqs)), pool, backend)
        for b, seq in enumerate(seqs):
            pool.commit(seq, tokens[b:b + 1])
        return logits


def _check_pool_fits(kv, backend: backends.Backend) -> None:
    """The pool must live where the backend computes: numpy arrays for numpy and numba, torch
    tensors on the backend's device for torch."""
    device = None if isinstance(kv.k, np.ndarray) else kv.k.device  # numpy arrays have a .device too
    where = "numpy arrays" if device is None else f"torch tensors on {device}"
    wanted = "numpy arrays" if backend.name != "torch" else f"torch tensors on {backend.device}"
    fits = device is not None and device.type == backend.device if backend.name == "torch" else device is None
    if not fits:
        raise ValueError(f"the KV pool holds {where}, but the {backend.name} backend needs {wanted}: make the "
                         "cache with the same backend (new_cache(backend=...), new_paged_cache(..., backend=...))")


def _zeros_for(backend: backends.Backend):
    """A factory of zeroed pools on the backend's device: numpy's (None) or torch's."""
    if backend.name != "torch":
        return None
    import torch

    return lambda shape: torch.zeros(shape, device=backend.device)


def load(size: str = "target") -> Transformer:
    """The shipped model `size` ("target", "draft" or "moe")."""
    weights, config, figures = weight_files.load(weight_files.path_for(size))
    return Transformer(config, weights, figures)
