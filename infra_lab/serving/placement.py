"""DistServe's placement search (Zhong et al., OSDI 2024, Algorithm 1), within a budget (chapter 06).

The algorithm searches each phase alone: the prefill phase's goodput under the TTFT objective
for every tensor-parallel degree, the decode phase's under the TPOT objective (serving.goodput),
and then replicates each phase's instances until their rates match. A placement of n_p prefill
instances of goodput g_p and n_d decode instances of goodput g_d serves min(n_p g_p, n_d g_d)
requests per second: the slower phase sets the pace. `best_placement` finds the placement with
the most goodput per unit of cost (per GPU, or per dollar for machines of two prices) within a
budget, exactly and without trying every one: for fixed degrees and n_p, the rate per cost
n_d g_d / (c_p + n_d c_d) rises with n_d while n_d g_d < n_p g_p and min(...) / cost falls
after, so only the two whole numbers around n_p g_p / g_d can be best. `brute_force_placement`
tries every placement in the budget, and the tests hold the two equal.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from infra_lab.hardware import Device
from infra_lab.serving.goodput import Bisection, Goodput, decode_goodput, goodput, prefill_goodput
from infra_lab.serving.links import Link
from infra_lab.serving.pd_fleet import SLO, Colocated, Disaggregated, Instances, Serving, engine_config


@dataclass(frozen=True)
class PhaseGoodputs:
    """One instance's goodput (req/s) in each phase at each tensor-parallel degree, and what a GPU
    of each phase costs (1.0 each: the budget counts GPUs)."""
    prefill: dict[int, float]  # tp -> req/s of one prefill instance of tp GPUs
    decode: dict[int, float]  # tp -> req/s of one decode instance of tp GPUs
    prefill_gpu_cost: float = 1.0
    decode_gpu_cost: float = 1.0

    def __post_init__(self):
        for phase in ("prefill", "decode"):
            table = getattr(self, phase)
            if not table:
                raise ValueError(f"{phase} needs the goodput of at least one tensor-parallel degree; got none")
            bad = {tp: g for tp, g in table.items() if not (isinstance(tp, int) and tp >= 1 and g >= 0)}
            if bad:
                raise ValueError(f"{phase} maps degrees (integers >= 1) to goodputs (>= 0 req/s); got {bad}")
        if not (self.prefill_gpu_cost > 0 and self.decode_gpu_cost > 0):
            raise ValueError(f"GPU costs must be > 0; got {self.prefill_gpu_cost}, {self.decode_gpu_cost}")


@dataclass(frozen=True)
class Choice:
    prefill_count: int
    prefill_tp: int
    decode_count: int
    decode_tp: int
    rate_req_s: float  # min(n_p g_p, n_d g_d)
    cost: float  # GPUs, each weighted by its phase's cost

    @property
    def rate_per_cost(self) -> float:
        return self.rate_req_s / self.cost

    @property
    def gpus(self) -> int:
        return self.prefill_count * self.prefill_tp + self.decode_count * self.decode_tp

    def placement(self, prefill_device: Device, decode_device: Device, link: Link | None = None) -> Disaggregated:
        return Disaggregated(Instances(self.prefill_count, prefill_device, self.prefill_tp),
                             Instances(self.decode_count, decode_device, self.decode_tp), link)


def choice(table: PhaseGoodputs, prefill_count: int, prefill_tp: int, decode_count: int, decode_tp: int) -> Choice:
    """The placement's rate and cost, as Algorithm 1 composes them from the phases' goodputs."""
    rate = min(prefill_count * table.prefill[prefill_tp], decode_count * table.decode[decode_tp])
    cost = prefill_count * prefill_tp * table.prefill_gpu_cost + decode_count * decode_tp * table.decode_gpu_cost
    return Choice(prefill_count, prefill_tp, decode_count, decode_tp, rate, cost)


def _rank(c: Choice) -> tuple:
    """Most rate per cost first; then the cheaper; then the fewer, smaller instances."""
    return (c.rate_per_cost, -c.cost, -c.prefill_tp, -c.decode_tp, -c.prefill_count, -c.decode_count)


def _most_decode(table: PhaseGoodputs, budget: float, prefill_count: int, prefill_tp: int, decode_tp: int) -> int:
    left = budget - prefill_count * prefill_tp * table.prefill_gpu_cost
    return math.floor(left / (decode_tp * table.decode_gpu_cost) + 1e-9)


def _check_budget(table: PhaseGoodputs, budget: float) -> None:
    cheapest = min(table.prefill) * table.prefill_gpu_cost + min(table.decode) * table.decode_gpu_cost
    if not budget >= cheapest:
        raise ValueError(f"a budget of {budget} cannot buy one prefill and one decode instance (the cheapest pair "
                         f"costs {cheapest})")


def best_placement(table: PhaseGoodputs, budget: float) -> Choice:
    """The placement with the most goodput per cost that costs at most `budget`."""
    _check_budget(table, budget)
    best = None
    for prefill_tp, g_p in table.prefill.items():
        for decode_tp, g_d in table.decode.items():
            for prefill_count in itertools.count(1):
                most = _most_decode(table, budget, prefill_count, prefill_tp, decode_tp)
                if most < 1:
                    break
                balance = prefill_count * g_p / g_d if g_d > 0 else 1.0  # decode instances matching the prefill
                for decode_count in {min(max(math.floor(balance), 1), most), min(max(math.ceil(balance), 1), most)}:
                    candidate = choice(table, prefill_count, prefill_tp, decode_count, decode_tp)
                    if best is None or _rank(candidate) > _rank(best):
                        best = candidate
    return best


def brute_force_placement(table: PhaseGoodputs, budget: float) -> Choice:
    """best_placement by trying every placement within the budget."""
    _check_budget(table, budget)
    most = {phase: {tp: math.floor(budget / (tp * cost) + 1e-9) for tp in getattr(table, phase)}
            for phase, cost in (("prefill", table.prefill_gpu_cost), ("decode", table.decode_gpu_cost))}
    candidates = [choice(table, n_p, tp_p, n_d, tp_d)
                  for tp_p in table.prefill for tp_d in table.decode
                  for n_p in range(1, most["prefill"][tp_p] + 1) for n_d in range(1, most["decode"][tp_d] + 1)]
    return max((c for c in candidates if c.cost <= budget + 1e-9), key=_rank)


def algorithm1(table: PhaseGoodputs, rate_req_s: float) -> Choice:
    """DistServe's Algorithm 1 for a given traffic rate: each phase's degree with the most goodput
    per GPU cost, then as many instances of each as the rate needs (ceil(rate / goodput))."""
    if not rate_req_s > 0:
        raise ValueError(f"rate_req_s must be > 0 requests per second; got {rate_req_s}")
    prefill_tp = max(table.prefill, key=lambda tp: (table.prefill[tp] / tp, -tp))
    decode_tp = max(table.decode, key=lambda tp: (table.decode[tp] / tp, -tp))
    if table.prefill[prefill_tp] == 0 or table.decode[decode_tp] == 0:
        raise ValueError("a phase serves no request within its objective at any degree; no count of it meets a rate")
    return choice(table, math.ceil(rate_req_s / table.prefill[prefill_tp]), prefill_tp,
                  math.ceil(rate_req_s / table.decode[decode_tp]), decode_tp)


def fits(serving: Serving, device: Device, tp: int) -> bool:
    """Whether the model's weights leave room for KV blocks on tp GPUs of `device`."""
    try:
        engine_config(serving, device, tp)
    except ValueError:
        return False
    return True


