"""The model's trainable parameters in units, the granularity at which data parallelism reduces
gradients and ZeRO shards and gathers: the embedding, each transformer block, and the head (final
norm and LM head). A unit is laid out as one flat buffer, padded to a multiple of the world size
so that every rank owns an equal, contiguous slice of it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from infra_lab.model.torch_model import TorchTransformer
from infra_lab.moe.expert_parallel import check_agreement


class Unit(NamedTuple):
    name: str  # "embed", "layers.0", ..., "head"
    names: tuple[str, ...]  # weight names in the unit, in a fixed order
    shapes: tuple[torch.Size, ...]

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def padded(self, world: int) -> int:
        return world * math.ceil(self.elements / world)


def units(model: TorchTransformer) -> list[Unit]:
    """The units in forward order; backward produces their gradients in reverse."""
    trainable = {name.replace("__", "."): p for name, p in model.weights.items() if p.requires_grad}

    def unit(name: str, names: list[str]) -> Unit:
        return Unit(name, tuple(names), tuple(trainable[n].shape for n in names))

    layers = [unit(f"layers.{i}", [n for n in trainable if n.startswith(f"layers.{i}.")])
              for i in range(model.config.n_layers)]
    return [unit("embed", ["embed"]), *layers, unit("head", ["final_norm", "lm_head"])]


def unit_sizes(model: TorchTransformer) -> list[int]:
    return [u.elements for u in units(model)]


def views(flat: torch.Tensor, unit: Unit) -> dict[str, torch.Tensor]:
    """The unit's weights as views of its flat buffer (padded, or exactly its elements long)."""
    out, offset = {}, 0
    for name, shape in zip(unit.names, unit.shapes):
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def flatten(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    """The tensors one after another in a new buffer of `padded` elements, zeros after them."""
    flat = torch.zeros(padded, dtype=tensors[0].dtype)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:sum(t.numel() for t in tensors)])
    return flat


def check_same_units(model_units: list[Unit], counter) -> None:
    """Raise the same ValueError on every rank when the ranks' models differ in any unit's size,
    before a collective whose sizes depend on it could hang."""
    check_agreement(counter.group, units=len(model_units))  # first the count: it sets the next call's sizes
    check_agreement(counter.group, **{f"{unit.name} elements": unit.elements for unit in model_units})
