"""A fleet of simulated replicas behind a load balancer, grown and shrunk by an autoscaler, on a
bursty trace (chapter 06): what SLO attainment each autoscaler buys for its replica-seconds.

Each replica is chapter 05's engine on its own virtual clock (serving.simulator: the real
scheduler, steps timed by the roofline). A discrete-event loop advances them together in
simulated time: between two events (an arrival, an autoscaler tick) every busy replica steps until
its clock passes the event. The load balancer sends each arrival to the ready replica with the
fewest requests outstanding. A replica the autoscaler adds is paid for from the moment it is asked
for, but takes traffic only after its cold start (weights loaded, engine warmed up); one it
removes is drained: no new requests, it finishes those it has, then stops. A removal cancels a
replica still starting before it drains a ready one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from infra_lab.model.config import ModelConfig
from infra_lab.model.cost import bytes_per_element
from infra_lab.progress import bar
from infra_lab.serving.autoscaling import Autoscaler, Snapshot
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.simulator import StepTimeModel, simulated_engine
from infra_lab.serving.traffic import TimedRequest

# A cold start is the weights' bytes over a load bandwidth, plus the engine's warm-up.
WEIGHT_LOAD_BYTES_PER_S = 2e9  # assumption: a fresh node reading safetensors from a network volume or
# NVMe; a hot page cache is faster (vllm#19824: Llama-70B in FP8, about 70 GB, in about 10 s)
WARMUP_S = 39.34  # vllm PR #11005 (Dec 2024), `vllm serve meta-llama/Meta-Llama-3-8B -O3` on one GPU: "init
# engine (profile, create kv cache, warmup model) took 39.34 seconds" (torch.compile 19.37 s, CUDA graph
# capture 15 s; 14.18 s without torch.compile). Pulling the container image and scheduling the pod are not counted.


def cold_start_s(config: ModelConfig, dtype: str = "bf16", load_bytes_per_s: float = WEIGHT_LOAD_BYTES_PER_S,
                 warmup_s: float = WARMUP_S) -> float:
    """Seconds from asking for a replica to its first request: its weights (config.total_params
    elements of `dtype`) over `load_bytes_per_s`, then `warmup_s`."""
    if not load_bytes_per_s > 0 or not warmup_s >= 0:
        raise ValueError(f"need load_bytes_per_s > 0 and warmup_s >= 0; got {load_bytes_per_s}, {warmup_s}")
    return config.total_params * bytes_per_element(dtype) / load_bytes_per_s + warmup_s


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and its mean gap between tokens are within these.
    TTFT 1 s: an answer that starts within a second keeps a user's flow of thought (Nielsen,
    Usability Engineering, 1993: the 1 s limit). TPOT 50 ms: 20 tokens/s, well above reading
    speed, and a bound that a step with a 2,048-token prefill chunk of LLaMA-3-8B on an H100
    (about 35 ms on the roofline) stays under."""
    ttft_s: float = 1.0
    tpot_s: float = 0.05
    goal: float = 0.95  # share of requests that must meet it

    def __post_init__(self):
        if not (0 < self.ttft_s < math.inf and 0 < self.tpot_s < math.inf and 0 < self.goal <= 1):
            raise ValueError(f"need ttft_s > 0, tpot_s > 0 (finite) and goal in (0, 1]; got {self}")


# ---- the run's record -------------------------------------------------------------------------------


@dataclass
class ReplicaRecord:
    index: int
    asked_s: float  # paid for from here
    ready_s: float  # asked_s + the cold start: takes traffic from here
    drain_s: float | None = None  # told to take no more requests
    stop_s: float | None = None  # stopped (drained, cancelled while starting, or the run ended)
    served: int = 0  # requests sent to it

    @property
    def seconds(self) -> float:
        return self.stop_s - self.asked_s


