"""Serving metrics from what a streaming client saw: TTFT, TPOT, ITL, end-to-end latency,
throughput and goodput, defined as vLLM's `vllm bench serve` defines them, with its key names.

A `RequestTrace` holds one request as the client recorded it: when it was sent and when each
streamed chunk that carried output text arrived. From it:

- TTFT (time to first token) = first chunk - send.
- E2E latency (e2el) = last chunk - send.
- TPOT (time per output token) = (E2E - TTFT) / (output tokens - 1), one number per request with
  more than one output token; the reported mean, median and percentiles are over requests.
- ITL (inter-token latency) = the gaps between consecutive chunks, every gap of every request
  pooled into one list.

TPOT and ITL are often confused (vllm#6531, vllm#7242, sglang PR 1340); they differ in two ways.
TPOT weights every request equally, and it counts tokens, not chunks: a chunk that brings k
tokens at once spreads its wait over all k. ITL pools every gap, so a long request, which has
many gaps, dominates it; and a chunk of k tokens is one gap, however many tokens it carries.
With one token per chunk and requests of one length the two means agree; with lengths that
differ, ITL leans to the long requests; a server that sends 10 tokens per chunk every 10 s has
TPOT 1 s and ITL 10 s.

Goodput is the completed requests per second that meet every SLO given (`ttft`, `tpot`, `e2e`,
in ms, as `--goodput ttft:500 tpot:50`); a one-token request has no TPOT and meets any TPOT SLO.
The prefix hit rate is the share of prompt tokens the server reported as cached
(`usage.prompt_tokens_details.cached_tokens`). As in vLLM, a statistic of an empty set (no
request with two output tokens, say) is reported as 0.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2e")  # what --goodput may constrain, in ms
LATENCIES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass(frozen=True)
class RequestTrace:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    send_s: float  # when the request was sent
    chunk_s: tuple[float, ...] = ()  # arrival of every streamed chunk that carried output text
    success: bool = True
    completion_tokens: int | None = None  # the server's usage.completion_tokens, if it gave one
    prompt_tokens: int = 0  # usage.prompt_tokens (0 if not given)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 if not given)
    status: int | None = None  # the HTTP status, None if no answer came (connection error, timeout)
    error: str = ""

    def __post_init__(self):
        object.__setattr__(self, "chunk_s", tuple(float(t) for t in self.chunk_s))
        if not math.isfinite(self.send_s):
            raise ValueError(f"send_s must be a finite time in seconds; got {self.send_s}")
        if any(not math.isfinite(t) for t in self.chunk_s):
            raise ValueError(f"chunk_s must hold finite times in seconds; got {self.chunk_s}")
        if self.chunk_s and (self.chunk_s[0] < self.send_s or any(b < a for a, b in zip(self.chunk_s,
                                                                                     self.chunk_s[1:]))):
            raise ValueError(f"chunk_s must be non-decreasing and not before send_s={self.send_s}; "
                             f"got {self.chunk_s}")
        if self.success and not self.chunk_s:
            raise ValueError("a successful request needs at least one output chunk; got chunk_s=()")
        for name in ("prompt_tokens", "cached_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens={self.cached_tokens} exceeds prompt_tokens={self.prompt_tokens}")
        if self.completion_tokens is not None and (not isinstance(self.completion_tokens, (int, np.integer))
                                                   or self.completion_tokens < 0):
            raise ValueError(f"completion_tokens must be an integer >= 0 or None; got {self.completion_tokens!r}")

    @property
    def output_tokens(self) -> int:
        """The server's completion_tokens when it gave them, else the number of text chunks."""
        return len(self.chunk_s) if self.completion_tokens is None else int(self.completion_tokens)

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.send_s

    @property
    def e2el_s(self) -> float:
        return self.chunk_s[-1] - self.send_s

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for a request of at most one output token."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def parse_goodput(specs: Iterable[str] | dict | None) -> dict[str, float]:
    """SLOs in ms from `["ttft:500", "tpot:50"]` (or a dict {"ttft": 500}): {"ttft": 500.0, ...}."""
    if not specs:
        return {}
    pairs = list(specs.items()) if isinstance(specs, dict) else []
    if not isinstance(specs, dict):
        for spec in specs:
            name, colon, value = str(spec).partition(":")
            if not colon:
                raise ValueError(f"a goodput SLO must be METRIC:MS, METRIC one of {', '.join(SLO_METRICS)}; "
                                 f"got {spec!r}")
            pairs.append((name.strip(), value.strip()))
    slos: dict[str, float] = {}
    for name, value in pairs:
        if name not in SLO_METRICS:
            raise ValueError(f"unknown goodput metric {name!r}; allowed: {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"the {name} SLO must be a number of ms >= 0; got {value!r}") from None
        if not 0 <= ms < math.inf:
            raise ValueError(f"the {name} SLO must be a finite number of ms >= 0; got {value!r}")
        if name in slos:
            raise ValueError(f"the {name} SLO is given twice ({slos[name]} and {ms})")
        slos[name] = ms
    return slos


def parse_percentiles(text: str | Iterable[float]) -> tuple[float, ...]:
    """(50.0, 99.0) from "50,99" (or an iterable of numbers); each in [0, 100]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    percentiles = []
    for item in items:
        try:
            p = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"percentiles must be numbers in [0, 100]; got {item!r}") from None
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must be numbers in [0, 100]; got {item!r}")
        percentiles.append(p)
    if not percentiles:
        raise ValueError(f"give at least one percentile in [0, 100]; got {text!r}")
    return tuple(percentiles)


def percentile_name(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = values_ms.size == 0
    stats = {f"mean_{name}_ms": 0.0 if empty else float(np.mean(values_ms)),
             f"median_{name}_ms": 0.0 if empty else float(np.median(values_ms)),
             f"std_{name}_ms": 0.0 if empty else float(np.std(values_ms))}
    for p in percentiles:
        stats[f"{percentile_name(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(values_ms, p))
    return stats


def meets_slos(trace: RequestTrace, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms); a request without TPOT meets a TPOT SLO."""
    measured_s = {"ttft": trace.ttft_s, "tpot": trace.tpot_s, "e2e": trace.e2el_s}
    return all(measured_s[name] is None or measured_s[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def compute(traces: Sequence[RequestTrace], duration_s: float, percentiles: Iterable[float] = DEFAULT_PERCENTILES,
            goodput: Iterable[str] | dict | None = None) -> dict[str, float | int | None]:
    """Every metric of a benchmark that ran `traces` in `duration_s` seconds, with vLLM's keys.
    `goodput`: SLOs as parse_goodput takes them; without any, request_goodput is None."""
    if not 0 < duration_s < math.inf:
        raise ValueError(f"duration_s must be a finite number of seconds > 0; got {duration_s}")
    percentiles = parse_percentiles(percentiles)
    slos_ms = parse_goodput(goodput)
    done = [t for t in traces if t.success]
    input_tokens = sum(t.prompt_tokens for t in done)
    output_tokens = sum(t.output_tokens for t in done)
    cached_tokens = sum(t.cached_tokens for t in done)
    result: dict[str, float | int | None] = {
        "duration_s": float(duration_s),
        "completed": len(done),
        "failed": len(traces) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        "prefix_hit_rate": cached_tokens / input_tokens if input_tokens else 0.0,
        "request_throughput": len(done) / duration_s,
        "request_goodput": sum(meets_slos(t, slos_ms) for t in done) / duration_s if slos_ms else None,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    result |= _stats("ttft", [t.ttft_s for t in done], percentiles)
    result |= _stats("tpot", [t.tpot_s for t in done if t.tpot_s is not None], percentiles)
    result |= _stats("itl", [gap for t in done for gap in t.itls_s], percentiles)
    result |= _stats("e2el", [t.e2el_s for t in done], percentiles)
    return result


def request_rows(traces: Sequence[RequestTrace], decimals: int = 3) -> list[dict]:
    """One compact row per request (ms rounded to `decimals`): ttft_ms, e2el_ms, output_tokens,
    prompt_tokens, cached_tokens and itl_ms for a completed one; status and error for a failed one."""
    rows = []
    for trace in traces:
        if trace.success:
            rows.append({"ttft_ms": round(trace.ttft_s * 1000, decimals),
                         "e2el_ms": round(trace.e2el_s * 1000, decimals),
                         "output_tokens": trace.output_tokens, "prompt_tokens": trace.prompt_tokens,
                         "cached_tokens": trace.cached_tokens,
                         "itl_ms": [round(gap * 1000, decimals) for gap in trace.itls_s]})
        else:
            rows.append({"success": False, "status": trace.status, "error": trace.error})
    return rows


def summary_table(metrics: dict, title: str = "Serving Benchmark Result", width: int = 50) -> str:
    """The metrics as a text table in the layout of vLLM's summary."""
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<{width - 10}}{text:>10}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    if metrics.get("request_goodput") is not None:
        row("Request goodput (req/s):", metrics["request_goodput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    row("Prefix hit rate:", metrics["prefix_hit_rate"])
    for name, heading in LATENCIES.items():
        lines.append(f"{heading}".center(width, "-"))
        upper = name.upper()
        for key, value in metrics.items():
            if key.endswith(f"_{name}_ms") and not key.startswith("std_"):
                stat = key[: -len(f"_{name}_ms")]
                label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
                row(f"{label} {upper} (ms):", value)
    lines.append("=" * width)
    return "\n".join(lines)
