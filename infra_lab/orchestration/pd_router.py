"""`infra-lab route --prefill URL... --decode URL...`: the front of a disaggregated deployment
(chapter 06). A client speaks the OpenAI API to it exactly as to one engine.

Each request goes twice, as vLLM's disaggregated proxy sends it: first to a prefill worker's
`/kv/prefill`, which computes the prompt and the first token and sends the K and V to the
chosen decode worker, then to that decode worker, whose answer (streamed or whole) the front
relays from the first token on. Both pools are picked by fewest requests in flight.

Failures: a prefill worker or a transfer that fails (the decode worker is gone, or the time
limit passed) takes that worker out of the rotation until it answers its health probe, and the
request starts again once elsewhere. With no decode worker left, the prefill worker serves the
request whole, as a colocated engine (counted as a fallback). A decode worker that breaks
mid-stream ends the client's stream with an error event naming it. Every request ends: answered,
retried, or failed by name.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from infra_lab.orchestration.policies import LeastOutstanding
from infra_lab.orchestration.router import Router, RouterSettings, _relay, error, prompt_text
from infra_lab.orchestration.tenants import Tenants

ATTEMPTS = 2  # a request starts at most twice (the second time on other workers)


class PDMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("pd_requests", "Requests by outcome: disaggregated, fallback (served whole by a "
                                "prefill worker), failed", ["outcome"], registry=self.registry)
        self.retries = Counter("pd_retries", "Requests started again after a worker or a transfer failed",
                               ["stage"], registry=self.registry)
        self.kv_bytes = Counter("pd_kv_bytes", "Bytes of K and V the prefill workers reported sent",
                                registry=self.registry)


def create_pd_app(prefill_urls: list[str], decode_urls: list[str], settings: RouterSettings | None = None,
                  on_started: Callable[[], None] | None = None) -> FastAPI:
    settings = settings or RouterSettings()
    prefills = Router(prefill_urls, LeastOutstanding(seed=0), Tenants(), settings)
    decodes = Router(decode_urls, LeastOutstanding(seed=1), Tenants(), settings)
    overlap = set(prefills.workers) & set(decodes.workers)
    if overlap:
        raise ValueError(f"a worker is either prefill or decode; listed as both: {sorted(overlap)}")
    ranks: dict[str, int | None] = {}  # decode worker url -> its kv rank (gloo), read from /kv/info
    metrics = PDMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            prefills.client = decodes.client = client
            probes = [asyncio.create_task(pool.health_loop()) for pool in (prefills, decodes)]
            if on_started is not None:
                on_started()
            try:
                yield
            finally:
                for probe in probes:
                    probe.cancel()
                await asyncio.gather(*probes, return_exceptions=True)

    app = FastAPI(title="infra-lab disaggregated front", lifespan=lifespan)

    async def rank_of(url: str) -> int | None:
        if url not in ranks:
            info = (await decodes.client.get(f"{url}/kv/info", timeout=settings.health_timeout_s)).json()
            if info.get("role") != "decode":
                raise ValueError(f"{url} is not a decode worker: its /kv/info says {info}")
            ranks[url] = info.get("rank")
        return ranks[url]

    async def prefill(worker, body: dict, transfer: dict):
        """POST /kv/prefill; its JSON, or (status, body) of its refusal, or None if it failed."""
        prefills.take(worker, "")
        ok = False
        try:
            answer = await prefills.client.post(worker.url + "/kv/prefill",
                                                json=body | {"kv_transfer_params": transfer})
            ok = answer.status_code < 500
            return answer
        except httpx.HTTPError:
            prefills.set_health(worker, False)
            return None
        finally:
            prefills.give_back(worker, "", ok)

    async def proxy(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the request body is not valid JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, f"the request body must be a JSON object; got {type(body).__name__}",
                         "invalid_request_error")
        text, failures = prompt_text(path, body), []
        for attempt in range(ATTEMPTS):
            prefill_workers = prefills.with_free_slot() or prefills.routable()
            if not prefill_workers:
                metrics.requests.labels("failed").inc()
                return error(503, "no healthy prefill worker", "service_unavailable", "no_healthy_worker")
            p = prefills.policy.choose(text, prefill_workers)
            decode_workers = decodes.with_free_slot() or decodes.routable()
            if not decode_workers:  # nobody to decode: the prefill worker serves it whole
                prefills.take(p, text)
                try:
                    response, rest, first = await prefills.send(p, path, raw)
                except httpx.HTTPError as exc:
                    prefills.give_back(p, text, ok=False)
                    prefills.set_health(p, False)
                    failures.append(f"prefill worker {p.url}: {type(exc).__name__}")
                    continue
                metrics.requests.labels("fallback").inc()
                return _relay(prefills, p, text, "default", response, rest, first)
            d = decodes.policy.choose(text, decode_workers)
            transfer_id = uuid.uuid4().hex
            try:
                rank = await rank_of(d.url)
            except (httpx.HTTPError, ValueError) as exc:
                decodes.set_health(d, False)
                failures.append(f"decode worker {d.url}: {exc}")
                continue
            answer = await prefill(p, body, {"transfer_id": transfer_id, "decode_rank": rank})
            if answer is None or answer.status_code >= 500:
                failure = _named(answer, "no answer")
                failures.append(f"prefill worker {p.url}: {failure}")
                if "kv_transfer" in failure:  # the decode worker did not take it
                    decodes.set_health(d, False)
                metrics.retries.labels("prefill").inc()
                continue
            if answer.status_code >= 400:  # the client's request is at fault: say so as the worker did
                return JSONResponse(answer.json(), status_code=answer.status_code)
            metrics.kv_bytes.inc(answer.json().get("kv_bytes", 0))
            decodes.take(d, text)
            forwarded = json.dumps(body | {"kv_transfer_params": {"transfer_id": transfer_id}}).encode()
            try:
                response, rest, first = await decodes.send(d, path, forwarded)
            except httpx.HTTPError as exc:
                decodes.give_back(d, text, ok=False)
                decodes.set_health(d, False)
                failures.append(f"decode worker {d.url}: {type(exc).__name__}")
                metrics.retries.labels("decode").inc()
                continue
            if response.status_code >= 500:
                await response.aclose()
                decodes.give_back(d, text, ok=False)
                failures.append(f"decode worker {d.url}: status {response.status_code}")
                metrics.retries.labels("decode").inc()
                continue
            metrics.requests.labels("disaggregated").inc()
            return _relay(decodes, d, text, "default", response, rest, first, error_event=True)
        metrics.requests.labels("failed").inc()
        return error(502, "the request failed twice: " + "; ".join(failures), "server_error", "worker_failed")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        for worker in decodes.routable() + prefills.routable():
            with contextlib.suppress(httpx.HTTPError):
                answer = await decodes.client.get(f"{worker.url}/v1/models", timeout=settings.health_timeout_s)
                return JSONResponse(answer.json(), status_code=answer.status_code)
        return error(503, "no healthy worker", "service_unavailable", "no_healthy_worker")

    @app.get("/health")
    async def health():
        ok = bool(prefills.routable())
        return JSONResponse({"status": "ok" if ok else "no healthy prefill worker"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_text():
        text = generate_latest(metrics.registry) + b"".join(
            _labelled(pool.metrics.text(), role) for role, pool in (("prefill", prefills), ("decode", decodes)))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.state.prefills, app.state.decodes, app.state.metrics = prefills, decodes, metrics
    return app


def _named(answer: httpx.Response | None, otherwise: str) -> str:
    """The error code and message of a worker's 5xx answer."""
    if answer is None:
        return otherwise
    try:
        detail = answer.json()["error"]
        return f"{detail.get('code')}: {detail.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"status {answer.status_code}"


