"""Tensor parallelism: every matrix of a transformer block split over N processes, as in Megatron-LM
(Shoeybi et al., "Megatron-LM: Training multi-billion parameter language models using model
parallelism", 2019, section 3).

A column-parallel matrix gives each rank a slice of the outputs; a row-parallel one takes a slice of
the inputs and gives each rank a partial sum of the outputs. The MLP runs gate and up column-parallel
and down row-parallel; attention gives each rank whole heads (its q heads and their KV heads) and
runs wo row-parallel. So each half of a block needs one all-reduce forward (g, after the row-parallel
matrix) and one backward (f, where the replicated input enters): four per block, each of the
activations (B, T, d). Norms, the embedding and the LM head stay replicated.
Shapes: B batch, T tokens, d model width, H heads, K KV heads, Dh head size, N processes.
"""
from __future__ import annotations

import time
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from infra_lab.model import weights as weight_files
from infra_lab.model.config import CONFIGS, ModelConfig
from infra_lab.model.torch_model import TorchTransformer, apply_rope, rope_tables, rmsnorm
from infra_lab.moe.expert_parallel import check_agreement
from infra_lab.parallel.comm import ByteCounter

ALL_REDUCES_PER_BLOCK = 4  # attention and MLP: one forward (g) and one backward (f) each
SPLIT = {"wq": "columns", "wk": "columns", "wv": "columns", "w_gate": "columns", "w_up": "columns",
         "wo": "rows", "w_down": "rows"}  # every other weight is replicated


def _all_reduce(t: torch.Tensor, group, counter: ByteCounter | None) -> torch.Tensor:
    if counter is None:
        dist.all_reduce(t, group=group)
    else:
        counter.all_reduce(t)  # on the counter's group
    return t


class CopyToRanks(torch.autograd.Function):
    """Megatron's f: the identity forward; backward, the sum over ranks of the gradient, since each
    rank's slice of the block contributes a part of the gradient of its replicated input."""

    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group, ctx.counter), None, None


class SumOverRanks(torch.autograd.Function):
    """Megatron's g, f's conjugate: the sum over ranks forward (of a row-parallel matrix's partial
    outputs); backward, the identity, since every rank's partial sum enters the total with weight 1."""

    @staticmethod
    def forward(ctx, x, group, counter):
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), group, counter)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_ranks(x: torch.Tensor, group=None, counter: ByteCounter | None = None) -> torch.Tensor:
    """f(x): where a replicated activation enters the tensor-parallel region."""
    return CopyToRanks.apply(x, group, counter)


def sum_over_ranks(x: torch.Tensor, group=None, counter: ByteCounter | None = None) -> torch.Tensor:
    """g(x): where partial sums leave the tensor-parallel region, replicated again."""
    return SumOverRanks.apply(x, group, counter)


def _slice(size: int, rank: int, world: int, what: str) -> slice:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the world size must be an integer >= 1; got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"the rank must be an integer in [0, {world}); got {rank!r}")
    if size % world:
        raise ValueError(f"cannot split {size} {what} over {world} processes: the world size must divide {size}")
    part = size // world
    return slice(rank * part, (rank + 1) * part)


def _check_matrix(w) -> None:
    if len(w.shape) != 2:
        raise ValueError(f"expected an (in, out) weight matrix; got shape {tuple(w.shape)}")


def shard_columns(w, rank: int, world: int):
    """Rank `rank`'s (in, out / N) slice of an (in, out) matrix: its share of the outputs."""
    _check_matrix(w)
    return w[:, _slice(w.shape[1], rank, world, "columns")]


def shard_rows(w, rank: int, world: int):
    """Rank `rank`'s (in / N, out) slice of an (in, out) matrix: its share of the inputs."""
    _check_matrix(w)
    return w[_slice(w.shape[0], rank, world, "rows"), :]


