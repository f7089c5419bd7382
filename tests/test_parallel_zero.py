"""Data parallelism and ZeRO stages 1-3 on gloo processes (parallel.ddp, zero, zero3, runs): the same
training as one process, memory and bytes exactly as modelled, torch's ZeroRedundancyOptimizer and
FSDP beside ours, hooks that launch during backward, and ranks that disagree failing by name.

The chapter's bar is 50 steps; the benchmark (benchmarks/parallel.py) runs those on 2 and 4
processes. Here fewer, shorter steps keep the suite inside CI's budget: same code, same checks.
"""
import functools

import numpy as np
import pytest

from infra_lab.parallel import memory, runs
from infra_lab.parallel.units import unit_sizes
from infra_lab.processes import run_on_ranks

SETTINGS = {2: runs.Settings(steps=10), 4: runs.Settings(steps=5)}  # batches of 8 windows of 64 bytes


@functools.cache
def trained(world: int) -> tuple[dict, list[list[dict]]]:
    settings = SETTINGS[world]
    return runs.single_process(settings), run_on_ranks(runs.compare_rank, world, list(runs.METHODS), settings,
                                                       timeout_s=240)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", runs.METHODS)
def test_same_training_as_one_process(world, method):
    reference, ranks = trained(world)
    results = [rank[runs.METHODS.index(method)] for rank in ranks]
    losses = np.mean([r["losses"] for r in results], axis=0)  # equal shares: the mean of the ranks' means
    assert np.max(np.abs(losses - reference["losses"]) / np.abs(reference["losses"])) < 1e-5
    weights = results[0]["weights"]
    assert set(weights) == set(reference["weights"])
    for name, value in reference["weights"].items():
        assert np.max(np.abs(weights[name] - value)) < 1e-5, name
    start = runs.shipped_model().numpy_weights()  # and the steps did move the weights: the match is not trivial
    assert max(np.max(np.abs(weights[n] - start[n])) for n in weights) > 100 * 1e-5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", runs.METHODS)
def test_memory_held_as_modelled(world, method):
    _, ranks = trained(world)
    sizes = unit_sizes(runs.shipped_model())
    for rank in ranks:
        result = rank[runs.METHODS.index(method)]
        assert result["modelled"] == memory.state_bytes(sizes, world, runs.STAGE[method], memory.FP32)
        if method == "torch ZeroRedundancyOptimizer":  # it shards whole tensors, so its shares are uneven
            assert result["held"]["parameters"] == result["modelled"]["parameters"]
            continue
        assert result["held"] == result["modelled"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", runs.OURS)
def test_bytes_moved_as_modelled(world, method):
    _, ranks = trained(world)
    psi = sum(unit_sizes(runs.shipped_model()))
    volume = {0: 2 * psi, 1: 2 * psi, 2: 2 * psi, 3: 3 * psi}[runs.STAGE[method]]  # the target's units divide by 4
    for rank in ranks:
        result = rank[runs.METHODS.index(method)]
        assert result["volume_modelled"] == volume
        for step in result["sent_per_step"]:
            assert step["volume"] == volume
            sent = sum(v for k, v in step.items() if k != "volume")
            assert sent == volume * 4 * (world - 1) / world  # fp32, and each rank sends (N - 1) / N


def test_overlapped_all_reduce_starts_during_backward():
    for rank in run_on_ranks(runs.hooks_rank, 2):
        assert rank["launched in backward"] == rank["units"]
        assert rank["launched without overlap"] == 0


@pytest.mark.parametrize("method", ["ddp", "zero-3"])  # zero-1 and zero-2 run the same check (units.check_same_units)
def test_ranks_that_disagree_on_shapes_fail_by_name(method):
    with pytest.raises(ValueError, match=r"the ranks disagree on layers\.0 elements \(rank 0: 246016, rank 1: 442624\)"):
        run_on_ranks(runs.disagreeing_rank, 2, method, timeout_s=30)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown method 'zero-4'"):
        run_on_ranks(runs.train_rank, 2, "zero-4", runs.Settings(steps=1))
    with pytest.raises(ValueError, match="a batch of 3 windows does not split evenly over 2 processes"):
        run_on_ranks(runs.train_rank, 2, "ddp", runs.Settings(steps=1, batch=3))