@dataclass(frozen=True)
class Tick:
    """The fleet at one autoscaler decision: its replicas once the decision is carried out, and
    the gauges the decision saw."""
    time_s: float
    ready: int
    starting: int
    draining: int
    waiting: int  # requests waiting on the ready replicas, summed
    running: int
    kv_use: float  # mean share of KV blocks in use over the ready replicas
    asked: int  # replicas ready or starting
    arrivals: int  # requests that arrived since the previous tick


@dataclass
class FleetRun:
    """One replay: every request's latencies, every replica's life, every tick."""
    policy: str
    slo: Slo
    arrival_s: np.ndarray  # (n,) seconds
    replica: np.ndarray  # (n,) the replica each request went to
    ttft_s: np.ndarray  # (n,)
    tpot_s: np.ndarray  # (n,) mean gap between its tokens; 0 for a one-token request
    finish_s: np.ndarray  # (n,) when its last token came
    tokens: np.ndarray  # (n,) output tokens it got
    replicas: list[ReplicaRecord]
    ticks: list[Tick]
    actions: list[tuple[float, int]]  # (time_s, replicas added (> 0) or removed (< 0))
    steps: int  # engine steps, all replicas together
    wall_s: float  # seconds this replay took on this machine
    end_s: float  # when the last request finished

    @property
    def met(self) -> np.ndarray:
        return (self.ttft_s <= self.slo.ttft_s) & (self.tpot_s <= self.slo.tpot_s)

    @property
    def attainment(self) -> float:
        return float(self.met.mean())

    @property
    def replica_seconds(self) -> float:
        return float(sum(r.seconds for r in self.replicas))

    @property
    def cold_start_seconds(self) -> float:
        """Replica-seconds paid for replicas not yet ready (cold starts, and cancelled starts)."""
        return float(sum(min(r.ready_s, r.stop_s) - r.asked_s for r in self.replicas))

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    def series(self, window_s: float) -> dict[str, np.ndarray]:
        """Per window of `window_s` seconds (from 0): arrival rate (requests/s), SLO attainment of
        the requests that arrived in it (NaN if none), and at the tick that ends it the replicas
        ready, starting and draining and the requests waiting, for a figure."""
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0; got {window_s}")
        edges = np.arange(0.0, self.end_s + window_s, window_s)
        which = np.minimum(np.searchsorted(edges, self.arrival_s, side="right") - 1, len(edges) - 2)
        counts = np.bincount(which, minlength=len(edges) - 1)
        met = np.bincount(which, weights=self.met, minlength=len(edges) - 1)
        tick_times = np.array([t.time_s for t in self.ticks])
        at = np.clip(np.searchsorted(tick_times, edges[1:], side="right") - 1, 0, len(self.ticks) - 1)
        column = lambda name: np.array([getattr(self.ticks[i], name) for i in at])  # noqa: E731
        with np.errstate(invalid="ignore", divide="ignore"):
            attainment = met / counts
        return {"time_s": edges[1:], "rate_per_s": counts / window_s, "attainment": attainment,
                "ready": column("ready"), "starting": column("starting"), "draining": column("draining"),
                "waiting": column("waiting")}


# ---- the replay ---------------------------------------------------------------------------------------


