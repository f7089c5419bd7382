"""Goodput: the highest request rate a placement serves within its SLOs (chapter 06).

Zhong et al. ("DistServe", OSDI 2024) define it per GPU: the most requests per second, arriving
as a Poisson stream, at which a target share (90%) of them meets both the TTFT and the TPOT
objective, divided by the GPUs used. It is found here by bisection on the rate, each rate a run of
the simulated fleet (serving.pd_fleet_loop) on `n` requests. One seed gives the same requests at
every rate, compressed in time, so attainment falls as the rate rises, up to the noise of a
finite run: near the edge it is not quite monotone, and a goodput from one seed moves by a few
percent with the seed (`Bisection.seeds` averages several). A finite run also flatters a rate
near capacity, where a queue takes long to build: the fewer the requests, the higher the goodput
found; a run whose arrivals span under STEADY_LIFETIMES request lifetimes is redone with more.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from infra_lab.hardware import Device
from infra_lab.serving.pd_fleet import SLO, Colocated, Disaggregated, Instances, Serving, poisson, step_time_model
from infra_lab.serving.pd_fleet_loop import PlacementRun, simulate, simulate_decode, simulate_prefill

TARGET = 0.9  # DistServe's attainment target: 90% of requests within both objectives
STEADY_LIFETIMES = 2  # a run's arrivals must span this many of its requests' mean time in the fleet
MOST_REQUESTS_FACTOR = 32  # how far a search may grow its requests per run to reach that


@dataclass(frozen=True)
class Bisection:
    """How a goodput is searched for: `n` requests per simulated rate; one search per seed, their
    rates averaged; each search doubles or halves from a guess to bracket the target, then bisects
    the log of the rate until the bracket is within `rel_tol`, or `max_runs` runs are spent."""
    n: int = 200
    seeds: tuple[int, ...] = (0,)
    target: float = TARGET
    rel_tol: float = 0.03
    max_runs: int = 14

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 requests; got {self.n!r}")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be a share in (0, 1]; got {self.target}")
        if not self.rel_tol > 0:
            raise ValueError(f"rel_tol must be > 0; got {self.rel_tol}")
        if self.max_runs < 2:
            raise ValueError(f"max_runs must be >= 2 (one to bracket each way); got {self.max_runs}")



def most_missed(bisection: Bisection, n: int) -> int:
    """Requests of `n` that may miss the SLO in a run that still meets the target."""
    return int((1 - bisection.target) * n + 1e-9)


@dataclass(frozen=True)
class RateSearch:
    rate_req_s: float  # the highest rate tried that met the target (0.0 if none did)
    runs: tuple[tuple[float, float], ...]  # (rate, attainment) of every run, in order


def max_rate(attainment_at: Callable[[float], float], guess: float, target: float = TARGET,
             rel_tol: float = 0.03, max_runs: int = 14, min_rate: float = 1e-3) -> RateSearch:
    """The highest rate (req/s) whose attainment, `attainment_at(rate)`, reaches `target`: double
    (or halve) from `guess` until the target is bracketed, then bisect the log of the rate."""
    if not guess > 0:
        raise ValueError(f"guess must be > 0 requests per second; got {guess}")
    runs = []

    def meets(rate: float) -> bool:
        runs.append((rate, attainment_at(rate)))
        return runs[-1][1] >= target

    low, high = (guess, None) if meets(guess) else (None, guess)
    while (low is None or high is None) and len(runs) < max_runs:
        if low is not None:  # it passes: go up
            low, high = (low * 2, None) if meets(low * 2) else (low, low * 2)
        elif high / 2 < min_rate:
            return RateSearch(0.0, tuple(runs))
        else:
            low, high = (high / 2, high) if meets(high / 2) else (None, high / 2)
    while low is not None and high is not None and high / low > 1 + rel_tol and len(runs) < max_runs:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return RateSearch(low or 0.0, tuple(runs))


@dataclass(frozen=True)
class Goodput:
    rate_req_s: float  # the mean over seeds of the highest rate meeting the target
    gpus: int
    per_seed: tuple[float, ...]
    searches: tuple[RateSearch, ...] = field(repr=False)
    steps: int = 0  # engine steps simulated, every run together
    sim_s: float = 0.0  # host seconds the runs took

    @property
    def per_gpu(self) -> float:
        return self.rate_req_s / self.gpus

    @property
    def spread(self) -> float:
        """(max - min) / mean of the seeds' rates: how much the goodput moves with the seed."""
        return (max(self.per_seed) - min(self.per_seed)) / self.rate_req_s if self.rate_req_s > 0 else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.sim_s if self.sim_s > 0 else math.inf


def search_goodput(run_at: Callable[[float, int, int], PlacementRun], slo: SLO, gpus: int, guess: float,
                   bisection: Bisection) -> Goodput:
    """The goodput of whatever `run_at(rate, seed, n)` simulates, judged by `slo`. A run that meets
    the target although its requests arrived within less than STEADY_LIFETIMES of their mean time
    in the fleet measured mostly the fleet filling up, not a steady state (with few requests any
    rate passes: they all fit in one batch): the search starts again with twice the requests, up
    to MOST_REQUESTS_FACTOR x bisection.n."""
    totals = {"steps": 0, "sim_s": 0.0}
    searches = []
    for seed in bisection.seeds:
        n = bisection.n
        while True:
            unsaturated = []

            def attainment_at(rate: float) -> float:
                run = run_at(rate, seed, n)
                totals["steps"] += run.steps
                totals["sim_s"] += run.wall_s
                attainment = run.attainment(slo)
                if attainment >= bisection.target and n / rate < STEADY_LIFETIMES * run.mean_latency_s:
                    unsaturated.append(rate)
                return attainment

            search = max_rate(attainment_at, guess, bisection.target, bisection.rel_tol, bisection.max_runs)
            if not unsaturated:
                break
            if n >= MOST_REQUESTS_FACTOR * bisection.n:
                raise ValueError(f"{n} requests arrive faster than {STEADY_LIFETIMES} of their lifetimes at "
                                 f"{max(unsaturated):.3g} req/s, still passing: raise Bisection.n")
            n *= 2
        searches.append(search)
    rates = tuple(s.rate_req_s for s in searches)
    return Goodput(float(np.mean(rates)), gpus, rates, tuple(searches), totals["steps"], totals["sim_s"])


