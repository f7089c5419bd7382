"""The ring collectives simulated in numpy (parallel.ring) against brute-force sums, the byte counts
of parallel.comm, and gloo's own reduce-scatter and all-gather."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.parallel import ring
from infra_lab.processes import run_on_ranks


@given(st.integers(1, 8), st.integers(1, 40), st.integers(0, 2**31))
def test_reduce_scatter_all_gather_and_all_reduce_against_sums(world, n, seed):
    buffers = np.random.default_rng(seed).integers(-9, 9, (world, n)).astype(np.float64)
    size = math.ceil(n / world)
    total = np.zeros(world * size)
    total[:n] = buffers.sum(0)
    shards, sends = ring.reduce_scatter(buffers)
    assert np.array_equal(shards, total.reshape(world, size))  # rank r holds summed chunk r
    assert ring.bytes_sent(sends, size * 8, world) == [(world - 1) * size * 8] * world  # (N - 1) / N each
    gathered, sends = ring.all_gather(shards)
    assert np.array_equal(gathered, np.tile(total, (world, 1)))
    assert len(sends) == world * (world - 1)
    reduced, sends = ring.all_reduce(buffers)
    assert np.array_equal(reduced, np.tile(buffers.sum(0), (world, 1)))
    assert ring.bytes_sent(sends, size * 8, world) == [2 * (world - 1) * size * 8] * world


def test_every_send_goes_to_the_next_rank_once_per_step():
    _, sends = ring.reduce_scatter(np.ones((4, 8)))
    for step in range(3):
        assert sorted(s.source for s in sends if s.step == step) == [0, 1, 2, 3]


def gloo_rank(buffers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.from_numpy(buffers[rank])
    shard = torch.empty(len(mine) // world, dtype=mine.dtype)
    dist.reduce_scatter_single(shard, mine)
    whole = torch.empty_like(mine)
    dist.all_gather_single(whole, shard)
    return shard.numpy(), whole.numpy()


@pytest.mark.slow
def test_gloo_computes_what_the_ring_does():
    buffers = np.random.default_rng(0).integers(-9, 9, (4, 12)).astype(np.float64)
    shards, _ = ring.reduce_scatter(buffers)
    gathered, _ = ring.all_gather(shards)
    for rank, (shard, whole) in enumerate(run_on_ranks(gloo_rank, 4, buffers)):
        assert np.array_equal(shard, shards[rank])
        assert np.array_equal(whole, gathered[rank])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"an \(N, n\) array; got shape \(3,\)"):
        ring.reduce_scatter(np.ones(3))