class _Replica:
    """A simulated engine with the fleet's bookkeeping: what it was sent, what finished, when."""

    def __init__(self, record: ReplicaRecord, time_model: StepTimeModel, config: EngineConfig):
        self.record, self.engine = record, simulated_engine(time_model, config)
        self.engine.clock.wait_until(record.ready_s)
        self.sent = self.finished = 0
        self.last_end_s, self.last_finished = 0.0, 0  # the last step's end and the requests it finished
        self.awaiting_first: set[int] = set()  # requests sent here without a token yet

    def outstanding(self, t_s: float) -> int:
        """Requests sent here and not finished by `t_s` (the step in flight finishes after it)."""
        return self.sent - self.finished + (self.last_finished if self.last_end_s > t_s else 0)

    @property
    def busy(self) -> bool:
        return self.engine.scheduler.has_work

    def run_until(self, t_s: float, fleet: _Fleet) -> None:
        """Step while there is work and the clock is before `t_s`; a step that starts before t_s
        ends after it, as a GPU step would."""
        engine = self.engine
        while engine.scheduler.has_work and engine.clock() < t_s:
            before = engine.steps
            outputs = engine.step()
            if engine.steps == before:  # nothing could run; an arrival will unblock it
                break
            end, finished = engine.clock(), []
            for out in outputs:
                rid = out.request_id
                if rid in self.awaiting_first:
                    self.awaiting_first.discard(rid)
                    fleet.first_token(rid, end)
                if out.finished:
                    finished.append(rid)
            for rid in finished:
                fleet.finish(rid, engine.requests[rid])
                engine.forget(rid)
            self.finished += len(finished)
            self.last_end_s, self.last_finished = end, len(finished)
        engine.log.clear()  # the fleet keeps its own record; a long replay would fill memory with steps

    def gauges(self) -> tuple[int, int, float]:
        """(waiting, running, share of KV blocks in use), as vLLM's gauges report them."""
        scheduler, pool = self.engine.scheduler, self.engine.blocks.pool
        return len(scheduler.waiting), len(scheduler.running), 1 - pool.num_free / self.engine.config.num_blocks


@dataclass
class _Fleet:
    trace: list[TimedRequest]
    autoscaler: Autoscaler
    time_model: StepTimeModel
    config: EngineConfig
    cold_start_s: float
    replicas: list[_Replica] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # since the last tick

    def __post_init__(self):
        n = len(self.trace)
        self.arrival_s = np.array([r.arrival_s for r in self.trace])
        self.replica = np.full(n, -1)
        self.ttft_s, self.tpot_s, self.finish_s = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
        self.tokens = np.zeros(n, np.int64)

    def add(self, now_s: float, warm: bool = False) -> None:
        ready = now_s if warm else now_s + self.cold_start_s
        record = ReplicaRecord(len(self.replicas), now_s, ready)
        self.replicas.append(_Replica(record, self.time_model, self.config))

    def first_token(self, rid: int, t_s: float) -> None:
        self.ttft_s[rid] = t_s - self.arrival_s[rid]
        self.ttfts.append(self.ttft_s[rid])

    def finish(self, rid: int, request) -> None:
        times = request.token_times_s
        self.tokens[rid], self.finish_s[rid] = len(times), times[-1]
        self.tpot_s[rid] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0

    def live(self, now_s: float) -> tuple[list[_Replica], list[_Replica], list[_Replica]]:
        """(ready, starting, draining) replicas at `now_s`."""
        ready, starting, draining = [], [], []
        for r in self.replicas:
            rec = r.record
            if rec.stop_s is not None and rec.stop_s <= now_s:
                continue
            (draining if rec.drain_s is not None else ready if rec.ready_s <= now_s else starting).append(r)
        return ready, starting, draining

    def dispatch(self, rid: int, now_s: float) -> None:
        ready, _, _ = self.live(now_s)
        if not ready:
            raise RuntimeError(f"no ready replica at {now_s:.3f} s for request {rid}")
        target = min(ready, key=lambda r: r.outstanding(now_s))  # least outstanding; ties: the oldest
        timed = self.trace[rid]
        target.engine.clock.wait_until(now_s)
        target.engine.add_request(timed.prompt, SamplingParams(max_tokens=timed.max_tokens), arrival_s=now_s,
                                  request_id=rid)
        target.sent += 1
        target.record.served += 1
        target.awaiting_first.add(rid)
        self.replica[rid] = target.record.index

    def stop_drained(self) -> None:
        for r in self.replicas:
            rec = r.record
            if rec.drain_s is not None and rec.stop_s is None and not r.busy:
                rec.stop_s = max(rec.drain_s, r.engine.clock())

    def tick(self, now_s: float, arrivals: int) -> tuple[Tick, int]:
        ready, starting, draining = self.live(now_s)
        gauges = [r.gauges() for r in ready]
        waiting, running = sum(g[0] for g in gauges), sum(g[1] for g in gauges)
        kv_use = float(np.mean([g[2] for g in gauges])) if gauges else 0.0
        snapshot = Snapshot(now_s, len(ready), len(starting), waiting, running, min(kv_use, 1.0), tuple(self.ttfts),
                            arrivals / self.autoscaler.limits.interval_s)
        self.ttfts = []
        change = self.autoscaler.decide(snapshot) - snapshot.requested
        for _ in range(change):
            self.add(now_s)
        for _ in range(-change):
            if starting:  # cancel the newest replica still starting: it serves nobody yet
                starting.pop().record.stop_s = now_s
            else:  # drain the ready replica with the least outstanding
                victim = min(ready, key=lambda r: r.outstanding(now_s))
                ready.remove(victim)
                victim.record.drain_s = now_s
        self.stop_drained()
        ready, starting, draining = self.live(now_s)  # after the action
        return Tick(now_s, len(ready), len(starting), len(draining), waiting, running, kv_use,
                    len(ready) + len(starting), arrivals), change