def _labelled(text: bytes, role: str) -> bytes:
    """A pool's router metrics with each name prefixed by its role (router_ -> prefill_router_)."""
    return text.replace(b"router_", f"{role}_router_".encode())


class Deployment:
    """A disaggregated deployment on this machine: `prefill` and `decode` workers (launch.Launched)
    and the `front` (its `url` takes the OpenAI API). `stop()` stops them all."""

    def __init__(self, front, prefill: list, decode: list):
        self.front, self.prefill, self.decode = front, prefill, decode

    @property
    def url(self) -> str:
        return self.front.url

    def stop(self) -> None:
        for each in [self.front, *self.decode, *self.prefill]:
            each.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def deploy(prefill: int = 1, decode: int = 1, transport: str = "gloo", serve_args: list[str] = (),
           threads: int | None = 1, kv_timeout_s: float = 30.0, route_args: list[str] = ()) -> Deployment:
    """Start `prefill` + `decode` workers (`infra-lab serve --kv-role ...`, each with `threads`
    kernel threads and `serve_args`) and the front (`infra-lab route --prefill ... --decode ...`).
    Over gloo, ranks 0.. are the prefill workers, then the decode workers."""
    import socket

    from infra_lab.orchestration import launch

    if prefill < 1 or decode < 1:
        raise ValueError(f"a deployment needs at least one prefill and one decode worker; got {prefill} and {decode}")
    with socket.socket() as probe:  # a free port for the gloo store (rank 0 binds it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    commands = []
    for rank in range(prefill + decode):
        role = "prefill" if rank < prefill else "decode"
        args = [*serve_args, "--kv-role", role, "--kv-transport", transport, "--kv-timeout", str(kv_timeout_s)]
        if transport == "gloo":
            args += ["--kv-rank", str(rank), "--kv-world", str(prefill + decode), "--kv-master", f"127.0.0.1:{port}"]
        commands.append(("serve", args))
    workers = launch.start_together(commands, threads=threads)
    try:
        front = launch.start("route", [*route_args, *(a for w in workers[:prefill] for a in ("--prefill", w.url)),
                                       *(a for w in workers[prefill:] for a in ("--decode", w.url))])
    except RuntimeError:
        for worker in workers:
            worker.kill()
        raise
    return Deployment(front, workers[:prefill], workers[prefill:])
