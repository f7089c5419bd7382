"""`infra-lab bench serve`: a load generator that speaks only the OpenAI HTTP API, so it measures
this book's server, vLLM or SGLang alike.

Requests arrive as vLLM's benchmark sends them: gaps drawn from a gamma distribution of shape
`burstiness` and mean 1 / rate (burstiness 1 is a Poisson process, below 1 burstier, above 1
steadier), the first at 0; rate inf sends every request at once. `max_concurrency` caps the
requests in flight with a semaphore (a request that arrives at the cap waits for a slot). Every
request streams (`"stream": true` with usage in the last chunk) and asks for exactly its
`max_tokens` (`"ignore_eos": true`, greedy); the client records when each chunk of output text
arrives (`bench_metrics.RequestTrace`), and `bench_metrics` turns the traces into TTFT, TPOT,
ITL, throughput and goodput. Workloads are chapter 05's (`serving.traffic`): ShareGPT-like
lengths over prompts of real Python, or prompts sharing a few long openings.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infra_lab import backend, progress
from infra_lab.orchestration import bench_metrics
from infra_lab.orchestration.bench_metrics import RequestTrace
from infra_lab.serving import traffic

WORKLOADS = ("sharegpt", "shared-prefix")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
SHARED_PREFIX_TOKENS = 32  # shared-prefix's output per request unless max_tokens says otherwise
SHARED_PREFIX_BYTES = 320  # the longest shared opening (traffic.shared_prefix's default)
SHARED_PREFIX_TAIL_BYTES = 126  # what a shared-prefix prompt adds to its opening, at most
ERROR_CHARS = 500  # an error body is cut to this many characters


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # the text sent
    max_tokens: int  # output tokens asked for (with ignore_eos, exactly this many)
    prompt_bytes: int  # the prompt's length in the book's byte tokens


def _text(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="ignore")


def workload(name: str, n: int, seed: int = 0, max_len: int = traffic.MAX_LEN,
             max_tokens: int | None = None, n_prefixes: int = 3) -> list[BenchRequest]:
    """`n` requests of the workload `name`: "sharegpt" (chapter 05's ShareGPT-like lengths over
    real Python, scaled to a context of `max_len` tokens) or "shared-prefix" (prompts that share
    `n_prefixes` module openings, 32 output tokens each). `max_tokens` replaces every output length; a
    prompt that would then overflow max_len is cut to fit."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1; got {n!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2 tokens; got {max_len!r}")
    if max_tokens is not None and not (isinstance(max_tokens, int) and 1 <= max_tokens < max_len):
        raise ValueError(f"max_tokens must be an integer in [1, {max_len - 1}] (below max_len) or None; "
                         f"got {max_tokens!r}")
    if name == "sharegpt":
        timed = traffic.sharegpt_like(n, math.inf, seed, max_len)
        requests = []
        for request in timed:
            output = request.max_tokens if max_tokens is None else max_tokens
            prompt = request.prompt[:max_len - output]
            requests.append(BenchRequest(_text(prompt), output, len(prompt)))
        return requests
    output = SHARED_PREFIX_TOKENS if max_tokens is None else max_tokens
    prefix_bytes = min(SHARED_PREFIX_BYTES, max_len - output - SHARED_PREFIX_TAIL_BYTES)
    if prefix_bytes < 1:
        raise ValueError(f"shared-prefix prompts need max_len >= max_tokens + {SHARED_PREFIX_TAIL_BYTES + 1}; "
                         f"got max_len={max_len}, max_tokens={output}")
    timed = traffic.shared_prefix(n, math.inf, n_prefixes=n_prefixes, max_tokens=output, seed=seed,
                                  max_len=max_len, prefix_bytes=prefix_bytes)
    return [BenchRequest(_text(r.prompt), r.max_tokens, len(r.prompt)) for r in timed]


