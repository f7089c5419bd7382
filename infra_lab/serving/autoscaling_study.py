"""Autoscaling LLaMA-3-8B on H100s through a 5x swing of load, in the simulator (chapter 06): SLO
attainment against replica-seconds for each autoscaler, beside static provisioning for the peak
and for the mean.

Everything is sized from one replica measured in the simulator, as a planner profiles an engine
before it deploys it (Dynamo's SLA planner does). Its throughput when saturated (a burst of
requests at once) sets the trace's rates: the peak is `peak_load` replicas' worth, the trough a
fifth of it. A steady run at `utilization` of that throughput gives each signal's per-replica
target (Knative's default target utilization is 70%). Static for the peak is the fewest replicas
that meet the SLO goal over the whole trace (found by replaying); static for the mean is the mean
rate over one replica's throughput, rounded up. `headroom` says what the cold start costs: how far
ahead of the load a scaler must act, and the utilization that keeps a reactive one ahead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from infra_lab import hardware
from infra_lab.hardware import Device
from infra_lab.model.config import ModelConfig
from infra_lab.serving import autoscaling_replay as fleet
from infra_lab.serving.autoscaling import KPA, Autoscaler, Forecast, Limits, Static, TargetTracking, TTFTFeedback
from infra_lab.serving.autoscaling_replay import FleetRun, Slo, replay
from infra_lab.serving.bursty import WORKLOADS, BurstyRate, Lengths, bursty_trace
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.simulator import StepTimeModel, pool_blocks, simulated_engine
from infra_lab.serving.traffic import TimedRequest


@dataclass(frozen=True)
class Scenario:
    """The fleet, the trace and the control plane of one study; times in seconds, rates derived
    from the replica's measured throughput (requests/s)."""
    model: ModelConfig  # LLaMA-3-8B: roofline.LLAMA_3_8B (serving does not import the chapter-level presets)
    device: Device = field(default_factory=lambda: hardware.CATALOG["H100 SXM"])
    lengths: Lengths = WORKLOADS["code"]
    slo: Slo = Slo()
    max_batch: int = 256  # vLLM's max_num_seqs
    token_budget: int = 2048  # vLLM's max_num_batched_tokens: a full chunk takes ~35 ms, under the TPOT SLO
    peak_load: float = 7.2  # the peak rate, in saturated replicas' throughput; the trough is peak_load / swing
    swing: float = 5.0
    trough_s: float = 480.0  # the wave's phases (BurstyRate), before time_scale
    ramp_s: float = 420.0
    peak_s: float = 60.0
    periods: int = 1
    interval_s: float = 5.0  # between autoscaler decisions, before time_scale
    utilization: float = 0.7  # of a replica's saturated throughput, at which the signals' targets are read
    slo_utilization: float = 0.85  # of it, at which one replica still meets the SLO in steady state (compare
    # checks it): the forecast plans to it, since its headroom comes from looking ahead, not from idle capacity
    spare: int = 0  # replicas the scalers keep beyond what their signal asks (headroom for the cold start)
    max_replicas: int = 16
    time_scale: float = 1.0  # < 1: a time-lapse of the control plane (trace phases, cold start, interval,
    # windows all shorter) for tests; the GPU's step times and the SLO are not scaled
    seed: int = 0

    def __post_init__(self):
        if not (self.peak_load > 0 and self.swing >= 1 and 0 < self.utilization <= 1 and 0 < self.slo_utilization <= 1
                and 0 < self.time_scale < math.inf):
            raise ValueError(f"need peak_load > 0, swing >= 1, utilizations in (0, 1] and time_scale > 0; got "
                             f"{self.peak_load}, {self.swing}, {self.utilization}, {self.slo_utilization}, "
                             f"{self.time_scale}")
        if not isinstance(self.periods, int) or self.periods < 1 or not isinstance(self.spare, int) or self.spare < 0:
            raise ValueError(f"need a whole number of periods >= 1 and spare >= 0; got {self.periods}, {self.spare}")

    def time_model(self) -> StepTimeModel:
        return StepTimeModel.on(self.model, self.device)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(policy="chunked", max_batch=self.max_batch, token_budget=self.token_budget,
                            num_blocks=pool_blocks(self.model, self.device))

    @property
    def cold_start_s(self) -> float:
        return fleet.cold_start_s(self.model) * self.time_scale

    @property
    def interval(self) -> float:
        return self.interval_s * self.time_scale

    def rate(self, saturated_req_s: float) -> BurstyRate:
        peak = self.peak_load * saturated_req_s
        wave = BurstyRate(peak / self.swing, self.swing, self.trough_s, self.ramp_s, self.peak_s)
        return wave.scaled(self.time_scale)

    def trace(self, saturated_req_s: float) -> list[TimedRequest]:
        rate = self.rate(saturated_req_s)
        return bursty_trace(rate, rate.period_s * self.periods, self.lengths, self.seed)


