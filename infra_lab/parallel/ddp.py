"""Data parallelism: every rank holds the whole model, runs its share of the batch, and the ranks
average their gradients with an all-reduce before each optimizer step (Li et al., "PyTorch
Distributed: experiences on accelerating data parallel training", VLDB 2020).

The all-reduce is bucketed by unit (the embedding, each block, the head) and starts during the
backward pass: a hook on each parameter fires when its gradient is ready, and when the last
gradient of a unit arrives, the unit's gradients are flattened and all-reduced asynchronously
while backward goes on to earlier layers. `finish()` waits for the buckets and writes the averages
back. With `overlap=False` the same buckets are all-reduced one after another once backward ends:
the baseline whose communication is fully exposed.
"""
from __future__ import annotations

import torch

from infra_lab.model.torch_model import TorchTransformer
from infra_lab.parallel.comm import ByteCounter
from infra_lab.parallel.units import Unit, check_same_units, flatten, units, views


class DataParallel:
    def __init__(self, model: TorchTransformer, counter: ByteCounter, overlap: bool = True):
        self.model, self.counter, self.overlap = model, counter, overlap
        self.units: list[Unit] = units(model)
        check_same_units(self.units, counter)
        self.pending: dict[str, int] = {}  # unit name -> gradients still to arrive in this backward
        self.in_flight: list[tuple[Unit, torch.Tensor, object]] = []  # (unit, flat gradients, work)
        self.unit_of = {name: unit for unit in self.units for name in unit.names}
        self.handles = [model.w(name).register_post_accumulate_grad_hook(self._ready(name))
                        for name in self.unit_of] if overlap else []
        self._arm()

    def _arm(self) -> None:
        self.pending = {unit.name: len(unit.names) for unit in self.units}

    def _ready(self, name: str):
        unit = self.unit_of[name]

        def hook(_: torch.Tensor) -> None:
            self.pending[unit.name] -= 1
            if self.pending[unit.name] == 0:
                self._launch(unit, async_op=True)
        return hook

    def _launch(self, unit: Unit, async_op: bool) -> None:
        grads = flatten([self.model.w(name).grad for name in unit.names], unit.elements)  # (unit elements,)
        self.in_flight.append((unit, grads, self.counter.all_reduce(grads, async_op=async_op)))

    def finish(self) -> None:
        """After backward: every gradient replaced by its average over the ranks."""
        if not self.overlap:
            for unit in reversed(self.units):
                self._launch(unit, async_op=False)
        for unit, grads, work in self.in_flight:
            if work is not None:
                work.wait()
            grads /= self.counter.world
            for name, average in views(grads, unit).items():
                self.model.w(name).grad.copy_(average)
        if len(self.in_flight) != len(self.units):
            raise RuntimeError(f"only {len(self.in_flight)} of {len(self.units)} units got their gradients: "
                               f"every trainable weight must take part in the loss")
        self.in_flight.clear()
        self._arm()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