def arrival_times_s(n: int, rate_per_s: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """(n,) send times in seconds after the start: the first at 0, then gamma gaps of shape
    `burstiness` and mean 1 / rate_per_s; rate_per_s = inf puts every request at 0."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1; got {n!r}")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0 requests per second, or inf; got {rate_per_s}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness must be a finite number > 0 (1: Poisson); got {burstiness}")
    if rate_per_s == math.inf:
        return np.zeros(n)
    gaps_s = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate_per_s * burstiness), n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps_s)])


def _body(endpoint: str, model: str, request: BenchRequest) -> dict:
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class _Stream:
    """What one request has seen so far; kept apart from the coroutine, so a timeout keeps it."""

    def __init__(self):
        self.send_s = time.perf_counter()
        self.chunk_s: list[float] = []
        self.usage: dict = {}
        self.status: int | None = None

    def trace(self, url: str, error: str = "") -> RequestTrace:
        usage = self.usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        try:
            return RequestTrace(self.send_s, tuple(self.chunk_s), success=not error,
                                completion_tokens=usage.get("completion_tokens"),
                                prompt_tokens=usage.get("prompt_tokens") or 0, cached_tokens=cached,
                                status=self.status, error=error)
        except ValueError as bad:  # usage a trace cannot hold, e.g. more cached tokens than prompt tokens
            return RequestTrace(self.send_s, tuple(self.chunk_s), success=False, status=self.status,
                                error=f"unusable usage {json.dumps(usage)[:ERROR_CHARS]} from {url}: {bad}")


async def _stream(client, url: str, body: dict, headers: dict, stream: _Stream) -> str:
    """Send one request and read its events into `stream`; the error, or "" if it succeeded."""
    chat = "messages" in body
    async with client.stream("POST", url, json=body, headers=headers) as response:
        stream.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", errors="replace")
            return f"HTTP {response.status_code} from {url}: {text[:ERROR_CHARS]}"
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping") and other fields
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            now_s = time.perf_counter()
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                chunk = None
            if not isinstance(chunk, dict):
                return f"not a JSON object event from {url}: {data[:ERROR_CHARS]!r}"
            if chunk.get("error"):
                return f"error event from {url}: {json.dumps(chunk['error'])[:ERROR_CHARS]}"
            if _chunk_text(chunk, chat):
                stream.chunk_s.append(now_s)
            if chunk.get("usage"):
                stream.usage = chunk["usage"]
        else:
            return f"the stream from {url} ended without 'data: [DONE]'"
    if not stream.chunk_s:
        return f"the stream from {url} carried no output text"
    return ""


async def _one(client, url: str, body: dict, headers: dict, timeout_s: float) -> RequestTrace:
    import httpx

    stream = _Stream()
    try:
        error = await asyncio.wait_for(_stream(client, url, body, headers, stream), timeout_s)
    except asyncio.TimeoutError:
        error = f"no complete answer from {url} within the timeout of {timeout_s} s"
    except httpx.ConnectError as exc:
        error = f"cannot connect to {url}: {exc}"
    except (httpx.HTTPError, OSError) as exc:
        error = f"{type(exc).__name__} from {url}: {exc}"
    return stream.trace(url, error)


async def run_async(base_url: str, model: str, requests: Sequence[BenchRequest], *,
                    endpoint: str = "/v1/completions", rate_per_s: float = math.inf, burstiness: float = 1.0,
                    max_concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
                    timeout_s: float = 600.0, show_progress: bool = False) -> tuple[list[RequestTrace], float]:
    """Send `requests` to the server at `base_url` at the arrival times `arrival_times_s` draws,
    at most `max_concurrency` in flight. (one trace per request in order, duration in seconds)."""
    import httpx

    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; allowed: {', '.join(ENDPOINTS)}")
    if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be an integer >= 1 or None; got {max_concurrency!r}")
    if not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0; got {timeout_s}")
    if not requests:
        raise ValueError("requests is empty: give at least one BenchRequest")
    arrivals_s = arrival_times_s(len(requests), rate_per_s, burstiness, seed)
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress.bar(total=len(requests), show=show_progress, desc="requests", unit="req")
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        start_s = time.perf_counter()

        async def send(arrival_s: float, request: BenchRequest) -> RequestTrace:
            wait_s = start_s + arrival_s - time.perf_counter()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            body = _body(endpoint, model, request)
            if slots is None:
                trace = await _one(client, url, body, headers, timeout_s)
            else:
                async with slots:
                    trace = await _one(client, url, body, headers, timeout_s)
            bar.update(1)
            return trace

        try:
            traces = await asyncio.gather(*(send(float(t), r) for t, r in zip(arrivals_s, requests)))
        finally:
            bar.close()
        duration_s = time.perf_counter() - start_s
    return list(traces), duration_s


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (uvicorn's own choice: it reads a stream's chunks
    for a fraction of asyncio's CPU time, which a load generator sharing the server's machine
    takes from the server), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _run_on_a_new_loop(coroutine):
    loop = _event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def run(base_url: str, model: str, requests: Sequence[BenchRequest], **kwargs) -> tuple[list[RequestTrace], float]:
    """`run_async` from synchronous code; inside a running event loop (Jupyter), in a fresh thread."""
    coroutine = run_async(base_url, model, requests, **kwargs)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_on_a_new_loop(coroutine)
    outcome: dict = {}

    def in_thread() -> None:
        try:
            outcome["value"] = _run_on_a_new_loop(coroutine)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=in_thread, name="infra-lab-loadgen")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def machine() -> dict:
    """Where the benchmark ran, for the result file."""
    return {"platform": platform.platform(), "cpu": backend.cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf": JSON has no infinity
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def settings(args: argparse.Namespace) -> dict:
    """Every argument of the command, as JSON values (the dispatch function left out)."""
    return {k: _json_value(v) for k, v in sorted(vars(args).items()) if not callable(v)}


def main(args: argparse.Namespace) -> int:
    """The command: run the workload, print the summary, write --result-json. 1 if every request failed."""
    try:
        slos_ms = bench_metrics.parse_goodput(args.goodput)
        percentiles = bench_metrics.parse_percentiles(args.percentiles)
        requests = workload(args.workload, args.num_prompts, args.seed, args.max_len, args.max_tokens,
                            args.num_prefixes)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not args.base_url.startswith(("http://", "https://")):
        print(f"error: --base-url must start with http:// or https://; got {args.base_url!r}", file=sys.stderr)
        return 2
    print(f"bench serve: {len(requests)} {args.workload} requests to {args.base_url}{args.endpoint} "
          f"at {args.request_rate} req/s (burstiness {args.burstiness}), "
          f"max concurrency {args.max_concurrency or 'none'}", flush=True)
    traces, duration_s = run(args.base_url, args.model, requests, endpoint=args.endpoint,
                             rate_per_s=args.request_rate, burstiness=args.burstiness,
                             max_concurrency=args.max_concurrency, seed=args.seed, api_key=args.api_key,
                             timeout_s=args.timeout, show_progress=not args.no_progress)
    metrics = bench_metrics.compute(traces, duration_s, percentiles, slos_ms)
    print(bench_metrics.summary_table(metrics))
    errors = sorted({t.error for t in traces if not t.success})
    for error in errors[:3]:
        print(f"failed: {error}", file=sys.stderr)
    if len(errors) > 3:
        print(f"... and {len(errors) - 3} other errors", file=sys.stderr)
    if args.result_json:
        result = {"settings": settings(args), "machine": machine(), "goodput_slos_ms": slos_ms,
                  "metrics": metrics, "requests": bench_metrics.request_rows(traces)}
        with open(args.result_json, "w", encoding="utf-8") as out:
            json.dump(result, out, separators=(",", ":"))
            out.write("\n")
        print(f"wrote {args.result_json}")
    return 1 if metrics["completed"] == 0 else 0
