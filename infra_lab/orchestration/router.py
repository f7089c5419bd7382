"""`infra-lab route`: an OpenAI-compatible HTTP proxy over several OpenAI-compatible servers, as
SGLang's router (sgl-router) stands in front of its workers: a `Policy` picks the worker, tenants
are held to their quotas, requests wait by priority when every worker is full, and workers that
fail their health probes leave the rotation until they answer again.

Responses stream through chunk by chunk; a client that goes away closes the upstream stream, so
the worker aborts the request. A request that fails before its first byte (no connection, or a
5xx status) is retried once on another worker; once bytes have flowed, a failure reaches the
client as it happened. Every response comes from exactly one worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from infra_lab.orchestration.openai_api import ApiError
from infra_lab.orchestration.policies import POLICIES, CacheAware, LeastOutstanding, Policy, Worker
from infra_lab.orchestration.tenants import PriorityGate, Tenants, token_cost

PASSED_HEADERS = ("content-type", "cache-control")  # of a worker's response, back to the client


@dataclass
class RouterSettings:
    worker_slots: int = 64  # requests in flight per worker; more wait in the router, by priority
    health_interval_s: float = 1.0  # between health probes of every worker
    health_timeout_s: float = 5.0  # a probe slower than this fails
    admin_key: str | None = None  # what /admin demands as `Authorization: Bearer KEY` (None: /admin is off)
    drain_timeout_s: float = 30.0  # how long removing a worker waits for its requests in flight
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # the longest wait for a worker's next bytes


def error(status: int, message: str, kind: str, code: str | None = None, headers: dict | None = None):
    """A response carrying OpenAI's error object (the server's own, openai_api.ApiError)."""
    return JSONResponse(ApiError(status, message, code=code, kind=kind).body(), status_code=status, headers=headers)


def prompt_text(path: str, body: dict) -> str:
    """The text a cache-aware policy matches: a completion's prompt (a list of prompts joined by
    newlines; token ids as numbers), or a chat's message contents joined by newlines."""
    def text_of(value) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "\n".join(text_of(v) for v in value)
        if isinstance(value, dict):  # a chat content part: {"type": "text", "text": ...}
            return text_of(value.get("text", ""))
        return "" if value is None else str(value)

    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return "\n".join(text_of(m.get("content")) for m in messages if isinstance(m, dict)) \
            if isinstance(messages, list) else ""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt))
    return text_of(prompt)


class RouterMetrics:
    """Counters per worker and per tenant, and gauges read from the router's state when scraped."""

    def __init__(self, router: Router):
        self.registry = CollectorRegistry()
        counter = lambda name, text, label: Counter(name, text, [label], registry=self.registry)  # noqa: E731
        self.worker_requests = counter("router_worker_requests", "Requests sent to a worker", "worker")
        self.worker_failures = counter("router_worker_failures", "Requests a worker failed (no answer, or 5xx)",
                                       "worker")
        self.worker_retries = counter("router_worker_retries", "Requests retried elsewhere after the worker failed "
                                      "before its first byte", "worker")
        self.worker_rate_limited = counter("router_worker_rate_limited", "429 answers from a worker", "worker")
        self.tenant_requests = counter("router_tenant_requests", "Requests received from a tenant", "tenant")
        self.tenant_failures = counter("router_tenant_failures", "A tenant's requests that failed", "tenant")
        self.tenant_retries = counter("router_tenant_retries", "A tenant's requests retried on another worker",
                                      "tenant")
        self.tenant_rate_limited = counter("router_tenant_rate_limited", "A tenant's requests refused over quota "
                                           "(429)", "tenant")
        self.registry.register(_StateCollector(router))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        outstanding = GaugeMetricFamily("router_worker_outstanding", "Requests in flight at a worker",
                                        labels=["worker"])
        healthy = GaugeMetricFamily("router_worker_healthy", "1 if the worker is in the rotation", labels=["worker"])
        for worker in self.router.workers.values():
            outstanding.add_metric([worker.url], worker.outstanding)
            healthy.add_metric([worker.url], float(worker.healthy and not worker.draining))
        yield outstanding
        yield healthy
        yield GaugeMetricFamily("router_waiting", "Requests waiting in the router for a worker slot",
                                value=self.router.gate.waiting)


