"""Collectives that count what they move: every call goes to torch.distributed, and this rank's
share of the traffic is added up per collective.

The count is the ring algorithm's, what NCCL and gloo use for large tensors (Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms", 2009). On N ranks, for a tensor of n bytes in all:
- reduce-scatter: each rank sends (N - 1) / N * n bytes (N - 1 steps of one shard);
- all-gather: the same, (N - 1) / N * n;
- all-reduce: a reduce-scatter then an all-gather, 2 (N - 1) / N * n;
- send: n.
ZeRO's paper counts volumes in elements without the factor: an all-reduce of the gradients moves
"2 Psi" (Rajbhandari et al. 2020, 7.1). `volume` keeps that count (elements of the whole tensor,
twice for an all-reduce), `bytes_sent` the ring's bytes with the factor.
"""
from __future__ import annotations

import collections
from fractions import Fraction

import torch
import torch.distributed as dist

RING_PASSES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # passes of (N - 1) / N of the tensor


class ByteCounter:
    """This rank's collectives, counted: `bytes_sent[name]` (ring bytes, exact fractions),
    `volume[name]` (elements, ZeRO's convention) and `calls[name]`."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.reset()

    def reset(self) -> None:
        self.bytes_sent: dict[str, Fraction] = collections.defaultdict(Fraction)
        self.volume: dict[str, int] = collections.defaultdict(int)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def total_bytes(self) -> Fraction:
        return sum(self.bytes_sent.values(), Fraction(0))

    def total_volume(self) -> int:
        return sum(self.volume.values())

    def _count(self, name: str, whole: torch.Tensor | int, element_size: int) -> None:
        elements = whole if isinstance(whole, int) else whole.numel()
        passes = RING_PASSES.get(name, 1)
        factor = Fraction(self.world - 1, self.world) if name in RING_PASSES else Fraction(1)
        self.bytes_sent[name] += passes * factor * elements * element_size
        self.volume[name] += passes * elements
        self.calls[name] += 1

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        self._count("all_reduce", tensor, tensor.element_size())
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, whole: torch.Tensor, async_op: bool = False):
        """shard (n / N,) <- the sum over ranks of whole (n,)'s slice for this rank."""
        self._count("reduce_scatter", whole, whole.element_size())
        return dist.reduce_scatter_single(shard, whole, group=self.group, async_op=async_op)

    def all_gather(self, whole: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """whole (n,) <- every rank's shard (n / N,), in rank order."""
        self._count("all_gather", whole, whole.element_size())
        return dist.all_gather_single(whole, shard, group=self.group, async_op=async_op)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        self._count("send", tensor, tensor.element_size())
        return dist.isend(tensor, dst, group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        dist.recv(tensor, src, group=self.group, tag=tag)
