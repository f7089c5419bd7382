"""Autoscalers for a fleet of LLM serving replicas (chapter 06): each turns a snapshot of the
fleet's signals into the number of replicas it wants, within production limits.

The signals are those LLM serving systems scale on: requests waiting per replica (KEDA on vLLM's
`vllm:num_requests_waiting`), requests in flight per replica (Knative's concurrency), KV-cache
use (`vllm:kv_cache_usage_perc`, which Dynamo's load planner watches), requests arriving per
second per replica (Knative's rps), and the p90 TTFT of a window against its SLO. The limits are
production ones: min and max replicas, and a decision interval with at most one scaling action,
of at most `max_step` replicas, per interval (Dynamo's planner changes the worker count by one
per adjustment interval). `TargetTracking` is the rule of Kubernetes' HPA, which KEDA drives;
`KPA` is Knative's Pod Autoscaler, with its stable and panic windows, which AIBrix reuses;
`Forecast` plans one cold start ahead on a fitted trend, as Dynamo's SLA planner forecasts load. A
decision reads only a plain `Snapshot`, so the same object drives the simulated fleet
(serving.autoscaling_replay) or a controller of real processes.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

SIGNALS = ("waiting", "concurrency", "kv", "rate")  # per-replica load signals (see per_replica)


@dataclass(frozen=True)
class Snapshot:
    """What the fleet looks like at `time_s`, as a metrics scrape sees it."""
    time_s: float
    ready: int  # replicas taking traffic
    starting: int  # replicas asked for that are still loading weights and warming up
    waiting: int = 0  # requests queued on the ready replicas, summed (vllm:num_requests_waiting)
    running: int = 0  # requests in their running batches, summed (vllm:num_requests_running)
    kv_use: float = 0.0  # share of KV blocks in use, mean over ready replicas (vllm:kv_cache_usage_perc)
    ttfts_s: tuple[float, ...] = ()  # TTFT of each request whose first token came since the last snapshot
    arrivals_per_s: float = 0.0  # requests/s the fleet received since the last snapshot (a router's counter)

    def __post_init__(self):
        for name in ("ready", "starting", "waiting", "running"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0; got {value!r}")
        if not 0.0 <= self.kv_use <= 1.0:
            raise ValueError(f"kv_use is a share of the KV blocks, in [0, 1]; got {self.kv_use}")
        if not 0.0 <= self.arrivals_per_s < math.inf:
            raise ValueError(f"arrivals_per_s must be finite and >= 0; got {self.arrivals_per_s}")

    @property
    def requested(self) -> int:
        """Replicas asked for: ready or starting (draining ones are on their way out)."""
        return self.ready + self.starting


def check_signal(signal: str) -> None:
    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}; signals are {', '.join(map(repr, SIGNALS))}")


def per_replica(signal: str, snapshot: Snapshot) -> float:
    """The signal's value per ready replica: waiting requests, requests in flight (waiting and
    running), the share of KV blocks in use (already a mean over replicas), or requests arriving
    per second (Knative's rps metric; the rate Dynamo's throughput planner plans for)."""
    check_signal(signal)
    ready = max(snapshot.ready, 1)
    if signal == "waiting":
        return snapshot.waiting / ready
    if signal == "concurrency":
        return (snapshot.waiting + snapshot.running) / ready
    if signal == "rate":
        return snapshot.arrivals_per_s / ready
    return snapshot.kv_use


def _whole(name: str, value, least: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}; got {value!r}")


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not 0 < value < math.inf:  # also refuses NaN
            raise ValueError(f"{name} must be a finite number > 0; got {value!r}")


@dataclass(frozen=True)
class Limits:
    min_replicas: int = 1
    max_replicas: int = 16
    interval_s: float = 5.0  # seconds between decisions; at most one scaling action each
    max_step: int = 1  # replicas one action adds or removes (Dynamo's planner: 1)

    def __post_init__(self):
        _whole("min_replicas", self.min_replicas, 1)
        _whole("max_replicas", self.max_replicas, 1)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is more than max_replicas {self.max_replicas}")
        _positive(interval_s=self.interval_s)
        _whole("max_step", self.max_step, 1)

    def clamp(self, current: int, wanted: int) -> int:
        """The count one action may reach from `current`: at most max_step away, in [min, max]."""
        step = max(-self.max_step, min(self.max_step, wanted - current))
        return max(self.min_replicas, min(self.max_replicas, current + step))


class Autoscaler:
    """Turns a Snapshot into the replica count it asks for: call `decide` every limits.interval_s
    seconds. Subclasses say what they want (`want`); `decide` holds it to the limits."""
    name = "autoscaler"

    def __init__(self, limits: Limits):
        if not isinstance(limits, Limits):
            raise ValueError(f"limits must be a Limits; got {type(limits).__name__}")
        self.limits = limits

    @property
    def initial(self) -> int:
        """Replicas the fleet starts with, warm."""
        return self.limits.min_replicas

    def decide(self, snapshot: Snapshot) -> int:
        """The replicas to ask for: within [min, max] and at most max_step from snapshot.requested."""
        return self.limits.clamp(snapshot.requested, self.want(snapshot))

    def want(self, snapshot: Snapshot) -> int:
        raise NotImplementedError


class Static(Autoscaler):
    """A fixed fleet: provisioning for the peak, or for the mean."""

    def __init__(self, replicas: int, interval_s: float = 5.0, name: str = "static"):
        _whole("replicas", replicas, 1)
        super().__init__(Limits(replicas, replicas, interval_s, replicas))
        self.name = name

    def want(self, snapshot: Snapshot) -> int:
        return self.limits.min_replicas


class TargetTracking(Autoscaler):
    """Kubernetes' HPA rule, as KEDA drives it from a Prometheus query: the signal's per-replica
    value over `target` times the ready replicas, rounded up (KEDA's AverageValue target on
    sum(vllm:num_requests_waiting) is ceil(total / target)); no change within `tolerance` of the
    target (HPA's default 0.1); a scale-down only to the largest count wanted over the last
    `stabilization_s` (HPA's behavior.scaleDown.stabilizationWindowSeconds, default 300 s). `spare`
    replicas are asked for beyond the count (ours, not HPA's: headroom for the cold start)."""

    def __init__(self, signal: str, target: float, limits: Limits, stabilization_s: float = 300.0,
                 tolerance: float = 0.1, spare: int = 0):
        check_signal(signal)
        _positive(target=target)
        if not 0 <= stabilization_s < math.inf or not 0 <= tolerance < 1:
            raise ValueError(f"need stabilization_s >= 0 and tolerance in [0, 1); got {stabilization_s}, {tolerance}")
        _whole("spare", spare, 0)
        super().__init__(limits)
        self.signal, self.target, self.stabilization_s, self.tolerance = signal, target, stabilization_s, tolerance
        self.spare = spare
        self.name = f"hpa-{signal}" + (f"+{spare}" if spare else "")
        self.recent: deque[tuple[float, int]] = deque()  # (time_s, replicas wanted) within the window

    @property
    def initial(self) -> int:
        return min(self.limits.max_replicas, self.limits.min_replicas + self.spare)

    def want(self, snapshot: Snapshot) -> int:
        ratio = per_replica(self.signal, snapshot) / self.target
        ready = max(snapshot.ready, 1)
        in_band = abs(ratio - 1) <= self.tolerance and snapshot.ready > 0
        wanted = snapshot.requested if in_band else math.ceil(ready * ratio) + self.spare
        self.recent.append((snapshot.time_s, wanted))
        while self.recent[0][0] < snapshot.time_s - self.stabilization_s:
            self.recent.popleft()
        if wanted >= snapshot.requested:
            return wanted
        return min(snapshot.requested, max(w for _, w in self.recent))


class KPA(Autoscaler):
    """Knative's Pod Autoscaler (AIBrix's KPA): the signal's fleet total averaged over a stable
    window (Knative's default 60 s) and a panic window (10% of it, 6 s), each over `target` per
    replica, rounded up. When the panic estimate reaches `panic_threshold` (Knative's 200%) times
    the ready replicas the autoscaler panics: it never scales down, and asks for the largest panic
    estimate seen, until a stable window passes without the condition. Windows hold one sample per
    decision, so the interval should be a fraction of the panic window (Knative ticks every 2 s).
    `spare` replicas are asked for beyond both estimates (ours: headroom for the cold start)."""

    def __init__(self, signal: str, target: float, limits: Limits, stable_window_s: float = 60.0,
                 panic_window_s: float = 6.0, panic_threshold: float = 2.0, spare: int = 0):
        check_signal(signal)
        _positive(target=target, stable_window_s=stable_window_s, panic_window_s=panic_window_s,
                  panic_threshold=panic_threshold)
        if panic_window_s > stable_window_s:
            raise ValueError(f"the panic window ({panic_window_s} s) must not be longer than the stable window "
                             f"({stable_window_s} s)")
        _whole("spare", spare, 0)
        super().__init__(limits)
        self.signal, self.target, self.spare = signal, target, spare
        self.stable_window_s, self.panic_window_s = stable_window_s, panic_window_s
        self.panic_threshold = panic_threshold
        self.name = f"kpa-{signal}" + (f"+{spare}" if spare else "")
        self.samples: deque[tuple[float, float]] = deque()  # (time_s, fleet total of the signal)
        self.panic_since_s: float | None = None  # when the panic condition last held, while panicking
        self.panic_peak = 0  # the largest panic estimate since panic began

    @property
    def initial(self) -> int:
        return min(self.limits.max_replicas, self.limits.min_replicas + self.spare)

    def _mean_since(self, since_s: float) -> float:
        values = [v for t, v in self.samples if t > since_s]
        return float(np.mean(values)) if values else 0.0

    def want(self, snapshot: Snapshot) -> int:
        now = snapshot.time_s
        self.samples.append((now, per_replica(self.signal, snapshot) * snapshot.ready))
        while self.samples[0][0] <= now - self.stable_window_s:
            self.samples.popleft()
        stable = math.ceil(self._mean_since(now - self.stable_window_s) / self.target)
        panic = math.ceil(self._mean_since(now - self.panic_window_s) / self.target)
        if panic >= self.panic_threshold * max(snapshot.ready, 1):
            if self.panic_since_s is None:
                self.panic_peak = 0
            self.panic_since_s = now
        elif self.panic_since_s is not None and now >= self.panic_since_s + self.stable_window_s:
            self.panic_since_s = None
        if self.panic_since_s is None:
            return stable + self.spare
        self.panic_peak = max(self.panic_peak, panic + self.spare, snapshot.requested)
        return self.panic_peak

    @property
    def panicking(self) -> bool:
        return self.panic_since_s is not None


class Forecast(Autoscaler):
    """Plan for the load one cold start ahead, as Dynamo's SLA planner sizes its workers for the
    request rate it forecasts from a profiled per-replica throughput: fit a line to the signal's
    fleet total over the last `window_s`, read it `lead_s` ahead (the cold start plus an interval:
    when a replica asked for now starts serving), and ask for the larger of that and the fitted
    level now, over `target` per replica, rounded up, plus `spare`. A trend counts only when its
    slope is `trend_z` standard errors from flat (else the level is the window's mean), so noise
    is not extrapolated. A scale-down waits `stabilization_s`, as HPA's does."""

    def __init__(self, signal: str, target: float, lead_s: float, limits: Limits, window_s: float = 60.0,
                 stabilization_s: float = 60.0, trend_z: float = 2.0, spare: int = 0):
        check_signal(signal)
        _positive(target=target, window_s=window_s)
        if not 0 <= trend_z < math.inf:
            raise ValueError(f"trend_z must be finite and >= 0; got {trend_z}")
        if not 0 <= lead_s < math.inf or not 0 <= stabilization_s < math.inf:
            raise ValueError(f"need lead_s >= 0 and stabilization_s >= 0 (finite); got {lead_s}, {stabilization_s}")
        _whole("spare", spare, 0)
        super().__init__(limits)
        self.signal, self.target, self.lead_s, self.window_s = signal, target, lead_s, window_s
        self.stabilization_s, self.trend_z, self.spare = stabilization_s, trend_z, spare
        self.name = f"forecast-{signal}" + (f"+{spare}" if spare else "")
        self.samples: deque[tuple[float, float]] = deque()  # (time_s, fleet total of the signal)
        self.recent: deque[tuple[float, int]] = deque()  # (time_s, replicas wanted) within the stabilization

    @property
    def initial(self) -> int:
        return min(self.limits.max_replicas, self.limits.min_replicas + self.spare)

    def forecast(self) -> tuple[float, float]:
        """(the level now, the level lead_s later), as fleet totals of the signal."""
        times, values = np.array(self.samples).T  # (k,), (k,)
        if len(times) < 3:
            return float(values.mean()), float(values.mean())
        x = times - times[-1]
        slope, level = np.polyfit(x, values, 1)
        residual = values - (level + slope * x)
        slope_se = math.sqrt(residual @ residual / (len(x) - 2) / ((x - x.mean()) @ (x - x.mean())))
        if abs(slope) <= self.trend_z * slope_se:  # no trend to speak of: the window's mean, flat
            return float(values.mean()), float(values.mean())
        return float(level), float(level + slope * self.lead_s)

    def want(self, snapshot: Snapshot) -> int:
        now = snapshot.time_s
        self.samples.append((now, per_replica(self.signal, snapshot) * snapshot.ready))
        while self.samples[0][0] <= now - self.window_s:
            self.samples.popleft()
        level, ahead = self.forecast()
        wanted = math.ceil(max(level, ahead, 0.0) / self.target) + self.spare
        self.recent.append((now, wanted))
        while self.recent[0][0] < now - self.stabilization_s:
            self.recent.popleft()
        if wanted >= snapshot.requested:
            return wanted
        return min(snapshot.requested, max(w for _, w in self.recent))


class TTFTFeedback(Autoscaler):
    """Scale on the latency itself: one more replica while the `quantile` (p90) of the TTFTs seen
    in the last `window_s` is above `up_at` times the SLO, one fewer while it is below
    `down_below` times it, none otherwise (or with no TTFT in the window). TTFT lags the load: a
    request counts only once its first token is out, so a growing queue shows late."""

    def __init__(self, slo_s: float, limits: Limits, window_s: float = 30.0, quantile: float = 0.9,
                 up_at: float = 0.8, down_below: float = 0.3):
        _positive(slo_s=slo_s, window_s=window_s)
        if not 0 < quantile <= 1 or not 0 <= down_below < up_at:
            raise ValueError(f"need quantile in (0, 1] and 0 <= down_below < up_at; got quantile {quantile}, "
                             f"down_below {down_below}, up_at {up_at}")
        super().__init__(limits)
        self.slo_s, self.window_s, self.quantile, self.up_at, self.down_below = \
            slo_s, window_s, quantile, up_at, down_below
        self.name = "ttft"
        self.seen: deque[tuple[float, float]] = deque()  # (snapshot time_s, TTFT s)

    def want(self, snapshot: Snapshot) -> int:
        now = snapshot.time_s
        self.seen.extend((now, ttft) for ttft in snapshot.ttfts_s)
        while self.seen and self.seen[0][0] <= now - self.window_s:
            self.seen.popleft()
        if not self.seen:
            return snapshot.requested
        tail = float(np.quantile([ttft for _, ttft in self.seen], self.quantile))
        if tail > self.up_at * self.slo_s:
            return snapshot.requested + 1
        if tail < self.down_below * self.slo_s:
            return snapshot.requested - 1
        return snapshot.requested
