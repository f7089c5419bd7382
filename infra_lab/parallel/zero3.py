"""ZeRO stage 3 (P_os+g+p; Rajbhandari et al. 2020, section 5.3): each rank keeps only its slice of
every unit's weights, gradients and optimizer states; a unit's weights are all-gathered right
before the unit runs and dropped right after.

`Gather` is the one collective: its forward all-gathers a unit's flat weights from the slices,
its backward reduce-scatters the unit's flat gradient back into this rank's slice (averaged over
the ranks). Each unit runs inside torch.utils.checkpoint, so nothing it computed, gathered
weights included, is kept for backward: backward runs the unit again, which gathers its weights
a second time. That gives ZeRO's 3 Psi per step (gather, gather again, reduce-scatter), at the
price of recomputing the forward, as activation checkpointing does (FSDP keeps the activations and
re-gathers only the weights).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infra_lab.model.torch_model import TorchTransformer, rope_tables
from infra_lab.parallel.comm import ByteCounter
from infra_lab.parallel.units import Unit, check_same_units, flatten, units, views
from infra_lab.parallel.zero import MakeOptimizer


class Gather(torch.autograd.Function):
    """shard (padded / N,) -> the unit's flat weights (padded,); backward: the flat gradient
    reduce-scattered and averaged into the shard's gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, counter: ByteCounter) -> torch.Tensor:
        ctx.counter = counter
        whole = shard.new_empty(shard.numel() * counter.world)
        counter.all_gather(whole, shard.detach().contiguous())
        return whole

    @staticmethod
    def backward(ctx, grad_whole: torch.Tensor):
        counter = ctx.counter
        grad_shard = grad_whole.new_empty(grad_whole.numel() // counter.world)
        counter.reduce_scatter(grad_shard, grad_whole.contiguous())
        return grad_shard / counter.world, None


class FullyShardedModel:
    """`model` with its weights sharded over the ranks: `loss(x, y)`, backward, then `step()`.
    It takes the model over: the model's own full weights are dropped."""

    def __init__(self, model: TorchTransformer, counter: ByteCounter, make_optimizer: MakeOptimizer):
        world, rank = counter.world, torch.distributed.get_rank(counter.group)
        self.model, self.counter = model, counter
        self.units: list[Unit] = units(model)
        check_same_units(self.units, counter)
        self.shards: list[nn.Parameter] = []  # per unit (padded / N,)
        for unit in self.units:
            padded = unit.padded(world)
            flat = flatten([model.w(name).detach() for name in unit.names], padded)
            self.shards.append(nn.Parameter(flat[rank * padded // world:(rank + 1) * padded // world].clone()))
        for name in [n for unit in self.units for n in unit.names]:
            del model.weights[name.replace(".", "__")]
        self.gathered: dict[str, torch.Tensor] = {}  # the running unit's weights, views of its gathered buffer
        untrained = {name.replace("__", "."): p for name, p in model.weights.items()}  # e.g. MoE balancing biases
        model.w = lambda name: self.gathered[name] if name in self.gathered else untrained[name]
        self.optimizer = make_optimizer(self.shards)

    def _run(self, u: int, shard: torch.Tensor, compute, *args) -> torch.Tensor:
        self.gathered.update(views(Gather.apply(shard, self.counter), self.units[u]))
        try:
            return compute(*args)
        finally:
            self.gathered.clear()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), one unit's weights gathered at a time."""
        m = self.model
        cos, sin = rope_tables(m.config, torch.arange(tokens.shape[1]))

        def run(u, compute, *args):
            return checkpoint(self._run, u, self.shards[u], compute, *args, use_reentrant=False)

        x = run(0, lambda t: m.w("embed")[t], tokens)  # (B, T, d)
        for i in range(m.config.n_layers):
            x = run(1 + i, m.block, x, i, cos, sin)
        return run(len(self.units) - 1, m.head, x)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight, gathered (outside any count: call it after the counted steps)."""
        out = {}
        with torch.no_grad():
            for unit, shard in zip(self.units, self.shards):
                whole = shard.new_empty(shard.numel() * self.counter.world)
                torch.distributed.all_gather_single(whole, shard.detach(), group=self.counter.group)
                out |= {name: v.clone() for name, v in views(whole, unit).items()}
        return out
