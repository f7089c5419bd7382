"""The router over small fake OpenAI-compatible workers (FastAPI in uvicorn threads on free ports):
routing, streaming, retries, quotas, priorities, admin, health, metrics and a rolling update."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from infra_lab.orchestration import launch, rolling
from infra_lab.orchestration.policies import CacheAware, LeastOutstanding, RoundRobin
from infra_lab.orchestration.router import RouterSettings, create_app
from infra_lab.orchestration.tenants import Tenants

WAIT_S = 20.0  # the most any wait below takes; a loaded machine is slow, never this slow


def until(condition, timeout_s=WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


class Served:
    """An ASGI app in a uvicorn thread on a free port of 127.0.0.1."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        until(lambda: self.server.started)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(WAIT_S)


class FakeWorker(Served):
    """Answers completions with its name. Prompts steer it: "hold" waits for `release`, "break"
    streams one chunk and drops the connection, "long" streams until the client leaves."""

    def __init__(self, name, chunks=3, chunk_delay_s=0.0):
        self.name, self.prompts, self.healthy, self.fail_status = name, [], True, None
        self.release, self.aborted, self.finished_at = threading.Event(), threading.Event(), []
        self.cached_tokens = {}
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.name}]}

        async def complete(request: Request):
            body = await request.json()
            text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
            self.prompts.append(text)
            if self.fail_status:
                return JSONResponse({"error": {"message": "boom"}}, status_code=self.fail_status)
            while text == "hold" and not self.release.is_set():
                await asyncio.sleep(0.01)
            if not body.get("stream"):
                return {"object": "text_completion", "worker": self.name, "choices": [{"text": self.name}]}

            async def events():
                finished = False
                try:
                    i = 0
                    while i < chunks or text == "long":
                        if await request.is_disconnected():
                            return
                        yield f"data: {json.dumps({'worker': self.name, 'choices': [{'text': str(i)}]})}\n\n"
                        if text == "break":
                            raise RuntimeError("the worker dies mid-stream")
                        await asyncio.sleep(chunk_delay_s if text != "long" else 0.05)
                        i += 1
                    yield "data: [DONE]\n\n"
                    finished = True
                    self.finished_at.append(time.monotonic())
                finally:
                    if not finished:
                        self.aborted.set()

            return StreamingResponse(events(), media_type="text/event-stream")

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)
        super().__init__(app)


@pytest.fixture
def fleet():
    """`fleet(n, policy=..., tenants=..., **settings)`: n fake workers behind a router in this process."""
    started = []

    def make(n, policy=None, tenants=None, **settings):
        workers = [FakeWorker(f"w{i}", **settings.pop("worker_options", {})) for i in range(n)]
        settings.setdefault("health_interval_s", 0.1)
        app = create_app([w.url for w in workers], policy or RoundRobin(), tenants, RouterSettings(**settings))
        router = Served(app)
        started.extend([router, *workers])
        return router, workers, app.state.router

    yield make
    for served in started:
        served.stop()


def complete(url, prompt, key=None, stream=False, **body):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": prompt, "stream": stream, **body},
                      headers=headers, timeout=WAIT_S)


def metric(url, name, **labels):
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_round_robin_takes_turns_and_cache_aware_keeps_a_prefix_on_one_worker(fleet):
    router, workers, _ = fleet(2)
    assert [complete(router.url, f"q{i}").json()["worker"] for i in range(4)] == ["w0", "w1", "w0", "w1"]
    router, workers, _ = fleet(3, policy=CacheAware())
    system = "You are a helpful assistant who answers briefly. "
    answered = {complete(router.url, system + q).json()["worker"] for q in ["a?", "b?", "c?", "d?"]}
    assert len(answered) == 1
    chat = httpx.post(f"{router.url}/v1/chat/completions", timeout=WAIT_S,
                      json={"model": "fake", "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": "hi"}]})
    assert chat.json()["worker"] in answered


def test_least_outstanding_avoids_the_busy_worker(fleet):
    router, workers, state = fleet(2, policy=LeastOutstanding(seed=0))
    hold = threading.Thread(target=complete, args=(router.url, "hold"))
    hold.start()
    until(lambda: any(w.prompts == ["hold"] for w in workers))  # the router counts it before it arrives
    assert sum(w.outstanding for w in state.workers.values()) == 1
    busy = next(w for w in workers if w.prompts == ["hold"])
    for i in range(6):
        assert complete(router.url, f"q{i}").json()["worker"] != busy.name
    busy.release.set()
    hold.join()


