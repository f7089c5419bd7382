"""Checks for chapter 00's exercises."""
from __future__ import annotations

import numpy as np

from infra_lab import stack
from infra_lab.grading.checks import Check, register


def _decode_case(rng: np.random.Generator) -> tuple:
    n_params = float(rng.choice([1e6, 7e9, 8.03e9, 70e9, 1.4e11]) * rng.uniform(0.5, 2))
    return n_params, int(rng.integers(1, 1025)), float(rng.choice([0.5, 1.0, 2.0, 4.0]))


def _latency_case(rng: np.random.Generator) -> tuple:
    arrival = float(rng.uniform(0, 100))
    n_tokens = 1 if rng.random() < 0.25 else int(rng.integers(2, 40))  # one-token answers too
    gaps = rng.exponential(0.03, size=n_tokens)
    gaps[0] += rng.uniform(0.05, 2.0)  # queueing plus prefill before the first token
    return arrival, [float(t) for t in arrival + np.cumsum(gaps)]


def _timeline_case(rng: np.random.Generator) -> tuple:
    start = float(rng.uniform(0, 10))
    end = start + float(rng.uniform(0.5, 5))
    intervals = []
    for _ in range(int(rng.integers(0, 30))):
        begin = float(rng.uniform(start - 1, end + 0.5))  # some stick out of the window
        intervals.append((begin, begin + float(rng.exponential(0.3))))
    return intervals, start, end


register(Check("ch00.decode_intensity", stack.decode_intensity, _decode_case))
register(Check("ch00.ttft_tpot", stack.ttft_tpot, _latency_case))
register(Check("ch00.idle_fraction", stack.idle_fraction, _timeline_case, rtol=1e-6, atol=1e-9))
