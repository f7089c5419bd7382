"""Autoscaling in the simulator (chapter 06): the policies hold their limits and follow their
systems' rules, the bursty trace swings as stated, and a fleet replay keeps its books (every
request served once, only by a ready replica, replica-seconds as the ticks count them). The bar:
on a 5x trace, an autoscaler meets the SLO for at most 70% of static peak provisioning's
replica-seconds, and static provisioning for the mean fails it.

The bar runs on a time-lapse of the study's scenario (autoscaling_study.Scenario): LLaMA-3-8B on
H100s through the same 5x wave, with every phase, the cold start, the interval and the windows at
1.3% of their length, and a peak of 4.2 replicas' throughput instead of 7.2 (an 18 s trace of
about 900 requests, within CI's budget); the GPU's step times and the SLO are not scaled.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab import roofline
from infra_lab.serving import autoscaling_study as study
from infra_lab.serving.autoscaling import (KPA, SIGNALS, Forecast, Limits, Snapshot, Static, TargetTracking,
                                           TTFTFeedback, per_replica)
from infra_lab.serving.autoscaling_replay import WARMUP_S, WEIGHT_LOAD_BYTES_PER_S, Slo, cold_start_s, replay
from infra_lab.serving.bursty import BurstyRate, Lengths, arrivals, bursty_trace

LLAMA = roofline.LLAMA_3_8B
SMALL = study.Scenario(LLAMA, time_scale=0.013, peak_load=4.2)


# ---- the books of a replay, checked against brute-force models --------------------------------------


def check_books(run, trace, cold_start: float, limits: Limits) -> None:
    n = len(trace)
    # every request served exactly once, and to the end
    assert (run.replica >= 0).all()
    assert np.bincount(run.replica, minlength=len(run.replicas)).tolist() == [r.served for r in run.replicas]
    assert run.tokens.tolist() == [r.max_tokens for r in trace]
    assert (run.ttft_s > 0).all() and (run.tpot_s >= 0).all() and len(run.arrival_s) == n
    # only a ready replica takes a request: not one starting, draining or stopped; it stops after its last finish
    for i, index in enumerate(run.replica):
        record = run.replicas[index]
        assert record.ready_s <= run.arrival_s[i] and (record.drain_s is None or run.arrival_s[i] < record.drain_s)
        assert run.finish_s[i] <= record.stop_s
    for record in run.replicas:
        assert record.ready_s - record.asked_s in (0.0, pytest.approx(cold_start))
        assert record.asked_s <= record.stop_s and (record.drain_s is None or record.ready_s <= record.drain_s)
    # at most one action per interval, each at a tick and of at most max_step replicas
    tick_times = {t.time_s for t in run.ticks}
    assert len({t for t, _ in run.actions}) == len(run.actions)
    assert all(t in tick_times and 1 <= abs(change) <= limits.max_step for t, change in run.actions)
    # each tick's counts are the replicas alive then (asked, not yet stopped), and within the limits
    for tick in run.ticks:
        alive = sum(r.asked_s <= tick.time_s < r.stop_s for r in run.replicas)
        assert tick.ready + tick.starting + tick.draining == alive
        assert limits.min_replicas <= tick.asked <= limits.max_replicas
    # replica-seconds: each replica's (stop - asked), summed, against the tick counts integrated; each replica's
    # start and stop and the tail after the last tick put it off by at most an interval each
    integrated = sum(t.ready + t.starting + t.draining for t in run.ticks) * limits.interval_s
    assert run.replica_seconds == pytest.approx(sum(r.stop_s - r.asked_s for r in run.replicas))
    tail = max(run.end_s - run.ticks[-1].time_s, 0.0) if run.ticks else run.end_s
    bound = limits.interval_s * (2 * len(run.replicas) + 1) + tail * len(run.replicas)
    assert abs(run.replica_seconds - integrated) <= bound


# ---- the bar ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bar():
    saturated = study.saturated_req_s(SMALL, n=128)
    rate, trace = SMALL.rate(saturated), SMALL.trace(saturated)
    model, config, cold = SMALL.time_model(), SMALL.engine_config(), SMALL.cold_start_s
    forecast = next(p for p in study.autoscalers(SMALL, rate, saturated, {}) if p.name == "forecast-rate")
    mean = Static(math.ceil(rate.mean_per_s / saturated), SMALL.interval, "static-mean")
    runs = {"static-peak": study.static_peak(SMALL, trace, rate, saturated),
            "static-mean": replay(trace, mean, model, config, cold, SMALL.slo),
            "forecast-rate": replay(trace, forecast, model, config, cold, SMALL.slo)}
    return {"saturated": saturated, "rate": rate, "trace": trace, "runs": runs, "limits": forecast.limits}


def test_an_autoscaler_meets_the_slo_on_the_5x_trace_for_at_most_70_percent_of_static_peak(bar):
    rate, runs = bar["rate"], bar["runs"]
    assert rate.swing == 5 and rate.peak_per_s / bar["saturated"] > 4  # the peak needs several replicas
    peak, scaled = runs["static-peak"], runs["forecast-rate"]
    assert peak.attainment >= SMALL.slo.goal  # the baseline it is measured against meets the SLO too
    assert scaled.attainment >= SMALL.slo.goal
    assert scaled.replica_seconds <= 0.7 * peak.replica_seconds
    assert 0 < len(scaled.actions) and max(abs(c) for _, c in scaled.actions) == 1  # one replica per interval
    check_books(scaled, bar["trace"], SMALL.cold_start_s, bar["limits"])


def test_static_provisioning_for_the_mean_fails_the_slo_at_the_peak(bar):
    run, rate = bar["runs"]["static-mean"], bar["rate"]
    assert len(run.replicas) * bar["saturated"] < rate.peak_per_s  # saturated at the top of the wave
    assert run.attainment < SMALL.slo.goal
    at_peak = rate(run.arrival_s) > rate.mean_per_s
    assert run.met[at_peak].mean() < run.met[~at_peak].mean()  # it is the peak's requests that miss
    check_books(run, bar["trace"], SMALL.cold_start_s, Limits(len(run.replicas), len(run.replicas), SMALL.interval,
                                                              len(run.replicas)))


def test_the_series_for_a_figure_covers_every_request(bar):
    run = bar["runs"]["forecast-rate"]
    window = 10 * SMALL.interval
    series = run.series(window)
    assert {len(v) for v in series.values()} == {len(series["time_s"])}
    assert series["rate_per_s"].sum() * window == pytest.approx(len(run.arrival_s))
    assert np.nanmin(series["attainment"]) >= 0 and np.nanmax(series["attainment"]) <= 1


# ---- replays of small random fleets --------------------------------------------------------------------

POLICIES = st.sampled_from(["static", "waiting", "concurrency", "kv", "rate", "kpa", "ttft", "forecast"])


def _policy(kind: str, limits: Limits):
    if kind == "static":
        return Static(limits.max_replicas, limits.interval_s)
    if kind == "kpa":
        return KPA("concurrency", 2.0, limits, stable_window_s=4 * limits.interval_s, panic_window_s=limits.interval_s)
    if kind == "ttft":
        return TTFTFeedback(0.05, limits, window_s=2 * limits.interval_s)
    if kind == "forecast":
        return Forecast("rate", 10.0, 2 * limits.interval_s, limits, window_s=4 * limits.interval_s,
                        stabilization_s=2 * limits.interval_s)
    return TargetTracking(kind, {"waiting": 1.0, "concurrency": 2.0, "kv": 0.001, "rate": 10.0}[kind], limits,
                          stabilization_s=2 * limits.interval_s)


@settings(max_examples=8, deadline=None)
@given(kind=POLICIES, low=st.integers(1, 2), extra=st.integers(0, 3), step=st.integers(1, 2),
       interval=st.floats(0.05, 0.3), cold=st.floats(0.0, 0.5), swing=st.floats(1.0, 6.0), seed=st.integers(0, 99))
def test_a_replay_serves_every_request_once_on_ready_replicas_and_bills_each_from_ask_to_stop(
        kind, low, extra, step, interval, cold, swing, seed):
    limits = Limits(low, low + extra, interval, step)
    trace = bursty_trace(BurstyRate(20.0, swing, 0.3, 0.3, 0.3), 1.5, Lengths(64, 6, 0.5, 512), seed)
    if not trace:
        return
    policy = _policy(kind, limits)
    run = replay(trace, policy, SMALL.time_model(), SMALL.engine_config(), cold)
    check_books(run, trace, cold, policy.limits)


# ---- the policies alone ----------------------------------------------------------------------------------


def test_bad_limits_and_unknown_signals_are_named():
    with pytest.raises(ValueError, match="min_replicas 5 is more than max_replicas 3"):
        Limits(5, 3)
    for interval in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"interval_s must be a finite number > 0; got {interval}"):
            Limits(1, 3, interval)
    with pytest.raises(ValueError, match="min_replicas must be a whole number >= 1; got 0"):
        Limits(0, 3)
    with pytest.raises(ValueError, match="max_step must be a whole number >= 1; got 0"):
        Limits(1, 3, 1.0, 0)
    snapshot = Snapshot(0.0, 1, 0)
    for make in (lambda: TargetTracking("qps", 1.0, Limits()), lambda: KPA("qps", 1.0, Limits()),
                 lambda: per_replica("qps", snapshot)):
        with pytest.raises(ValueError, match="unknown signal 'qps'; signals are 'waiting', 'concurrency'"):
            make()
    with pytest.raises(ValueError, match="target must be a finite number > 0; got -2"):
        TargetTracking("waiting", -2, Limits())
    with pytest.raises(ValueError, match="panic window"):
        KPA("rate", 1.0, Limits(), stable_window_s=5.0, panic_window_s=10.0)
    with pytest.raises(ValueError, match="kv_use is a share of the KV blocks, in \\[0, 1\\]; got 1.5"):
        Snapshot(0.0, 1, 0, kv_use=1.5)
    with pytest.raises(ValueError, match="waiting must be a whole number >= 0; got -1"):
        Snapshot(0.0, 1, 0, waiting=-1)
    with pytest.raises(ValueError, match="goal"):
        Slo(goal=1.5)


@st.composite
def snapshots(draw):
    times = np.cumsum(draw(st.lists(st.floats(0.1, 5.0), min_size=1, max_size=30)))
    return [Snapshot(float(t), draw(st.integers(0, 12)), draw(st.integers(0, 4)), draw(st.integers(0, 200)),
                     draw(st.integers(0, 300)), draw(st.floats(0, 1)),
                     tuple(draw(st.lists(st.floats(0, 5), max_size=5))), draw(st.floats(0, 500)))
            for t in times]


@settings(max_examples=60, deadline=None)
@given(kind=POLICIES, low=st.integers(1, 4), extra=st.integers(0, 8), step=st.integers(1, 3), seen=snapshots())
def test_every_decision_stays_within_the_limits_and_one_step_of_the_replicas_asked_for(kind, low, extra, step, seen):
    limits = Limits(low, low + extra, 1.0, step)
    policy = _policy(kind, limits)
    for snapshot in seen:
        decided = policy.decide(snapshot)
        assert policy.limits.min_replicas <= decided <= policy.limits.max_replicas
        if policy.limits.min_replicas <= snapshot.requested <= policy.limits.max_replicas:
            assert abs(decided - snapshot.requested) <= policy.limits.max_step


def test_target_tracking_is_the_hpa_rule_with_its_tolerance_and_scale_down_window():
    limits = Limits(1, 20, 1.0, 20)
    keda = TargetTracking("waiting", 4.0, limits, stabilization_s=10.0)
    assert keda.decide(Snapshot(0.0, 2, 0, waiting=30)) == 8  # ceil(30 / 4)
    assert keda.decide(Snapshot(1.0, 8, 0, waiting=33)) == 8  # 33 / 32 is within HPA's 10% tolerance
    assert keda.decide(Snapshot(2.0, 8, 0, waiting=4)) == 8  # wants 1, but wanted 8 within the window
    assert keda.decide(Snapshot(12.5, 8, 0, waiting=4)) == 1  # the window has passed
    flat = TargetTracking("concurrency", 5.0, limits, stabilization_s=0.0, spare=2)
    assert flat.initial == 3 and flat.decide(Snapshot(0.0, 3, 0, waiting=10, running=20)) == 6 + 2


def test_kpa_panics_on_a_spike_never_scales_down_in_panic_and_calms_after_a_stable_window():
    limits = Limits(1, 30, 1.0, 30)
    kpa = KPA("concurrency", 10.0, limits, stable_window_s=10.0, panic_window_s=2.0)
    for t in range(10):  # steady: 2 replicas at their target
        assert kpa.decide(Snapshot(float(t), 2, 0, running=20)) == 2
    assert not kpa.panicking
    spiked = kpa.decide(Snapshot(10.0, 2, 0, running=100))  # panic window mean 60 -> 6 >= 2 * 2 replicas
    assert kpa.panicking and spiked == 6
    assert kpa.decide(Snapshot(11.0, 6, 0, running=10)) == 6  # in panic: no scale down
    t = 12.0
    while (decided := kpa.decide(Snapshot(t, 6, 0, running=10))) and kpa.panicking:
        assert decided == 6
        t += 1.0
    assert t - 10.0 >= 10.0 and decided == 1  # calm a stable window after the spike: the stable mean rules again


def test_the_forecast_asks_for_the_fitted_rate_one_lead_ahead_and_waits_to_scale_down():
    limits = Limits(1, 50, 1.0, 50)
    forecast = Forecast("rate", 10.0, 20.0, limits, window_s=10.0, stabilization_s=5.0)
    for t in range(10):  # 2 replicas seeing 20 + 2 t requests/s: in 20 s, 20 + 2 (t + 20)
        decided = forecast.decide(Snapshot(float(t), 2, 0, arrivals_per_s=20.0 + 2.0 * t))
    assert decided == math.ceil((20.0 + 2.0 * (9 + 20)) / 10.0)
    steady = [forecast.decide(Snapshot(10.0 + t, 8, 0, arrivals_per_s=40.0)) for t in range(30)]
    assert steady[0] >= 8 and steady[-1] == 4  # the trend still counts at first; then the level, 40 / 10
    assert all(a >= b for a, b in zip(steady, steady[1:]))


def test_ttft_feedback_steps_one_replica_on_the_windows_p90():
    limits = Limits(1, 10, 1.0, 1)
    ttft = TTFTFeedback(1.0, limits, window_s=5.0)
    assert ttft.decide(Snapshot(0.0, 3, 0)) == 3  # nothing seen: hold
    assert ttft.decide(Snapshot(1.0, 3, 0, ttfts_s=(0.1,) * 8 + (2.0,) * 2)) == 4  # p90 above 0.8 s
    assert ttft.decide(Snapshot(7.0, 4, 0, ttfts_s=(0.1,) * 10)) == 3  # the slow ones left the window
    assert ttft.decide(Snapshot(8.0, 3, 0, ttfts_s=(0.5,) * 10)) == 3  # between: hold


# ---- the trace and the cold start ----------------------------------------------------------------------


def test_the_wave_swings_5x_and_its_mean_is_its_integral():
    rate = BurstyRate(10.0, 5.0, 40.0, 20.0, 10.0)
    t = np.linspace(0.0, 3 * rate.period_s, 300_001)
    values = rate(t)
    assert values.min() == pytest.approx(10.0) and values.max() == pytest.approx(50.0)
    grid_error = np.abs(np.diff(values)).max()  # a Riemann sum's error is at most one step of the grid
    assert values[:-1].mean() == pytest.approx(rate.mean_per_s, abs=grid_error)
    assert rate.scaled(0.5).period_s == rate.period_s / 2 and rate.scaled(0.5)(t / 2)[123] == values[123]


def test_arrivals_follow_the_rate_and_are_seeded():
    rate = BurstyRate(20.0, 5.0, 30.0, 10.0, 30.0)
    times = arrivals(rate, 4 * rate.period_s, seed=7)
    assert (np.diff(times) >= 0).all() and times[0] >= 0 and times[-1] < 4 * rate.period_s
    phase = np.mod(times, rate.period_s)
    trough, peak = (phase < 30.0).sum(), ((phase >= 40.0) & (phase < 70.0)).sum()  # 120 s of each
    expected = 120 * rate.base_per_s
    assert abs(trough - expected) <= 5 * math.sqrt(expected)  # Poisson: five standard deviations
    assert abs(peak - 5 * expected) <= 5 * math.sqrt(5 * expected)
    assert abs(len(times) - rate.mean_per_s * 4 * rate.period_s) <= 5 * math.sqrt(len(times))
    assert np.array_equal(times, arrivals(rate, 4 * rate.period_s, seed=7))
    assert not np.array_equal(times, arrivals(rate, 4 * rate.period_s, seed=8))
    bursty = arrivals(rate, 4 * rate.period_s, seed=7, burstiness=0.25)  # gamma gaps: clumped arrivals
    assert np.var(np.diff(bursty)) > np.var(np.diff(times))


def test_lengths_fit_the_context_around_their_medians():
    lengths = Lengths(1500, 13, 1.0, 8192)
    prompts, outputs = lengths.draw(20_000, seed=1)
    assert (prompts >= 1).all() and (outputs >= 1).all() and (prompts + outputs <= 8192).all()
    room = prompts <= 4096  # outputs these prompts leave room for are never clipped (lengths are independent)
    for drawn, median in ((prompts, 1500), (outputs[room], 13)):
        spread = 3 * 1.2533 * lengths.sigma / math.sqrt(len(drawn))  # 3 standard errors of a log-median
        assert abs(np.median(drawn) - median) <= median * math.expm1(spread) + 1  # and a token of rounding


def test_a_cold_start_is_the_weights_over_the_load_bandwidth_plus_the_warm_up():
    weights = LLAMA.total_params * 2  # bf16 bytes
    assert 15e9 < weights < 17e9  # LLaMA-3-8B: 8.0 B parameters
    assert cold_start_s(LLAMA) == pytest.approx(weights / WEIGHT_LOAD_BYTES_PER_S + WARMUP_S)
    assert cold_start_s(LLAMA, load_bytes_per_s=2 * WEIGHT_LOAD_BYTES_PER_S) - WARMUP_S == \
        pytest.approx((cold_start_s(LLAMA) - WARMUP_S) / 2)
    with pytest.raises(ValueError, match="load_bytes_per_s"):
        cold_start_s(LLAMA, load_bytes_per_s=0)


def test_headroom_is_the_growth_within_one_lead():
    rate = BurstyRate(10.0, 5.0, 100.0, 60.0, 30.0)
    flat = study.headroom(BurstyRate(10.0, 1.0, 100.0, 60.0, 30.0), 30.0, 5.0)
    assert flat["max_growth"] == pytest.approx(1.0) and flat["extra_replicas"] == pytest.approx(0.0)
    none = study.headroom(rate, 0.0, 5.0)
    assert none["max_growth"] == pytest.approx(1.0)
    room = study.headroom(rate, 30.0, 5.0)
    assert room["utilization_needed"] == pytest.approx(1 / room["max_growth"])
    assert 1.0 < room["max_growth"] < 5.0 and room["extra_replicas"] < (50.0 - 10.0) / 5.0
    assert study.headroom(rate, 45.0, 5.0)["max_growth"] > room["max_growth"]  # a longer cold start needs more


def test_every_signal_reads_a_snapshot():
    snapshot = Snapshot(0.0, 4, 1, waiting=8, running=12, kv_use=0.25, arrivals_per_s=40.0)
    values = {signal: per_replica(signal, snapshot) for signal in SIGNALS}
    assert values == {"waiting": 2.0, "concurrency": 5.0, "kv": 0.25, "rate": 10.0}
    assert snapshot.requested == 5
