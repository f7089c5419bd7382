"""The ring algorithms behind all-reduce, simulated step by step in numpy: what each rank sends
and adds, and the bytes that makes (Patarasuk and Yuan 2009; the ring NCCL and gloo use for large
tensors). This is the reference of what a reduce-scatter and an all-gather compute; parallel.comm
counts the same bytes around torch.distributed's real collectives.

N ranks each hold a buffer of n values, padded to N chunks of S = ceil(n / N). Reduce-scatter
takes N - 1 steps: at step t, rank r sends its running sum of chunk (r - t - 1) mod N to rank
r + 1, which adds its own; chunk c starts at rank c + 1 and ends, summed over all N, at rank c.
All-gather passes the finished chunks around the ring the same way, without adding. Each rank
sends N - 1 chunks per phase: (N - 1) / N of the buffer, twice for an all-reduce.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


class Send(NamedTuple):
    step: int
    source: int
    chunk: int  # destination is (source + 1) % N


def _chunks(buffers: np.ndarray) -> np.ndarray:
    """(N, n) -> (N, N, S): each rank's buffer, zero-padded and cut into N chunks."""
    buffers = np.asarray(buffers)
    if buffers.ndim != 2 or buffers.shape[0] < 1:
        raise ValueError(f"give one buffer per rank as an (N, n) array; got shape {buffers.shape}")
    world, n = buffers.shape
    size = math.ceil(n / world)
    padded = np.zeros((world, world * size), buffers.dtype)
    padded[:, :n] = buffers
    return padded.reshape(world, world, size)


def reduce_scatter(buffers: np.ndarray) -> tuple[np.ndarray, list[Send]]:
    """(N, n) buffers -> (N, S): rank r's chunk r summed over the ranks, and every send made."""
    chunks = _chunks(buffers).copy()
    world = chunks.shape[0]
    sends = []
    for step in range(world - 1):
        moving = [(r, (r - step - 1) % world) for r in range(world)]
        payloads = [chunks[r, c].copy() for r, c in moving]  # every rank sends before any adds
        for (r, c), payload in zip(moving, payloads):
            chunks[(r + 1) % world, c] += payload
            sends.append(Send(step, r, c))
    return np.stack([chunks[r, r] for r in range(world)]), sends


def all_gather(shards: np.ndarray) -> tuple[np.ndarray, list[Send]]:
    """(N, S) shards, rank r's being chunk r -> (N, N * S): every rank holds every chunk."""
    shards = np.asarray(shards)
    world, size = shards.shape
    held = np.full((world, world, size), np.nan, shards.dtype if shards.dtype.kind == "f" else np.float64)
    for r in range(world):
        held[r, r] = shards[r]
    sends = []
    for step in range(world - 1):
        moving = [(r, (r - step) % world) for r in range(world)]
        for r, c in moving:
            held[(r + 1) % world, c] = held[r, c]
            sends.append(Send(step, r, c))
    return held.reshape(world, world * size), sends


def all_reduce(buffers: np.ndarray) -> tuple[np.ndarray, list[Send]]:
    """(N, n) -> (N, n): every rank holds the sum; a reduce-scatter, then an all-gather."""
    n = np.asarray(buffers).shape[1]
    shards, scattered = reduce_scatter(buffers)
    gathered, sends = all_gather(shards)
    return gathered[:, :n], scattered + [Send(s.step + len(buffers) - 1, s.source, s.chunk) for s in sends]


def bytes_sent(sends: list[Send], chunk_bytes: int, world: int) -> list[int]:
    """Bytes each rank sent, from the log of sends."""
    out = [0] * world
    for send in sends:
        out[send.source] += chunk_bytes
    return out