def saturated_req_s(scenario: Scenario, n: int | None = None) -> float:
    """Requests/s one replica finishes when `n` requests (2 * max_batch unless given) of the
    scenario's lengths all arrive at once: its throughput, saturated."""
    n = n or 2 * scenario.max_batch
    prompts, outputs = scenario.lengths.draw(n, scenario.seed + 1)
    engine = simulated_engine(scenario.time_model(), scenario.engine_config())
    engine.serve([TimedRequest(0.0, [1] * int(p), int(o)) for p, o in zip(prompts, outputs)])
    return n / engine.clock()


def steady_profile(scenario: Scenario, rate_per_s: float, duration_s: float = 60.0) -> dict[str, float]:
    """One replica under a steady Poisson stream of `rate_per_s` for `duration_s`: each signal's
    mean per replica over its ticks (waiting, concurrency, kv), its SLO attainment and p90 TTFT."""
    trace = bursty_trace(BurstyRate(rate_per_s, 1.0, duration_s, 0, 0), duration_s, scenario.lengths,
                         scenario.seed + 2)
    run = replay(trace, Static(1, interval_s=min(1.0, duration_s / 10)), scenario.time_model(),
                 scenario.engine_config(), 0.0, scenario.slo)
    ticks = run.ticks
    return {"waiting": float(np.mean([t.waiting for t in ticks])), "rate": rate_per_s,
            "concurrency": float(np.mean([t.waiting + t.running for t in ticks])),
            "kv": float(np.mean([t.kv_use for t in ticks])), "attainment": run.attainment,
            "p90_ttft_s": float(np.percentile(run.ttft_s, 90))}


def autoscalers(scenario: Scenario, rate: BurstyRate, saturated: float, targets: dict[str, float]) -> list[Autoscaler]:
    """The autoscalers compared, each on its signal's target per replica (`targets`, from
    steady_profile at the target utilization; the rate's is utilization * saturated and the
    forecast's slo_utilization * saturated unless given), none below what the trough needs. A
    policy whose signal has no target is left out."""
    targets = {"rate": scenario.utilization * saturated, "forecast": scenario.slo_utilization * saturated} | targets
    limits = Limits(max(1, math.ceil(rate.base_per_s / saturated)), scenario.max_replicas, scenario.interval)
    window, spare = 60.0 * scenario.time_scale, scenario.spare
    made = {
        # KEDA on sum(vllm:num_requests_waiting), through the HPA it creates (scale-down window cut to 60 s);
        # a target under half a request would turn every queued request into a scale-up
        "waiting": lambda: TargetTracking("waiting", max(targets["waiting"], 0.5), limits, stabilization_s=window,
                                          spare=spare),
        # Knative / AIBrix KPA on requests in flight (Knative's default metric, concurrency)
        "concurrency": lambda: KPA("concurrency", targets["concurrency"], limits, stable_window_s=window,
                                   panic_window_s=window / 10, spare=spare),
        # Dynamo's load planner watches KV use; here as a target, one step per interval
        "kv": lambda: TargetTracking("kv", targets["kv"], limits, stabilization_s=window, spare=spare),
        # KPA on requests per second (Knative's rps)
        "rate": lambda: KPA("rate", targets["rate"], limits, stable_window_s=window, panic_window_s=window / 10,
                            spare=spare),
        # the request rate forecast one cold start (and an interval) ahead, as Dynamo's SLA planner plans
        "forecast": lambda: Forecast("rate", targets["forecast"], scenario.cold_start_s + scenario.interval, limits,
                                     window_s=window, stabilization_s=window, spare=spare),
    }
    chosen = [make() for signal, make in made.items() if signal in targets]
    # the latency itself: p90 TTFT over half a minute against the SLO
    return chosen + [TTFTFeedback(scenario.slo.ttft_s, limits, window_s=window / 2)]