def replay(trace: list[TimedRequest], autoscaler: Autoscaler, time_model: StepTimeModel, config: EngineConfig,
           cold_start_s: float, slo: Slo = Slo(), progress: bool = False) -> FleetRun:
    """Serve `trace` (arrival order) on a fleet that starts with autoscaler.initial warm replicas
    and asks the autoscaler every autoscaler.limits.interval_s seconds, from one interval after 0
    until the last request finishes. Each replica is simulated_engine(time_model, config); a new
    one takes `cold_start_s` to get ready. Returns the run's record (FleetRun)."""
    if not trace:
        raise ValueError("the trace is empty; a replay needs at least one request")
    if not 0 <= cold_start_s < math.inf:
        raise ValueError(f"cold_start_s must be finite and >= 0; got {cold_start_s}")
    if any(b.arrival_s < a.arrival_s for a, b in zip(trace, trace[1:])):
        raise ValueError("the trace must be in arrival order")
    started = time.perf_counter()
    fleet = _Fleet(trace, autoscaler, time_model, config, cold_start_s)
    for _ in range(autoscaler.initial):
        fleet.add(0.0, warm=True)
    interval, ticks_done, position, since_tick = autoscaler.limits.interval_s, 0, 0, 0
    ticks, actions = [], []
    shown = bar(total=len(trace), show=progress, desc=f"replay ({autoscaler.name})", unit="req")
    while True:
        next_tick = (ticks_done + 1) * interval
        upcoming = trace[position].arrival_s if position < len(trace) else math.inf
        for r in fleet.replicas:
            if r.record.stop_s is None and r.busy:
                r.run_until(min(upcoming, next_tick), fleet)
        fleet.stop_drained()
        if position == len(trace):
            busy = [r for r in fleet.replicas if r.record.stop_s is None and r.busy]
            if not busy:
                break
            stuck = [r.record.index for r in busy if r.engine.clock() < next_tick]  # run_until stopped short
            if stuck:
                raise RuntimeError(f"replicas {stuck} hold requests that cannot run, and nothing more will arrive")
        if next_tick <= upcoming:
            record, change = fleet.tick(next_tick, since_tick)
            ticks.append(record)
            if change:
                actions.append((next_tick, change))
            ticks_done, since_tick = ticks_done + 1, 0
        else:
            fleet.dispatch(position, upcoming)
            position, since_tick = position + 1, since_tick + 1
            shown.update(1)
    shown.close()
    end = float(np.max(fleet.finish_s))
    for r in fleet.replicas:
        if r.record.stop_s is None:
            r.record.stop_s = max(end, r.record.asked_s)
    return FleetRun(autoscaler.name, slo, fleet.arrival_s, fleet.replica, fleet.ttft_s, fleet.tpot_s, fleet.finish_s,
                    fleet.tokens,
                    [r.record for r in fleet.replicas], ticks, actions, sum(r.engine.steps for r in fleet.replicas),
                    time.perf_counter() - started, end)
