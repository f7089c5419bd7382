"""The discrete-event loop that runs a placement (serving.pd_fleet says what it simulates).

Each engine keeps its own virtual clock, and the loop always takes the earliest of: the next
arrival, the next transfer landing, the step of the busy instance whose clock is furthest behind.
An idle instance that a request reaches waits (its clock moves) to the request's time; a busy one
takes it into its next step, as a real engine takes a request that arrives during a step. A run
records every request's times (PlacementRun); it can stop early once too many requests have
missed an SLO, which is all a search for the highest rate within it needs to know.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from infra_lab.kv.paged import OutOfBlocks
from infra_lab.model.cost import kv_bytes_per_token
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.pd_fleet import (COLOCATED_POLICIES, SLO, Arrival, Colocated, Disaggregated, Instance,
                                        Instances, Serving, instances)
from infra_lab.serving.links import INSTANT, Link
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.simulator import StepTimeModel


@dataclass(frozen=True)
class PlacementRun:
    """Every request's times (seconds, arrays of shape (n,) in the arrivals' order) and the run's cost."""
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_tokens: np.ndarray
    transfer_s: np.ndarray  # prefill's end to the K and V landing, waits for the link included (0 colocated)
    steps: int  # engine steps, all instances together
    wall_s: float  # host seconds the simulation took
    complete: bool = True  # False: stopped once too many requests had missed the SLO (the rest read NaN)
    peak_live: int = 0  # the most requests arrived and not yet finished at once
    imported_blocks: np.ndarray | None = None  # (n,) KV blocks each request held on its decode instance when it
    # joined it (0: it never moved)
    blocks_in_use_after: int = 0  # KV blocks still allocated in any pool once the run ended (0 when complete)

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """Mean seconds per token after the first; 0 for a one-token request."""
        gaps = np.maximum(self.output_tokens - 1, 1)
        return np.where(self.output_tokens > 1, (self.finish_s - self.first_token_s) / gaps, 0.0)

    def met(self, slo: SLO) -> np.ndarray:
        """(n,) bool: the request met both objectives (one left unfinished did not)."""
        return (self.ttft_s <= slo.ttft_s) & (self.tpot_s <= slo.tpot_s)

    def attainment(self, slo: SLO) -> float:
        """The share of requests that met both objectives."""
        return float(self.met(slo).mean())

    @property
    def mean_latency_s(self) -> float:
        """A finished request's mean time in the fleet, arrival to last token (seconds)."""
        return float(np.nanmean(self.finish_s - self.arrival_s))

    @property
    def makespan_s(self) -> float:
        """First arrival to last finish (seconds); NaN for a run stopped early."""
        return float(self.finish_s.max() - self.arrival_s.min()) if self.complete else math.nan

    @property
    def throughput_req_s(self) -> float:
        return len(self.arrival_s) / self.makespan_s

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s > 0 else math.inf


def simulate(placement: Colocated | Disaggregated, serving: Serving, arrivals: list[Arrival],
             slo: SLO | None = None, most_missed: int | None = None) -> PlacementRun:
    """Serve `arrivals` on the placement; every request runs to its end, unless `most_missed` is
    given: then the run stops once more than that many requests have missed `slo`, when no rate
    that high can reach the target any more (a search over rates needs no more)."""
    if isinstance(placement, Colocated):
        front = instances("colocated", placement.replicas, serving, *COLOCATED_POLICIES[serving.policy])
        return _Loop(serving, front, None, None, 1).run(arrivals, slo, most_missed)
    if isinstance(placement, Disaggregated):
        lanes = min(placement.prefill.tp, placement.decode.tp)  # each GPU sends its shard over its own link
        return _Loop(serving, instances("prefill", placement.prefill, serving),
                     instances("decode", placement.decode, serving), placement.transfer_link, lanes).run(
            arrivals, slo, most_missed)
    raise TypeError(f"placement must be a pd_fleet.Colocated or pd_fleet.Disaggregated; got {type(placement).__name__}")


