"""Activation checkpointing: keep only each transformer block's input during the forward pass and
run the block again during the backward pass to get the activations its gradient needs. Memory for
activations falls from every block's to the blocks' inputs plus one block's, for about one more
forward pass of compute (Chen et al. 2016, "Training deep nets with sublinear memory cost";
Korthikanti et al. 2022, "Reducing activation recomputation in large transformer models", which
counts the bytes per layer and recomputes only the attention core).

`forward` wraps each block in torch.utils.checkpoint; `saved_activation_bytes` counts what
autograd keeps for the backward pass, `peak_live_bytes` the most tensor bytes alive at once, `live_bytes_trace` those bytes after every
operation of a step (the curve chapter 10 draws), and `compare` sets the counts, and the time of a
forward and backward pass, side by side.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint as checkpointed

from infra_lab.model.torch_model import TorchTransformer, rope_tables


def forward(model: TorchTransformer, tokens: torch.Tensor, checkpoint: bool) -> torch.Tensor:
    """model(tokens), tokens (B, T) -> logits (B, T, vocab), with each block checkpointed or not."""
    cos, sin = rope_tables(model.config, torch.arange(tokens.shape[1], device=tokens.device))  # (T, Dh/2)
    x = model.w("embed")[tokens]  # (B, T, d)
    for i in range(model.config.n_layers):
        if checkpoint:  # autograd keeps x; the block's insides are rebuilt in the backward pass
            x = checkpointed(model.block, x, i, cos, sin, use_reentrant=False)
        else:
            x = model.block(x, i, cos, sin)  # (B, T, d)
    return model.head(x)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def saved_activation_bytes(fn: Callable[[], object]) -> int:
    """The bytes of the tensors autograd saves for the backward pass while fn() runs, counted by
    torch.autograd.graph.saved_tensors_hooks as they are saved: each storage once (views of one
    tensor share it), and parameters (or views of them) left out, since they are held anyway.
    With checkpointing, the tensors saved inside a checkpointed block go to the checkpoint's own
    hooks, which drop them; what the block's checkpoint saves instead (its inputs) counts here."""
    storages: dict[int, torch.UntypedStorage] = {}  # data pointer -> storage, held so no address is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            storage = t.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storage.nbytes() for storage in storages.values())


class _LiveBytes(TorchDispatchMode):
    """After every operation, the bytes of the storages created since entering that are still alive."""

    def __init__(self):
        super().__init__()
        self.alive: dict[StorageWeakRef, int] = {}  # storage -> bytes
        self.trace: list[int] = []  # the bytes alive after each operation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.alive.setdefault(StorageWeakRef(storage), storage.nbytes())
        self.alive = {ref: size for ref, size in self.alive.items() if not ref.expired()}
        self.trace.append(sum(self.alive.values()))
        return out


def peak_live_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of tensors created inside fn() that are alive at once, looked at after each
    operation, the backward pass's included (and the recomputation in it): on a CPU, what
    torch.cuda.max_memory_allocated would say on a GPU, less the allocator's rounding."""
    with _LiveBytes() as mode:
        fn()
    return max(mode.trace, default=0)


class Trace(NamedTuple):
    live_bytes: list[int]  # tensor bytes alive after each operation of a forward and backward pass
    backward_from: int  # the index of the backward pass's first operation


def _loss(model: TorchTransformer, tokens: torch.Tensor, checkpoint: bool) -> torch.Tensor:
    """The mean cross-entropy of predicting each next token of tokens (B, T)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T - 1) each
    logits = forward(model, inputs, checkpoint)  # (B, T - 1, vocab)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def live_bytes_trace(model: TorchTransformer, tokens: torch.Tensor, checkpoint: bool) -> Trace:
    """The bytes of tensors alive after each operation of one forward and backward pass on
    tokens (B, T), with each block checkpointed or not; the gradients are cleared after."""
    model.zero_grad(set_to_none=True)
    with _LiveBytes() as mode:
        loss = _loss(model, tokens, checkpoint)
        backward_from = len(mode.trace)
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return Trace(mode.trace, backward_from)


class Comparison(NamedTuple):
    saved_bytes: int  # kept by autograd for the backward pass, after the forward pass
    peak_bytes: int  # most tensor bytes alive at once during forward and backward
    seconds: float  # median time of a forward and backward pass


def compare(model: TorchTransformer, tokens: torch.Tensor, repeats: int = 5) -> dict[bool, Comparison]:
    """{checkpoint: Comparison} for a forward and backward pass of the mean cross-entropy of
    predicting each next token of tokens (B, T); the time is the median of `repeats` after one
    untimed pass."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats!r}")

    def loss(checkpoint: bool) -> torch.Tensor:
        return _loss(model, tokens, checkpoint)

    def step(checkpoint: bool) -> None:
        model.zero_grad(set_to_none=True)
        loss(checkpoint).backward()

    results = {}
    for checkpoint in (False, True):
        saved = saved_activation_bytes(lambda: loss(checkpoint))
        peak = peak_live_bytes(lambda: step(checkpoint))
        times = []
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            step(checkpoint)
            if repeat:
                times.append(time.perf_counter() - started)
        results[checkpoint] = Comparison(saved, peak, statistics.median(times))
    model.zero_grad(set_to_none=True)
    return results
