"""Checks for chapter 06's second part: splicing a transfer's K and V into a decode pool, picking
the prefill:decode ratio with the most goodput per GPU, and an autoscaler of one's own
(registered from ch06.py, so that `check("ch06....")` finds them).

The references call the package: `kv.paged.PagedKVCache.import_sequence` over the case's pool
and free list, `serving.placement`'s search, and the simulator's fleet replay. Every case is drawn
from plain numbers, so a failure line shows them.
"""
from __future__ import annotations

import functools
from collections import deque

import numpy as np

from infra_lab.grading.ch07 import Schedule
from infra_lab.grading.checks import Check, register
from infra_lab.kv.paged import OutOfBlocks, PagedKVCache, SequenceKV
from infra_lab.serving import placement

# ---- exercise 5: splice a transfer into a block table -----------------------------------------------


def splice(pool, free_ids, block_size, kv):
    """Reference: the pool's own import (PagedKVCache.import_sequence) over `pool`, in place, with
    its allocator handing out `free_ids` in order; the new sequence's block table."""
    n_layers, num_blocks, _, size, n_kv_heads, head_dim = pool.shape
    cache = PagedKVCache(n_layers, n_kv_heads, head_dim, num_blocks, size)
    cache.kv = pool  # the case's pool itself: the import writes into it
    cache.allocator.free_ids = deque(int(b) for b in free_ids)
    if len(free_ids) * size < kv.shape[2]:
        raise ValueError(f"{kv.shape[2]} tokens need {-(-kv.shape[2] // size)} blocks; {len(free_ids)} are free")
    try:
        seq = cache.import_sequence(SequenceKV(kv, tuple(range(kv.shape[2]))))
    except OutOfBlocks as error:
        raise ValueError(str(error)) from None
    return list(cache.tables[seq])


def drive_splice(function, pool, free_ids, block_size, kv):
    """The table it returned (or that it refused, with ValueError), and the pool after."""
    try:
        table = function(pool, list(free_ids), block_size, kv)
        outcome = ("table", [int(b) for b in table])
    except ValueError:
        outcome = ("refused", "ValueError")
    return outcome, ("pool after", pool)


def _splice_case(kind, rng):
    n_layers, n_kv_heads, head_dim = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([2, 4]))
    block_size = int(rng.choice([1, 2, 4, 8]))
    num_blocks = int(rng.integers(4, 13))
    n_free = int(rng.integers(1, num_blocks + 1))
    free_ids = [int(b) for b in rng.permutation(num_blocks)[:n_free]]
    room = n_free * block_size
    if kind == "too long":
        tokens = room + int(rng.integers(1, block_size + 2))
    elif kind == "whole blocks":
        tokens = block_size * int(rng.integers(1, n_free + 1))
    else:
        tokens = int(rng.integers(1, room + 1))
    pool = rng.standard_normal((n_layers, num_blocks, 2, block_size, n_kv_heads, head_dim)).astype(np.float32)
    kv = rng.standard_normal((n_layers, 2, tokens, n_kv_heads, head_dim)).astype(np.float32)
    return pool, free_ids, block_size, kv


_SPLICE_KINDS = ["random", "whole blocks", "random", "too long"] * 6

register(Check("ch06.splice", splice, Schedule(_SPLICE_KINDS, _splice_case), drive=drive_splice, rtol=0, atol=0))


# ---- exercise 6: the goodput-optimal ratio ---------------------------------------------------------------

def best_ratio(prefill_req_s, decode_req_s, gpus):
    """Reference: serving.placement's search over one-GPU instances: (prefill GPUs, decode GPUs,
    goodput per GPU) with the most goodput per GPU within `gpus`, the fewest GPUs among equals."""
    best = placement.best_placement(placement.PhaseGoodputs({1: prefill_req_s}, {1: decode_req_s}), gpus)
    return best.prefill_count, best.decode_count, best.rate_per_cost


def drive_ratio(function, prefill_req_s, decode_req_s, gpus):
    got = function(prefill_req_s, decode_req_s, gpus)
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        raise TypeError(f"best_ratio must return (prefill_gpus, decode_gpus, goodput_per_gpu); got {got!r:.100}")
    return ("GPUs", [int(got[0]), int(got[1])]), ("goodput per GPU", float(got[2]))


def _ratio_case(kind, rng):
    """Capacities are quarters of a request per second: rates and their ratios are exact, so two
    placements of equal goodput per GPU are equal to the last bit."""
    quarter = lambda low, high: int(rng.integers(4 * low, 4 * high + 1)) / 4  # noqa: E731
    if kind == "distserve":  # the paper's Figure 1: 5.6 and 10 req/s, near enough in quarters
        return 5.5, 10.0, int(rng.integers(2, 13))
    if kind == "decode bound":
        return quarter(8, 40), quarter(0.5, 4), int(rng.integers(2, 17))
    if kind == "tight budget":
        return quarter(0.5, 20), quarter(0.5, 20), int(rng.integers(2, 4))
    return quarter(0.5, 20), quarter(0.5, 20), int(rng.integers(2, 33))


