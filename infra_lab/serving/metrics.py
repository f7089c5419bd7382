"""Latency and throughput of a serving run, from its requests' timestamps and its step log.

- TTFT (time to first token): first token's time minus arrival; queueing and prefill together.
- TPOT (time per output token), taken here per gap as the time between a request's consecutive
  tokens (some call it ITL, inter-token latency); its percentiles pool every gap of every request,
  so one long prefill that stalls a batch of decodes shows up as a spike in the tail.
- End-to-end latency: finish minus arrival.
- Throughput: output tokens per second over the run (first arrival to last finish).
- Goodput: requests per second that met both objectives, TTFT <= `ttft_slo_s` and their mean TPOT
  <= `tpot_slo_s` (Zhong et al., "DistServe", OSDI 2024, define it this way).
- Slot utilization: the share of the `max_batch` slots whose request computed in a step, averaged
  over steps; a static batch's finished members hold slots that do no work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra_lab.serving.request import Request, RequestState
from infra_lab.serving.steplog import StepRecord


def ttft_s(request: Request) -> float:
    return request.token_times_s[0] - request.arrival_s


def tpot_gaps_s(request: Request) -> np.ndarray:
    return np.diff(np.asarray(request.token_times_s, float))


def e2e_s(request: Request) -> float:
    return request.finish_s - request.arrival_s


@dataclass(frozen=True)
class Summary:
    n_finished: int
    n_rejected: int  # ended without running: aborted, or rejected by max_waiting
    output_tokens: int
    seconds: float  # first arrival to last finish
    throughput_tok_s: float
    ttft_s: dict[str, float]  # "p50", "p90", "p99", "mean"
    tpot_s: dict[str, float]  # over every gap between tokens
    e2e_s: dict[str, float]
    goodput_req_s: float | None  # None without objectives
    slot_utilization: float
    preemptions: int
    steps: int
    forward_share: float  # of the steps' time, the share spent in the model's forward


def percentiles(values) -> dict[str, float]:
    values = np.asarray(values, float)
    if values.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(values.mean())}


def meets(request: Request, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    gaps = tpot_gaps_s(request)
    return ttft_s(request) <= ttft_slo_s and (gaps.size == 0 or gaps.mean() <= tpot_slo_s)


def summarize(requests: list[Request], log: list[StepRecord], max_batch: int,
              ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> Summary:
    """The run's figures; only finished requests count toward latency and throughput."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    if (ttft_slo_s is None) != (tpot_slo_s is None):
        raise ValueError("goodput needs both objectives, ttft_slo_s and tpot_slo_s, or neither")
    done = [r for r in requests if r.state is RequestState.FINISHED]
    if not done:
        raise ValueError("no request finished; there is nothing to summarize")
    start = min(r.arrival_s for r in requests)
    seconds = max(r.finish_s for r in done) - start
    tokens = sum(len(r.output) for r in done)
    goodput = None
    if ttft_slo_s is not None:
        goodput = sum(meets(r, ttft_slo_s, tpot_slo_s) for r in done) / seconds
    busy = sum(s.seconds for s in log)
    return Summary(
        n_finished=len(done), n_rejected=sum(r.state is RequestState.ABORTED and not r.output for r in requests),
        output_tokens=tokens, seconds=seconds, throughput_tok_s=tokens / seconds,
        ttft_s=percentiles([ttft_s(r) for r in done]),
        tpot_s=percentiles(np.concatenate([tpot_gaps_s(r) for r in done])),
        e2e_s=percentiles([e2e_s(r) for r in done]),
        goodput_req_s=goodput,
        slot_utilization=float(np.mean([len(s.work) / max_batch for s in log])) if log else 0.0,
        preemptions=sum(len(s.preempted) for s in log), steps=len(log),
        forward_share=sum(s.forward_s for s in log) / busy if busy > 0 else 0.0)
