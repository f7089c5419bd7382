"""The launcher of the distributed chapters (infra_lab.processes.run_on_ranks): results in rank
order, a rank's error raised with its message, and ranks that die without a word reported at
once rather than after the group's timeout (when one rank dies alone, gloo tells the others)."""
import os
import time

import pytest

pytest.importorskip("torch")

from infra_lab.processes import run_on_ranks  # noqa: E402


def rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one was given a bad value")
    dist.barrier()


def die():
    os._exit(3)  # as a crash in C, or the kernel's OOM killer, would: no exception, no result


@pytest.mark.slow
def test_results_come_back_in_rank_order():
    assert run_on_ranks(rank_and_world, 2) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_with_its_type_and_message():
    with pytest.raises(ValueError, match="rank one was given a bad value"):
        run_on_ranks(fail_on_rank_one, 2, timeout_s=30)


@pytest.mark.slow
def test_a_rank_that_dies_without_a_result_is_reported_long_before_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 exited with code 3 before returning a result"):
        run_on_ranks(die, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # the group's timeout would have taken 150 s


@pytest.mark.parametrize("world", [0, -1, 1.5, True, "2"])
def test_a_bad_world_size_is_named(world):
    with pytest.raises(ValueError, match=f"world size must be an integer >= 1; got {world!r}"):
        run_on_ranks(rank_and_world, world)


def test_an_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown backend 'mpi'; choose one of gloo, nccl"):
        run_on_ranks(rank_and_world, 2, backend="mpi")