def shard(name: str, w, rank: int, world: int):
    """A weight of the model (`layers.{i}.wq`, `embed`, ...) as rank `rank` holds it."""
    split = SPLIT.get(name.rsplit(".", 1)[-1])
    if split is None:
        return w
    return shard_columns(w, rank, world) if split == "columns" else shard_rows(w, rank, world)


def column_parallel_linear(x: torch.Tensor, w_shard: torch.Tensor) -> torch.Tensor:
    """x (..., in), replicated and already through f, @ this rank's (in, out / N) columns ->
    (..., out / N), this rank's slice of the outputs. No communication."""
    return x @ w_shard


def row_parallel_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, group=None,
                        counter: ByteCounter | None = None) -> torch.Tensor:
    """x_shard (..., in / N) @ this rank's (in / N, out) rows -> a partial sum (..., out), summed
    over ranks by g: (..., out), the same on every rank."""
    return sum_over_ranks(x_shard @ w_shard, group, counter)


def check_divides(config: ModelConfig, world: int) -> None:
    """Raise a ValueError unless `world` processes can split this model's heads, KV heads and MLP."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the world size must be an integer >= 1; got {world!r}")
    if config.n_experts > 1:
        raise ValueError(f"tensor parallelism here splits dense SwiGLU MLPs; {config.name} has {config.n_experts} "
                         f"experts (see infra_lab.moe.expert_parallel)")
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "d_ff": config.d_ff}
    for name, size in sizes.items():
        if size % world:
            allowed = [n for n in range(1, config.n_kv_heads + 1) if all(s % n == 0 for s in sizes.values())]
            raise ValueError(f"{world} processes cannot split {name} = {size} of {config.name}: the world size must "
                             f"divide n_heads, n_kv_heads and d_ff; allowed: {', '.join(map(str, allowed))}")


def parallel_mlp(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group=None,
                 counter: ByteCounter | None = None) -> torch.Tensor:
    """The SwiGLU MLP on the normed input h (B, T, d): gate and up (d, d_ff / N) column-parallel,
    down (d_ff / N, d) row-parallel. -> (B, T, d) on every rank."""
    h = copy_to_ranks(h, group, counter)  # f
    gated = F.silu(column_parallel_linear(h, gate)) * column_parallel_linear(h, up)  # (B, T, d_ff / N)
    return row_parallel_linear(gated, down, group, counter)  # g


def parallel_attention(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor,
                       config: ModelConfig, cos: torch.Tensor, sin: torch.Tensor, group=None,
                       counter: ByteCounter | None = None) -> torch.Tensor:
    """Causal grouped-query attention on the normed input h (B, T, d), split by heads: wq
    (d, H/N * Dh), wk and wv (d, K/N * Dh), wo (H/N * Dh, d). Rank r's q heads r H/N ... use KV
    heads r K/N ..., its own. -> (B, T, d) on every rank."""
    dh = config.head_dim
    heads, kv_heads = wq.shape[1] // dh, wk.shape[1] // dh
    if heads != kv_heads * config.group:
        raise ValueError(f"this rank holds {heads} q heads and {kv_heads} KV heads; {config.name} needs "
                         f"{config.group} q heads per KV head")
    h = copy_to_ranks(h, group, counter)  # f
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, Dh/2)
    q = apply_rope(column_parallel_linear(h, wq).unflatten(-1, (heads, dh)), cos, sin)  # (B, T, H/N, Dh)
    k = apply_rope(column_parallel_linear(h, wk).unflatten(-1, (kv_heads, dh)), cos, sin)  # (B, T, K/N, Dh)
    v = column_parallel_linear(h, wv).unflatten(-1, (kv_heads, dh))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, Dh)
    k, v = k.repeat_interleave(config.group, dim=1), v.repeat_interleave(config.group, dim=1)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/N, T, Dh)
    return row_parallel_linear(attended.transpose(1, 2).flatten(-2), wo, group, counter)  # g: (B, T, d)


class TensorParallelTransformer(nn.Module):
    """This rank's part of a TorchTransformer: its shards of every block's matrices (`SPLIT`), and
    copies of the norms, the embedding and the LM head. forward(tokens) gives the whole model's
    logits on every rank. A `counter` (a ByteCounter on `group`) counts the all-reduces."""

    def __init__(self, model: TorchTransformer, group=None, counter: ByteCounter | None = None):
        super().__init__()
        self.config, self.group, self.counter = model.config, group, counter
        if counter is not None and counter.group is not group:
            raise ValueError(f"the counter counts on group {counter.group!r}, the model runs on {group!r}: "
                             f"they must be the same group")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        check_divides(self.config, self.world)
        self.weights = nn.ParameterDict()
        for name, value in model.numpy_weights().items():
            part = shard(name, torch.from_numpy(value), self.rank, self.world)
            self.weights[name.replace(".", "__")] = nn.Parameter(part.clone().contiguous())

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "__")]

    def check_shapes(self, x: torch.Tensor) -> None:
        """The same ValueError on every rank when the ranks' inputs or models differ, before a
        collective whose sizes depend on them could hang."""
        c = self.config
        check_agreement(self.group, batch=x.shape[0], tokens=x.shape[1], d_model=c.d_model, n_layers=c.n_layers,
                        n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, d_ff=c.d_ff, vocab=c.vocab)

    def block(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Block i, x (B, T, d) -> (B, T, d): equal to TorchTransformer.block, on every rank."""
        w, layer = self.w, f"layers.{i}"
        eps = self.config.norm_eps
        x = x + parallel_attention(rmsnorm(x, w(f"{layer}.attn_norm"), eps), w(f"{layer}.wq"), w(f"{layer}.wk"),
                                   w(f"{layer}.wv"), w(f"{layer}.wo"), self.config, cos, sin, self.group, self.counter)
        return x + parallel_mlp(rmsnorm(x, w(f"{layer}.mlp_norm"), eps), w(f"{layer}.w_gate"), w(f"{layer}.w_up"),
                                w(f"{layer}.w_down"), self.group, self.counter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), the same on every rank."""
        self.check_shapes(tokens)
        cos, sin = rope_tables(self.config, torch.arange(tokens.shape[1], device=tokens.device))
        x = self.w("embed")[tokens]  # (B, T, d), replicated
        for i in range(self.config.n_layers):
            x = self.block(x, i, cos, sin)
        return rmsnorm(x, self.w("final_norm"), self.config.norm_eps) @ self.w("lm_head")  # (B, T, vocab)


def bytes_per_block(batch: int, tokens: int, d_model: int, world: int, element_size: int = 4) -> Fraction:
    """Bytes one rank sends per block per forward and backward: four ring all-reduces of the
    activations (B, T, d), each 2 (N - 1) / N of the tensor (parallel.comm)."""
    return ALL_REDUCES_PER_BLOCK * 2 * Fraction(world - 1, world) * batch * tokens * d_model * element_size


def build_model(config: str | dict | ModelConfig, seed: int) -> TorchTransformer:
    """A shipped model by name ("target", with its trained weights), or a ModelConfig (or its
    fields) with random weights from `seed`."""
    if isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"unknown model {config!r}; choose one of {', '.join(CONFIGS)}, or pass a ModelConfig")
        weights, loaded, _ = weight_files.load(weight_files.path_for(config))
        return TorchTransformer(loaded, weights)
    return TorchTransformer(config if isinstance(config, ModelConfig) else ModelConfig(**config), seed=seed)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of a from the reference b, relative to b's largest magnitude."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(torch.finfo(b.dtype).tiny))


def exactness_rank(seed: int, config: str | dict | ModelConfig, batch: int, tokens: int,
                   dtype: torch.dtype = torch.float32) -> dict:
    """On this rank: the single-process model and the tensor-parallel one, forward and backward on
    the same tokens and upstream gradient. Largest differences of the logits, of one block's
    output, of the sharded weights' gradients (against the matching slice of the single-process
    ones) and of the replicated weights' gradients, each relative to the single-process tensor's
    largest magnitude; the bytes and all-reduces counted per forward and backward. Both models
    compute in `dtype`: in float64 the two orders of summation agree to float64's rounding, far
    below anything a CPU's kernels (their blocking, threads, vector width) change."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config, seed).to(dtype)
    c = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab, (batch, tokens), generator=g)
    grad_logits = torch.randn(batch, tokens, c.vocab, generator=g, dtype=dtype)
    x = torch.randn(batch, tokens, c.d_model, generator=g, dtype=dtype)
    counter = ByteCounter()
    parallel = TensorParallelTransformer(model, counter=counter)
    with torch.no_grad():
        cos, sin = rope_tables(c, torch.arange(tokens))
        block_gap = _gap(parallel.block(x, 0, cos, sin), model.block(x, 0, cos, sin))
    counter.reset()
    logits = parallel(ids)
    (logits * grad_logits).sum().backward()
    single = model(ids)
    (single * grad_logits).sum().backward()
    sharded, replicated = 0.0, 0.0
    for name in model.numpy_weights():
        gap = _gap(parallel.w(name).grad, shard(name, model.w(name).grad, rank, world))
        if name.rsplit(".", 1)[-1] in SPLIT:
            sharded = max(sharded, gap)
        else:
            replicated = max(replicated, gap)
    return {"logits_gap": _gap(logits, single), "block_gap": block_gap, "sharded_grad_gap": sharded,
            "replicated_grad_gap": replicated, "bytes": counter.total_bytes(),
            "all_reduces": counter.calls["all_reduce"], "n_layers": c.n_layers, "d_model": c.d_model}