class Router:
    """The router's state: its workers, policy, tenants and the priority gate."""

    def __init__(self, worker_urls: list[str], policy: Policy, tenants: Tenants, settings: RouterSettings):
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        self.workers: dict[str, Worker] = {}
        for url in worker_urls:
            url = url.rstrip("/")
            if url in self.workers:
                raise ValueError(f"worker {url} is listed twice")
            self.workers[url] = Worker(url)
        self.policy, self.tenants, self.settings = policy, tenants, settings
        self.gate = PriorityGate(self.free_slots)
        self.metrics = RouterMetrics(self)
        self.client: httpx.AsyncClient | None = None

    def routable(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy and not w.draining]

    def with_free_slot(self, exclude: Worker | None = None) -> list[Worker]:
        return [w for w in self.routable() if w.outstanding < self.settings.worker_slots and w is not exclude]

    def free_slots(self) -> int:
        return sum(max(0, self.settings.worker_slots - w.outstanding) for w in self.routable())

    def set_health(self, worker: Worker, healthy: bool) -> None:
        if healthy != worker.healthy:
            worker.healthy = healthy
            if healthy:
                self.gate.release()

    async def probe(self, url: str) -> bool:
        try:
            answer = await self.client.get(f"{url}/health", timeout=self.settings.health_timeout_s)
            return answer.status_code == 200
        except httpx.HTTPError:
            return False

    async def health_loop(self) -> None:
        while True:
            workers = list(self.workers.values())
            results = await asyncio.gather(*(self.probe(w.url) for w in workers))
            for worker, ok in zip(workers, results):
                self.set_health(worker, ok)
            await asyncio.sleep(self.settings.health_interval_s)

    def take(self, worker: Worker, text: str) -> None:
        worker.outstanding += 1
        self.policy.routed(text, worker)

    def give_back(self, worker: Worker, text: str, ok: bool) -> None:
        worker.outstanding -= 1
        self.policy.finished(text, worker, ok)
        self.gate.release()

    async def send(self, worker: Worker, path: str, content: bytes):
        """POST to `worker`: the response, its chunks, and the first of them (None: no body)."""
        request = self.client.build_request("POST", worker.url + path, content=content,
                                            headers={"content-type": "application/json"})
        response = await self.client.send(request, stream=True)
        try:
            chunks = response.aiter_raw()
            first = await anext(chunks, None)
        except BaseException:
            await response.aclose()
            raise
        return response, chunks, first


