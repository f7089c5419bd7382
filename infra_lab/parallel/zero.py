"""ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: memory optimizations toward training trillion
parameter models", SC 2020, section 5) around any elementwise optimizer (AdamW here).

Each unit's weights (parallel.units) live in one flat buffer, padded to a multiple of N; rank r
owns slice r of every unit and keeps the optimizer states of its slices only (stage 1, P_os).
A step reduce-scatters the gradients, so each rank receives the sum of its slices only, steps
its slices, and all-gathers the updated slices into every rank's full buffers: a reduce-scatter
and an all-gather, the 2 Psi of an all-reduce.
- Stage 1 keeps a full gradient buffer, filled by backward, and reduce-scatters it after.
- Stage 2 (P_os+g) keeps only its slices' gradients: when a unit's last gradient arrives during
  backward, a hook flattens the unit's gradients, starts their reduce-scatter and drops them.
The model's weights stay ordinary Parameters whose data are views into the flat buffers, so the
model runs unchanged.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infra_lab.model.torch_model import TorchTransformer
from infra_lab.parallel.comm import ByteCounter
from infra_lab.parallel.units import Unit, check_same_units, flatten, units, views

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ShardedOptimizer:
    """ZeRO stage 1 or 2 for `model` on this rank: call `step()` after backward."""

    def __init__(self, model: TorchTransformer, stage: int, counter: ByteCounter, make_optimizer: MakeOptimizer):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer runs ZeRO stage 1 or 2; got {stage!r} (stage 3: parallel.zero3)")
        self.model, self.stage, self.counter = model, stage, counter
        world, rank = counter.world, torch.distributed.get_rank(counter.group)
        self.units: list[Unit] = units(model)
        check_same_units(self.units, counter)
        self.flats: list[torch.Tensor] = []  # per unit (padded,): the weights, which the model's Parameters view
        self.shards: list[nn.Parameter] = []  # per unit (padded / N,): this rank's slice, a view of its flat buffer
        self.grad_flats: list[torch.Tensor] = []  # stage 1, per unit (padded,): the gradients backward fills
        self.in_flight: list[tuple[int, torch.Tensor, object]] = []  # stage 2: (unit, flat gradients, work)
        self.handles = []
        for u, unit in enumerate(self.units):
            padded = unit.padded(world)
            shard = slice(rank * padded // world, (rank + 1) * padded // world)
            flat = flatten([model.w(name).detach() for name in unit.names], padded)
            for name, view in views(flat, unit).items():
                model.w(name).data = view
            self.flats.append(flat)
            self.shards.append(nn.Parameter(flat[shard]))
            if stage == 1:
                grads = torch.zeros(padded, dtype=flat.dtype)
                for name, view in views(grads, unit).items():
                    model.w(name).grad = view  # backward adds into these in place
                self.grad_flats.append(grads)
                self.shards[-1].grad = grads[shard]
            else:
                self.shards[-1].grad = torch.zeros(shard.stop - shard.start, dtype=flat.dtype)
        if stage == 2:
            self.pending = {}
            for u, unit in enumerate(self.units):
                for name in unit.names:
                    self.handles.append(model.w(name).register_post_accumulate_grad_hook(self._ready(u)))
            self._arm()
        self.optimizer = make_optimizer(self.shards)

    def _arm(self) -> None:
        self.pending = {u: len(unit.names) for u, unit in enumerate(self.units)}

    def _ready(self, u: int):
        unit = self.units[u]

        def hook(_: torch.Tensor) -> None:
            self.pending[u] -= 1
            if self.pending[u]:
                return
            grads = flatten([self.model.w(name).grad for name in unit.names], unit.padded(self.counter.world))
            for name in unit.names:  # the unit's full gradients go: only this rank's slice stays
                self.model.w(name).grad = None
            received = torch.empty_like(self.shards[u].grad)
            self.in_flight.append((u, received, self.counter.reduce_scatter(received, grads, async_op=True)))
        return hook

    def step(self) -> None:
        world = self.counter.world
        if self.stage == 1:
            for u, grads in enumerate(self.grad_flats):
                received = torch.empty_like(self.shards[u].grad)
                self.counter.reduce_scatter(received, grads)
                self.shards[u].grad.copy_(received / world)
        else:
            if len(self.in_flight) != len(self.units):
                raise RuntimeError(f"only {len(self.in_flight)} of {len(self.units)} units got their gradients: "
                                   f"every trainable weight must take part in the loss")
            for u, received, work in self.in_flight:
                work.wait()
                self.shards[u].grad.copy_(received / world)
            self.in_flight.clear()
            self._arm()
        self.optimizer.step()
        for flat, shard in zip(self.flats, self.shards):
            self.counter.all_gather(flat, shard.detach().clone())
        for grads in self.grad_flats:
            grads.zero_()