def simulate_prefill(prefill: Instances, serving: Serving, arrivals: list[Arrival], slo: SLO | None = None,
                     most_missed: int | None = None) -> PlacementRun:
    """The prefill phase alone: each request leaves once its first token is out (its TPOT reads 0)."""
    return _Loop(serving, instances("prefill", prefill, serving), None, None, 1).run(arrivals, slo, most_missed)


def simulate_decode(decode: Instances, serving: Serving, arrivals: list[Arrival], slo: SLO | None = None,
                    most_missed: int | None = None) -> PlacementRun:
    """The decode phase alone: each request reaches a decode instance at its arrival with its K and V
    already computed (a prefill that takes no time, a link that takes none), so its TTFT reads 0."""
    longest = max(a.prompt + a.output for a in arrivals)
    blocks = -(-(serving.token_budget + longest) // serving.block_size) + 1  # a step's prompts, and the longest
    instant = StepTimeModel(serving.model, math.inf, math.inf, serving.dtype)  # every step takes 0 s
    config = EngineConfig(policy="continuous", max_batch=serving.max_batch, token_budget=serving.token_budget,
                          num_blocks=blocks, block_size=serving.block_size)
    front = [Instance("prefill", 0, instant, config, "instant prefill")]
    return _Loop(serving, front, instances("decode", decode, serving), INSTANT, 1).run(arrivals, slo, most_missed)


class _Loop:
    def __init__(self, serving: Serving, front: list[Instance], decode: list[Instance] | None, link: Link | None,
                 lanes: int):
        self.serving, self.front, self.decode, self.link, self.lanes = serving, front, decode, link, lanes
        self.instances = front + (decode or [])
        self.kv_bytes_per_token = kv_bytes_per_token(serving.model, serving.dtype)
        self.link_free_s = [0.0] * len(front)  # when each prefill instance's outgoing link is next free
        self.landings: list[tuple] = []  # heap of (landing time, sequence, handoff)
        self.sequence = 0

    def run(self, arrivals: list[Arrival], slo: SLO | None, most_missed: int | None) -> PlacementRun:
        if not arrivals:
            raise ValueError("arrivals is empty; a run needs at least one request")
        if (slo is None) != (most_missed is None):
            raise ValueError("stopping early needs both slo and most_missed, or neither")
        started, n = time.perf_counter(), len(arrivals)
        self.arrivals, self.slo = arrivals, slo or SLO()
        self.first_s, self.finish_s = np.full(n, np.nan), np.full(n, np.nan)
        self.transfer_s, self.needs, self.missed = np.zeros(n), {}, set()
        self.imported_blocks = np.zeros(n, dtype=np.int64)
        self.live = self.peak_live = 0
        order, position = sorted(range(n), key=lambda i: arrivals[i].at_s), 0
        while most_missed is None or len(self.missed) <= most_missed:
            next_arrival = arrivals[order[position]].at_s if position < n else math.inf
            next_landing = self.landings[0][0] if self.landings else math.inf
            busy = [each for each in self.instances if each.engine.has_unfinished]
            earliest = min(busy, key=lambda each: (each.clock_s, each.index)) if busy else None
            next_step = earliest.clock_s if earliest else math.inf
            if min(next_arrival, next_landing) <= next_step:
                if next_arrival == next_landing == math.inf:
                    break
                if next_arrival <= next_landing:
                    self._arrive(order[position])
                    position += 1
                else:
                    at, _, handoff = heapq.heappop(self.landings)
                    self._land(at, handoff)
                continue
            self._step(earliest)
        unfinished = np.flatnonzero(np.isnan(self.finish_s))
        complete = most_missed is None or len(self.missed) <= most_missed
        if complete and unfinished.size:
            raise RuntimeError(f"requests {unfinished[:8].tolist()} never finished: the fleet stalled")
        return PlacementRun(np.array([a.at_s for a in arrivals]), self.first_s, self.finish_s,
                            np.array([a.output for a in arrivals]), self.transfer_s,
                            sum(each.engine.steps for each in self.instances), time.perf_counter() - started, complete,
                            self.peak_live, self.imported_blocks,
                            sum(e.engine.config.num_blocks - e.engine.blocks.pool.num_free for e in self.instances))

    def _first_token(self, rid: int, at_s: float) -> None:
        self.first_s[rid] = at_s
        if at_s - self.arrivals[rid].at_s > self.slo.ttft_s:
            self.missed.add(rid)

    def _finished(self, rid: int, at_s: float) -> None:
        self.finish_s[rid] = at_s
        self.live -= 1
        output = self.arrivals[rid].output
        if output > 1 and (at_s - self.first_s[rid]) / (output - 1) > self.slo.tpot_s:
            self.missed.add(rid)

    def _arrive(self, rid: int) -> None:
        arrival = self.arrivals[rid]
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        target = min(self.front, key=lambda each: (each.queued_tokens, each.index))
        if not target.engine.has_unfinished:
            target.engine.clock.wait_until(arrival.at_s)
        target.engine.add_request([0] * arrival.prompt, SamplingParams(max_tokens=arrival.output),
                                  arrival_s=arrival.at_s, request_id=rid)

    def _step(self, instance: Instance) -> None:
        engine, steps = instance.engine, instance.engine.steps
        outputs = engine.step()
        if engine.steps == steps:
            raise RuntimeError(f"{instance.label} has work but could not run a step")
        for out in outputs:
            rid = out.request_id
            request = engine.requests[rid]
            if instance.role == "prefill":
                self._prefilled(instance, rid, request)
            elif out.finished:
                if instance.role == "colocated":
                    self._first_token(rid, request.token_times_s[0])
                self._finished(rid, request.finish_s)
                engine.forget(rid)
                if instance.role == "decode":
                    instance.reserved_blocks -= self.needs[rid]
                    instance.promised_blocks -= self.needs[rid]
        if instance.role == "decode":
            self._take_in(instance)

    def _prefilled(self, instance: Instance, rid: int, request) -> None:
        """A prompt is computed and its first token out: send the request on, or end it here."""
        engine, now = instance.engine, instance.clock_s
        self._first_token(rid, request.token_times_s[0])
        if request.is_done or self.decode is None:  # a one-token request; or the prefill phase alone
            if not request.is_done:
                engine.abort(rid)
            self._finished(rid, self.first_s[rid])
            engine.forget(rid)
            return
        state, kv = engine.export_request(rid)
        engine.forget(rid)
        target = min(self.decode, key=lambda each: (each.promised_blocks, each.index))
        arrival = self.arrivals[rid]
        need = -(-(arrival.prompt + arrival.output) // self.serving.block_size)
        capacity = target.engine.config.num_blocks
        if need > capacity:
            raise ValueError(f"request {rid} ({arrival.prompt} + {arrival.output} tokens) needs {need} KV blocks; "
                             f"{target.label} holds {capacity}")
        self.needs[rid] = need
        target.promised_blocks += need
        start = max(now, self.link_free_s[instance.index])
        landing = start + self.link.seconds(self.kv_bytes_per_token * len(kv.tokens), self.lanes)
        self.link_free_s[instance.index] = landing
        self.transfer_s[rid] = landing - now
        self.sequence += 1
        heapq.heappush(self.landings, (landing, self.sequence, (rid, state, kv, target)))

    def _land(self, at: float, handoff: tuple) -> None:
        target = handoff[-1]
        if not target.engine.has_unfinished:
            target.engine.clock.wait_until(at)
        target.awaiting.append(handoff)
        self._take_in(target)

    def _take_in(self, instance: Instance) -> None:
        """Import landed requests, first come first served, while the pool and the batch have room."""
        engine = instance.engine
        while instance.awaiting:
            rid, state, kv, _ = instance.awaiting[0]
            need = self.needs[rid]
            if (instance.reserved_blocks + need > engine.config.num_blocks
                    or len(engine.scheduler.running) >= engine.config.max_batch):
                return
            try:
                engine.import_request(state, kv, request_id=rid)
            except OutOfBlocks:
                return
            self.imported_blocks[rid] = len(engine.blocks.pool.tables[engine.requests[rid].seq])
            instance.awaiting.popleft()
            instance.reserved_blocks += need