def create_app(worker_urls: list[str], policy: Policy, tenants: Tenants | None = None,
               settings: RouterSettings | None = None, on_started: Callable[[], None] | None = None) -> FastAPI:
    """The router as a FastAPI app: any `Policy` instance routes (a student's too). `on_started`
    runs once the app takes requests (the CLI announces its address there)."""
    router = Router(worker_urls, policy, tenants or Tenants(), settings or RouterSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        s = router.settings
        timeout = httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            router.client = client
            health = asyncio.create_task(router.health_loop())
            if on_started is not None:
                on_started()
            try:
                yield
            finally:
                health.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health

    app = FastAPI(title="infra-lab router", lifespan=lifespan)
    app.state.router = router

    async def proxy(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the request body is not valid JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, f"the request body must be a JSON object; got {type(body).__name__}",
                         "invalid_request_error")
        text = prompt_text(path, body)
        tenant = router.tenants.identify(request.headers.get("authorization"), body.get("user"))
        m = router.metrics
        m.tenant_requests.labels(tenant).inc()
        wait_s = router.tenants.admit(tenant, token_cost(body, text))
        if wait_s > 0:
            m.tenant_rate_limited.labels(tenant).inc()
            retry_after = str(max(1, math.ceil(wait_s))) if math.isfinite(wait_s) else "3600"
            return error(429, f"tenant {tenant} is over its quota; retry after {wait_s:.2f} s",
                         "rate_limit_exceeded", "rate_limit_exceeded", headers={"Retry-After": retry_after})
        while True:
            if not router.routable():
                m.tenant_failures.labels(tenant).inc()
                return error(503, "no healthy worker", "service_unavailable", "no_healthy_worker")
            await router.gate.acquire(router.tenants.priority(tenant))
            candidates = router.with_free_slot()
            if candidates:
                break
            router.gate.release()  # the slot vanished with its worker: wait again
        worker = router.policy.choose(text, candidates)
        router.take(worker, text)
        for attempt in (0, 1):
            m.worker_requests.labels(worker.url).inc()
            failure = None
            try:
                response, rest, first = await router.send(worker, path, raw)
            except httpx.HTTPError as exc:
                router.set_health(worker, False)
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 429:
                    m.worker_rate_limited.labels(worker.url).inc()
                if response.status_code < 500:
                    return _relay(router, worker, text, tenant, response, rest, first)
                await response.aclose()
                failure = f"status {response.status_code}"
            m.worker_failures.labels(worker.url).inc()
            router.give_back(worker, text, ok=False)
            others = router.with_free_slot(exclude=worker) or [w for w in router.routable() if w is not worker]
            if attempt == 1 or not others:
                m.tenant_failures.labels(tenant).inc()
                return error(502, f"worker {worker.url} failed before answering ({failure})", "server_error",
                             "worker_failed")
            m.worker_retries.labels(worker.url).inc()
            m.tenant_retries.labels(tenant).inc()
            worker = router.policy.choose(text, others)
            router.take(worker, text)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        for worker in router.routable():
            try:
                answer = await router.client.get(worker.url + "/v1/models", timeout=router.settings.health_timeout_s)
            except httpx.HTTPError:
                router.set_health(worker, False)
                continue
            if answer.status_code == 200:
                return Response(answer.content, media_type="application/json")
        return error(503, "no healthy worker", "service_unavailable", "no_healthy_worker")

    @app.get("/health")
    async def health():
        healthy = len(router.routable())
        return JSONResponse({"status": "ok" if healthy else "no healthy worker", "healthy_workers": healthy},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def refused(request: Request):
        key = router.settings.admin_key
        if key is None:
            return error(403, "the admin endpoints are off: start the router with --admin-key",
                         "invalid_request_error", "admin_off")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return error(401, "the admin endpoints need 'Authorization: Bearer ADMIN_KEY'",
                         "invalid_request_error", "invalid_admin_key")
        return None

    def listing(worker: Worker) -> dict:
        return {"url": worker.url, "healthy": worker.healthy, "draining": worker.draining,
                "outstanding": worker.outstanding}

    async def worker_url(request: Request) -> str | None:
        url = request.query_params.get("url")
        if url is None:
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                body = json.loads(await request.body() or b"{}")
                url = body.get("url") if isinstance(body, dict) else None
        return url.rstrip("/") if isinstance(url, str) and url else None

    @app.get("/admin/workers")
    async def list_workers(request: Request):
        return refused(request) or {"workers": [listing(w) for w in router.workers.values()]}

    @app.post("/admin/workers")
    async def add_worker(request: Request):
        if (refusal := refused(request)) is not None:
            return refusal
        url = await worker_url(request)
        if url is None or not url.startswith(("http://", "https://")):
            return error(400, f"give the worker as {{\"url\": \"http://HOST:PORT\"}}; got {url!r}",
                         "invalid_request_error", "bad_url")
        if url in router.workers:
            return error(409, f"worker {url} is already in the router", "invalid_request_error", "worker_exists")
        if not await router.probe(url):
            return error(502, f"worker {url} did not answer GET /health with 200; not added",
                         "invalid_request_error", "worker_unhealthy")
        router.workers[url] = worker = Worker(url)
        router.gate.release()
        return JSONResponse(listing(worker), status_code=201)

    @app.delete("/admin/workers")
    async def remove_worker(request: Request):
        if (refusal := refused(request)) is not None:
            return refusal
        url = await worker_url(request)
        worker = router.workers.get(url)
        if worker is None or worker.draining:
            return error(404, f"no worker {url} in the router; it has {sorted(router.workers)}",
                         "invalid_request_error", "no_such_worker")
        timeout_s = float(request.query_params.get("timeout_s", router.settings.drain_timeout_s))
        worker.draining = True
        start = time.monotonic()
        while worker.outstanding and time.monotonic() - start < timeout_s:
            await asyncio.sleep(0.02)
        del router.workers[url]
        router.policy.removed(worker)
        return {"url": url, "drained": worker.outstanding == 0, "waited_s": time.monotonic() - start,
                "still_in_flight": worker.outstanding}

    return app


def _relay(router: Router, worker: Worker, text: str, tenant: str, response: httpx.Response, rest,
           first: bytes | None, error_event: bool = False) -> Response:
    """Stream `response` to the client as it comes; when it ends (or the client leaves), close
    the upstream stream and hand the worker's slot back. With `error_event`, a stream that breaks
    mid-way ends with an SSE error event naming the worker (else the client's connection breaks)."""
    done = []

    async def close(ok: bool) -> None:
        if not done:
            done.append(True)
            await response.aclose()
            if not ok:
                router.metrics.worker_failures.labels(worker.url).inc()
                router.metrics.tenant_failures.labels(tenant).inc()
            router.give_back(worker, text, ok)

    async def chunks():
        if first is not None:
            yield first
        try:
            async for chunk in rest:
                yield chunk
        except httpx.HTTPError as exc:
            await close(ok=False)
            if not (error_event and response.headers.get("content-type", "").startswith("text/event-stream")):
                raise
            failure = ApiError(502, f"worker {worker.url} failed mid-stream ({type(exc).__name__})",
                               code="worker_failed", kind="server_error")
            yield f"\n\ndata: {json.dumps(failure.body())}\n\n".encode()
            return
        await close(ok=True)

    headers = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
    return _Relayed(chunks(), close, status_code=response.status_code, headers=headers)


class _Relayed(StreamingResponse):
    """A StreamingResponse that stops as soon as the client leaves (not at the next chunk) and
    always runs `close`, even if the client left before the first chunk."""

    def __init__(self, content, close, **kwargs):
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope, receive, send):
        async def until_disconnect():
            while (await receive())["type"] != "http.disconnect":
                pass

        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(until_disconnect())
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            await self._close(ok=True)
        failure = None if stream.cancelled() else stream.exception()
        if failure is not None and not isinstance(failure, OSError):  # OSError: the client left
            raise failure  # the worker broke mid-stream: the client sees the connection break


def policy_from_args(args) -> Policy:
    cls = POLICIES[args.policy]
    if cls is CacheAware:
        return CacheAware(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                          args.max_tree_chars)
    if cls is LeastOutstanding:
        return LeastOutstanding(seed=0)
    return cls()