def _seconds(forward, rounds: int, together: bool = True) -> float:
    """The median wall time of forward() and its backward over `rounds`, after one warm-up;
    `together`: every rank starts each round at once."""
    times = []
    for _ in range(rounds + 1):
        if together:
            dist.barrier()
        began = time.perf_counter()
        forward().sum().backward()
        times.append(time.perf_counter() - began)
    return sorted(times[1:])[rounds // 2]


def timing_rank(seed: int, config: str | dict | ModelConfig, batch: int, tokens: int, rounds: int) -> dict:
    """Forward and backward of one MLP and of one block: tensor-parallel on every rank, against the
    single-process ones on rank 0 alone, with all of the machine's threads while the others wait.
    Seconds and ratios (parallel / single), the same on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config, seed)
    parallel = TensorParallelTransformer(model)
    c = model.config
    x = torch.randn(batch, tokens, c.d_model, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    cos, sin = rope_tables(c, torch.arange(tokens))
    w, m = parallel.w, model.w
    steps = {"mlp": (lambda: parallel_mlp(x, w("layers.0.w_gate"), w("layers.0.w_up"), w("layers.0.w_down")),
                     lambda: (F.silu(x @ m("layers.0.w_gate")) * (x @ m("layers.0.w_up"))) @ m("layers.0.w_down")),
             "block": (lambda: parallel.block(x, 0, cos, sin), lambda: model.block(x, 0, cos, sin))}
    result = {}
    for name, (tp_step, single_step) in steps.items():
        result[f"{name}_parallel_s"] = _seconds(tp_step, rounds)
        single_s = torch.zeros(1, dtype=torch.float64)
        if rank == 0:
            threads = torch.get_num_threads()
            torch.set_num_threads(threads * world)
            single_s[0] = _seconds(single_step, rounds, together=False)
            torch.set_num_threads(threads)
        dist.barrier()
        dist.broadcast(single_s, 0)
        result[f"{name}_single_s"] = float(single_s[0])
        result[f"{name}_ratio"] = result[f"{name}_parallel_s"] / result[f"{name}_single_s"]
    return result