def headroom(rate: BurstyRate, lead_s: float, saturated_req_s: float) -> dict[str, float]:
    """What a cold start costs a scaler that reacts to the load it sees: capacity asked for at t
    serves from t + lead_s (cold start plus up to one interval). Returns the largest rate(t +
    lead) / rate(t) over the trace (a reactive scaler must keep utilization below its inverse),
    and the most replicas (of `saturated_req_s` each) the load gains within one lead."""
    t = np.linspace(0.0, rate.period_s, 4096)
    now, later = rate(t), rate(t + lead_s)
    return {"lead_s": lead_s, "max_growth": float(np.max(later / now)),
            "utilization_needed": float(np.min(now / later)),
            "extra_replicas": float(np.max((later - now) / saturated_req_s))}


@dataclass
class Comparison:
    scenario: Scenario
    saturated_req_s: float
    rate: BurstyRate
    targets: dict[str, float]  # steady_profile at the target utilization
    at_slo_utilization: dict[str, float]  # steady_profile at slo_utilization: its attainment should meet the goal
    runs: dict[str, FleetRun]  # by policy name, static-peak and static-mean among them
    headroom: dict[str, float]

    def table(self) -> dict[str, dict[str, float]]:
        """Per policy: attainment, replica-seconds, their ratio to static-peak's, actions, the most
        actions in one interval, and the replay's speed on this machine."""
        peak = self.runs["static-peak"].replica_seconds
        rows = {}
        for name, run in self.runs.items():
            per_tick = np.bincount([round(t / self.scenario.interval) for t, _ in run.actions]) if run.actions else [0]
            rows[name] = {"attainment": run.attainment, "replica_seconds": run.replica_seconds,
                          "over_static_peak": run.replica_seconds / peak,
                          "cold_start_seconds": run.cold_start_seconds, "actions": len(run.actions),
                          "most_actions_per_interval": int(np.max(per_tick)), "requests": len(run.arrival_s),
                          "steps": run.steps, "wall_s": run.wall_s, "steps_per_s": run.steps_per_s}
        return rows


def static_peak(scenario: Scenario, trace, rate: BurstyRate, saturated: float, progress: bool = False) -> FleetRun:
    """The fewest static replicas, from the peak rate over one replica's throughput up, whose replay
    meets the SLO goal."""
    replicas = math.ceil(rate.peak_per_s / saturated)
    while True:
        run = replay(trace, Static(replicas, scenario.interval, "static-peak"), scenario.time_model(),
                     scenario.engine_config(), scenario.cold_start_s, scenario.slo, progress)
        if run.attainment >= scenario.slo.goal or replicas >= scenario.max_replicas:
            return run
        replicas += 1


def compare(scenario: Scenario, progress: bool = False) -> Comparison:
    """Replay the scenario's trace under each autoscaler, static for the peak and static for the mean."""
    saturated = saturated_req_s(scenario)
    rate = scenario.rate(saturated)
    steady_s = max(20.0, 60 * scenario.time_scale)
    targets = steady_profile(scenario, scenario.utilization * saturated, steady_s)
    at_slo = steady_profile(scenario, scenario.slo_utilization * saturated, steady_s)
    trace = scenario.trace(saturated)
    model, config, cold = scenario.time_model(), scenario.engine_config(), scenario.cold_start_s
    runs = {"static-peak": static_peak(scenario, trace, rate, saturated, progress)}
    mean = Static(math.ceil(rate.mean_per_s / saturated), scenario.interval, "static-mean")
    runs["static-mean"] = replay(trace, mean, model, config, cold, scenario.slo, progress)
    for policy in autoscalers(scenario, rate, saturated, targets):
        runs[policy.name] = replay(trace, policy, model, config, cold, scenario.slo, progress)
    return Comparison(scenario, saturated, rate, targets, at_slo, runs,
                      headroom(rate, cold + scenario.interval, saturated))