def capacity_guess(serving: Serving, device: Device, tp: int, lengths, count: int = 1, phase: str = "both") -> float:
    """A rough rate (req/s) `count` instances serve, from the step-time model: one prompt
    prefilled alone, the output decoded in a batch of 32 at the mean context. The search starts
    at half of it; it is nothing more than a starting point."""
    prompt, output = (float(np.mean(x)) for x in zip(*lengths(64, 0)))
    model = step_time_model(serving, device, tp)
    prefill_s = model.seconds([(0, max(1, round(prompt)))])
    decode_s = (output - 1) * model.seconds([(round(prompt + output / 2), 1)] * 32) / 32
    busy_s = {"both": prefill_s + decode_s, "prefill": prefill_s, "decode": decode_s}[phase]
    return count / max(busy_s, 1e-6)


def goodput(placement: Colocated | Disaggregated, serving: Serving, lengths, slo: SLO,
            bisection: Bisection = Bisection(), guess_req_s: float | None = None) -> Goodput:
    """The placement's goodput: the highest Poisson rate (req/s) of `bisection.n` requests with
    `lengths` at which the target share of them meets both objectives of `slo`. The search starts
    at `guess_req_s` (default: half of capacity_guess); a good guess only saves runs."""
    if isinstance(placement, Colocated):
        group = placement.replicas
        capacity = capacity_guess(serving, group.device, group.tp, lengths, group.count)
    elif isinstance(placement, Disaggregated):
        prefill, decode = placement.prefill, placement.decode
        capacity = min(capacity_guess(serving, prefill.device, prefill.tp, lengths, prefill.count, "prefill"),
                       capacity_guess(serving, decode.device, decode.tp, lengths, decode.count, "decode"))
    else:
        raise TypeError(f"placement must be a pd_fleet.Colocated or pd_fleet.Disaggregated; got "
                        f"{type(placement).__name__}")
    return search_goodput(
        lambda rate, seed, n: simulate(placement, serving, poisson(rate, n, lengths, seed), slo,
                                       most_missed(bisection, n)), slo, placement.gpus, guess_req_s or capacity / 2,
        bisection)


def prefill_goodput(instances: Instances, serving: Serving, lengths, ttft_s: float,
                    bisection: Bisection = Bisection(), guess_req_s: float | None = None) -> Goodput:
    """The prefill phase alone: the highest rate at which the target share of requests gets its
    first token within `ttft_s` seconds."""
    slo = SLO(ttft_s=ttft_s)
    start = guess_req_s or capacity_guess(serving, instances.device, instances.tp, lengths, instances.count,
                                          "prefill") / 2
    return search_goodput(
        lambda rate, seed, n: simulate_prefill(instances, serving, poisson(rate, n, lengths, seed), slo,
                                               most_missed(bisection, n)), slo, instances.gpus, start, bisection)


def decode_goodput(instances: Instances, serving: Serving, lengths, tpot_s: float,
                   bisection: Bisection = Bisection(), guess_req_s: float | None = None) -> Goodput:
    """The decode phase alone (its requests arrive with their K and V): the highest rate at which
    the target share of requests keeps its mean time per output token within `tpot_s` seconds."""
    slo = SLO(tpot_s=tpot_s)
    start = guess_req_s or capacity_guess(serving, instances.device, instances.tp, lengths, instances.count,
                                          "decode") / 2
    return search_goodput(
        lambda rate, seed, n: simulate_decode(instances, serving, poisson(rate, n, lengths, seed), slo,
                                              most_missed(bisection, n)), slo, instances.gpus, start, bisection)


def tightest_slo_scale(placement: Colocated | Disaggregated, serving: Serving, lengths, slo: SLO, rate_req_s: float,
                       bisection: Bisection = Bisection()) -> float:
    """DistServe's other measure: at a fixed rate (req/s), the smallest factor by which both
    objectives of `slo` can be scaled with the target share of requests still within them (the
    mean over seeds), found as the highest 'tightness' 1 / scale that meets the target. The runs
    hold enough requests for their arrivals to span STEADY_LIFETIMES of a request's mean time in
    the fleet (measured by a first run), up to MOST_REQUESTS_FACTOR x bisection.n."""
    if not rate_req_s > 0:
        raise ValueError(f"rate_req_s must be > 0 requests per second; got {rate_req_s}")
    scales = []
    for seed in bisection.seeds:
        first = simulate(placement, serving, poisson(rate_req_s, bisection.n, lengths, seed))
        n = min(max(bisection.n, math.ceil(STEADY_LIFETIMES * rate_req_s * first.mean_latency_s)),
                MOST_REQUESTS_FACTOR * bisection.n)
        arrivals = poisson(rate_req_s, n, lengths, seed)

        def attainment_at(tightness: float) -> float:
            scaled = slo.scaled(1 / tightness)
            run = simulate(placement, serving, arrivals, scaled, most_missed(bisection, n))
            return run.attainment(scaled)

        search = max_rate(attainment_at, 1.0, bisection.target, bisection.rel_tol, bisection.max_runs)
        scales.append(1 / search.rate_req_s if search.rate_req_s > 0 else math.inf)
    return float(np.mean(scales))