def phase_goodputs(serving: Serving, lengths, slo: SLO, prefill_device: Device, decode_device: Device,
                   tps: tuple[int, ...] = (1, 2, 4, 8), bisection: Bisection = Bisection(),
                   prefill_gpu_cost: float = 1.0, decode_gpu_cost: float = 1.0) -> tuple[PhaseGoodputs, dict]:
    """Each phase's goodput per instance at each degree in `tps` where the model fits: the table
    best_placement searches, and the Goodput of each search (with its runs and time)."""
    searches = {"prefill": {}, "decode": {}}
    for tp in tps:
        if fits(serving, prefill_device, tp):
            searches["prefill"][tp] = prefill_goodput(Instances(1, prefill_device, tp), serving, lengths, slo.ttft_s,
                                                      bisection)
        if fits(serving, decode_device, tp):
            searches["decode"][tp] = decode_goodput(Instances(1, decode_device, tp), serving, lengths, slo.tpot_s,
                                                    bisection)
    for phase, device in (("prefill", prefill_device), ("decode", decode_device)):
        if not searches[phase]:
            raise ValueError(f"{serving.model.name} fits on no degree in {tps} of {device.name} for the {phase} phase")
    table = PhaseGoodputs({tp: g.rate_req_s for tp, g in searches["prefill"].items()},
                          {tp: g.rate_req_s for tp, g in searches["decode"].items()}, prefill_gpu_cost, decode_gpu_cost)
    return table, searches


@dataclass(frozen=True)
class Colocation:
    tp: int
    replicas: int
    goodput: Goodput  # of one replica
    rate_req_s: float  # replicas x one replica's goodput
    cost: float

    @property
    def rate_per_cost(self) -> float:
        return self.rate_req_s / self.cost


def best_colocated(serving: Serving, lengths, slo: SLO, device: Device, budget: float,
                   tps: tuple[int, ...] = (1, 2, 4, 8), bisection: Bisection = Bisection(),
                   gpu_cost: float = 1.0) -> Colocation:
    """The colocated baseline within the budget: for each degree that fits, one replica's goodput
    times the replicas the budget buys; the most goodput per cost."""
    best = None
    for tp in tps:
        replicas = math.floor(budget / (tp * gpu_cost) + 1e-9)
        if replicas < 1 or not fits(serving, device, tp):
            continue
        one = goodput(Colocated(Instances(1, device, tp)), serving, lengths, slo, bisection)
        candidate = Colocation(tp, replicas, one, replicas * one.rate_req_s, replicas * tp * gpu_cost)
        if best is None or (candidate.rate_per_cost, -candidate.cost) > (best.rate_per_cost, -best.cost):
            best = candidate
    if best is None:
        raise ValueError(f"{serving.model.name} fits on no degree in {tps} of {device.name} within a budget of "
                         f"{budget}")
    return best