_RATIO_KINDS = ["distserve", "random", "decode bound", "tight budget", "random", "random"] * 4

register(Check("ch06.best_ratio", best_ratio, Schedule(_RATIO_KINDS, _ratio_case), drive=drive_ratio,
               rtol=1e-12, atol=0))


# ---- exercise 7: an autoscaler of one's own -----------------------------------------------------------

class WrongScaling(AssertionError):
    """An autoscaler's replay misses what the exercise asks (the failure line says by how much)."""


PEAK_LOADS = (4.2, 5.0, 6.0)  # the wave's peak, in saturated replicas' throughput (the trough is a fifth)
TIME_SCALE = 0.013  # the study's time-lapse, as tests/test_autoscaling.py runs it
TARGET_SHARE = 1.0  # replica-seconds, fewer than static peak provisioning's


@functools.lru_cache(maxsize=8)
def _scenario(peak_load: float, seed: int):
    """(scenario, one replica's saturated req/s, the trace)."""
    from infra_lab import roofline
    from infra_lab.serving import autoscaling_study as study

    scenario = study.Scenario(roofline.LLAMA_3_8B, time_scale=TIME_SCALE, peak_load=peak_load, seed=seed)
    saturated = study.saturated_req_s(scenario, n=128)
    return scenario, saturated, scenario.trace(saturated)


@functools.lru_cache(maxsize=8)
def _static_peak(peak_load: float, seed: int):
    """Static peak provisioning's replay of the case's trace: asked for once an autoscaler's replay
    has run (one that fails to start or to replay needs none)."""
    from infra_lab.serving import autoscaling_study as study

    scenario, saturated, trace = _scenario(peak_load, seed)
    return study.static_peak(scenario, trace, scenario.rate(saturated), saturated)


def _reference_autoscaler(limits, replica_req_s, cold_start_s):
    """The package's answer: Dynamo-style planning one cold start ahead on the arrival rate, at the
    utilization the study plans to (autoscaling_study.autoscalers' forecast)."""
    from infra_lab.serving.autoscaling import Forecast
    from infra_lab.serving.autoscaling_study import Scenario

    return Forecast("rate", Scenario.slo_utilization * replica_req_s, cold_start_s + limits.interval_s, limits,
                    window_s=60.0 * TIME_SCALE, stabilization_s=60.0 * TIME_SCALE)


def drive_autoscaler(autoscaler_class, peak_load, seed):
    """Replay the case's 5x trace with autoscaler_class(limits, replica_req_s, cold_start_s); what
    the exercise asks of the replay, each as True, or WrongScaling naming the figures."""
    import math

    from infra_lab.serving.autoscaling import Autoscaler, Limits
    from infra_lab.serving.autoscaling_replay import replay

    scenario, saturated, trace = _scenario(peak_load, seed)
    rate = scenario.rate(saturated)
    limits = Limits(max(1, math.ceil(rate.base_per_s / saturated)), scenario.max_replicas, scenario.interval)
    made = autoscaler_class(limits, saturated, scenario.cold_start_s)
    if not isinstance(made, Autoscaler):
        raise TypeError(f"YourAutoscaler must subclass infra_lab.serving.autoscaling.Autoscaler; got "
                        f"{type(made).__name__}")
    run = replay(trace, made, scenario.time_model(), scenario.engine_config(), scenario.cold_start_s, scenario.slo)
    peak = _static_peak(peak_load, seed)
    share = run.replica_seconds / peak.replica_seconds
    per_interval = max(np.bincount([round(t / limits.interval_s) for t, _ in run.actions]), default=0) \
        if run.actions else 0
    found = (f"attainment {run.attainment:.1%} (goal {scenario.slo.goal:.0%}), replica-seconds "
             f"{share:.0%} of static peak's ({peak.replica_seconds:.0f} s), {len(run.actions)} actions")
    if run.attainment < scenario.slo.goal or share >= TARGET_SHARE or per_interval > 1:
        raise WrongScaling(f"on the trace with peak {peak_load}x and seed {seed}: {found}")
    return (("attainment at least the goal", True), ("fewer replica-seconds than static peak's", True),
            ("at most one action per interval", True))


def _autoscaler_case(kind, rng):
    """Each peak once, each with its own trace (seed): a replay takes seconds, so three cases."""
    return float(PEAK_LOADS[int(kind)]), int(kind)


register(Check("ch06.YourAutoscaler", _reference_autoscaler, Schedule(["0", "1", "2"], _autoscaler_case),
               n_cases=3, drive=drive_autoscaler, rtol=0, atol=0))