def test_a_stream_passes_through_chunk_by_chunk(fleet):
    router, workers, _ = fleet(1, worker_options={"chunks": 5, "chunk_delay_s": 0.3})
    events, first_at = [], None
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=WAIT_S,
                      json={"model": "fake", "prompt": "x", "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                first_at = first_at or time.monotonic()
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["0", "1", "2", "3", "4"]
    assert first_at < workers[0].finished_at[0], "the first chunk arrived before the worker had finished"


def test_a_client_that_leaves_closes_the_upstream_stream(fleet):
    router, workers, state = fleet(1)
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=WAIT_S,
                      json={"model": "fake", "prompt": "long", "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    until(workers[0].aborted.is_set)
    until(lambda: state.workers[workers[0].url].outstanding == 0)


def test_a_failure_before_the_first_byte_is_retried_once_on_another_worker(fleet):
    router, workers, state = fleet(2, health_interval_s=3600)  # one probe at start, then none
    until(lambda: all(w.healthy for w in state.workers.values()))
    workers[0].stop()  # dies: no connection; the router finds out from a request
    answers = [complete(router.url, f"q{i}", stream=i % 2 == 1) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert all("w1" in a.text for a in answers)
    assert metric(router.url, "router_worker_retries_total", worker=workers[0].url) == 1
    assert state.workers[workers[0].url].healthy is False
    workers[1].fail_status = 500  # both broken now: one retry, then the client hears of it
    answer = complete(router.url, "q")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "worker_failed"


def test_a_5xx_is_retried_but_a_failure_mid_stream_reaches_the_client(fleet):
    router, workers, _ = fleet(2)
    workers[0].fail_status = 500
    assert {complete(router.url, f"q{i}").json()["worker"] for i in range(4)} == {"w1"}
    workers[0].fail_status = None
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=WAIT_S,
                          json={"model": "fake", "prompt": "break", "stream": True}) as response:
            list(response.iter_lines())
    assert sum(w.prompts.count("break") for w in workers) == 1, "no retry once bytes have flowed"


def test_a_tenant_over_quota_gets_429_with_retry_after_and_others_go_on(fleet):
    tenants = Tenants.from_json({"tenants": [
        {"name": "small", "api_key": "sk-small", "requests_per_s": 0.01, "request_burst": 2},
        {"name": "big", "api_key": "sk-big", "requests_per_s": 1000, "request_burst": 1000}]})
    router, workers, _ = fleet(1, tenants=tenants)
    assert [complete(router.url, "x", key="sk-small").status_code for _ in range(2)] == [200, 200]
    refused = complete(router.url, "x", key="sk-small")
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 90  # a whole request at 0.01 per second: 100 s
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert all(complete(router.url, "x", key="sk-big").status_code == 200 for _ in range(5))
    assert len(workers[0].prompts) == 7, "the refused request never reached a worker"
    assert metric(router.url, "router_tenant_rate_limited_total", tenant="small") == 1
    assert metric(router.url, "router_tenant_rate_limited_total", tenant="big") == 0


def test_when_every_worker_is_full_requests_wait_by_priority(fleet):
    tenants = Tenants.from_json({"tenants": [{"name": "gold", "api_key": "sk-gold", "priority": 10},
                                             {"name": "free", "api_key": "sk-free", "priority": 0}]})
    router, workers, state = fleet(1, tenants=tenants, worker_slots=1)
    threads = [threading.Thread(target=complete, args=(router.url, "hold"), kwargs={"key": "sk-free"})]
    threads[0].start()
    until(lambda: workers[0].prompts == ["hold"])
    for i, key in enumerate(["sk-free", "sk-free", "sk-gold", "sk-gold"]):
        threads.append(threading.Thread(target=complete, args=(router.url, f"{key}-{i}"), kwargs={"key": key}))
        threads[-1].start()
        until(lambda: state.gate.waiting == i + 1)
    assert metric(router.url, "router_waiting") == 4
    workers[0].release.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert workers[0].prompts == ["hold", "sk-gold-2", "sk-gold-3", "sk-free-0", "sk-free-1"]


def test_bad_json_is_400_and_no_healthy_worker_is_503(fleet):
    router, workers, state = fleet(1)
    bad = httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=WAIT_S)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"] == "fake"
    workers[0].healthy = False
    until(lambda: not state.workers[workers[0].url].healthy)
    assert complete(router.url, "x").status_code == 503
    assert httpx.get(f"{router.url}/health").status_code == 503
    workers[0].healthy = True  # answers its probe again: back in the rotation
    until(lambda: state.workers[workers[0].url].healthy)
    assert complete(router.url, "x").status_code == 200


def test_admin_needs_the_key_checks_health_and_drains(fleet):
    router, workers, state = fleet(1, admin_key="sesame")
    admin = {"authorization": "Bearer sesame"}
    assert httpx.get(f"{router.url}/admin/workers").status_code == 401
    assert httpx.get(f"{router.url}/admin/workers", headers={"authorization": "Bearer wrong"}).status_code == 401
    spare = FakeWorker("spare")
    try:
        dead = Served(FastAPI())  # answers 404 to /health: not a worker
        refused = httpx.post(f"{router.url}/admin/workers", json={"url": dead.url}, headers=admin)
        dead.stop()
        assert refused.status_code == 502 and len(state.workers) == 1
        added = httpx.post(f"{router.url}/admin/workers", json={"url": spare.url}, headers=admin)
        assert added.status_code == 201
        assert {w["url"] for w in httpx.get(f"{router.url}/admin/workers", headers=admin).json()["workers"]} == \
            {workers[0].url, spare.url}
        hold = threading.Thread(target=complete, args=(router.url, "hold"))
        hold.start()
        # the router counts the request before the worker reads it: wait for the worker
        until(lambda: any(w.prompts == ["hold"] for w in (workers[0], spare)))
        held = next(w for w in (workers[0], spare) if w.prompts == ["hold"])
        assert state.workers[held.url].outstanding == 1
        removal = {}
        remover = threading.Thread(target=lambda: removal.update(httpx.request(
            "DELETE", f"{router.url}/admin/workers", params={"url": held.url}, headers=admin, timeout=WAIT_S).json()))
        remover.start()
        until(lambda: state.workers[held.url].draining)
        other = spare if held is workers[0] else workers[0]
        assert complete(router.url, "during the drain").json()["worker"] == other.name
        assert remover.is_alive(), "the removal waits for the request in flight"
        held.release.set()
        remover.join(WAIT_S)
        hold.join(WAIT_S)
        assert removal["drained"] is True and held.url not in state.workers
    finally:
        spare.stop()


def test_metrics_parse_with_per_worker_and_per_tenant_counts(fleet):
    router, workers, _ = fleet(2)
    for i in range(4):
        complete(router.url, f"q{i}", user="alice")
    for worker in workers:
        assert metric(router.url, "router_worker_requests_total", worker=worker.url) == 2
        assert metric(router.url, "router_worker_healthy", worker=worker.url) == 1
        assert metric(router.url, "router_worker_outstanding", worker=worker.url) == 0
    assert metric(router.url, "router_tenant_requests_total", tenant="user-alice") == 4


def test_a_rolling_update_swaps_a_worker_without_a_failed_request(fleet, monkeypatch):
    router, workers, state = fleet(1, admin_key="sesame")
    new = FakeWorker("new")

    class Old:
        url, stopped = workers[0].url, False

        def stop(self, timeout_s=30.0):
            Old.stopped = True
            return 0

    monkeypatch.setattr(rolling.launch, "start", lambda command, args, **kw: new)
    answers, stop = [], threading.Event()

    def traffic():
        while not stop.is_set():
            answers.append(complete(router.url, "x"))

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        started, timings = rolling.rolling_update(router.url, "sesame", Old(), ["--model", "target"])
        time.sleep(0.2)
    finally:
        stop.set()
        sender.join(WAIT_S)
        new.stop()
    assert started is new and Old.stopped and list(state.workers) == [new.url]
    assert all(a.status_code == 200 for a in answers)
    assert {a.json()["worker"] for a in answers} <= {"w0", "new"} and answers[-1].json()["worker"] == "new"
    assert set(timings) == {"start_s", "healthy_s", "add_s", "drain_s", "stop_s", "total_s"}


@pytest.mark.slow
def test_infra_lab_route_runs_as_a_command():
    worker = FakeWorker("w")
    try:
        with launch.start("route", ["--worker", worker.url, "--policy", "round-robin"], timeout_s=60) as router:
            assert complete(router.url, "hello").json()["worker"] == "w"
    finally:
        worker.stop()


def prefix_hit_rate(router_url, prompts):
    cached = total = 0
    for prompt in prompts:
        usage = complete(router_url, prompt, model="target", max_tokens=2, temperature=0).json()["usage"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        total += usage["prompt_tokens"]
    return cached / total


@pytest.mark.slow
def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin():
    """Chapter 05's shared-prefix workload over two real workers, once per policy (fresh workers
    each time): cache-aware routing sends a prefix back to the worker that cached it."""
    from infra_lab.serving import traffic

    requests = traffic.shared_prefix(20, rate_per_s=1.0, n_prefixes=10, max_tokens=2, seed=0)
    prompts = [bytes(r.prompt).decode("utf-8", errors="ignore") for r in requests]
    serve = ["--model", "target", "--prefix-cache", "radix", "--block-size", "1", "--num-blocks", "16384"]
    rates = {}
    for policy in ("round-robin", "cache-aware"):
        workers = [launch.start("serve", serve, threads=1) for _ in range(2)]
        try:
            args = [arg for w in workers for arg in ("--worker", w.url)] + ["--policy", policy]
            with launch.start("route", args, timeout_s=60) as router:
                rates[policy] = prefix_hit_rate(router.url, prompts)
        finally:
            for worker in workers:
                worker.stop()
    print(f"prefix hit rate: {rates}")
    assert rates["cache-aware"] >= 1.5 * rates["round-robin"], rates
