"""loadgen against a fake OpenAI-compatible server run in this process (FastAPI + uvicorn in a
thread): for every request it streams one 1-token chunk at once, then two chunks of 10 tokens
`gap_s` apart, with usage (21 completion tokens) in the last one, so TPOT = 2 gap_s / 20 and
ITL = gap_s. It counts the streams in flight, and answers 500 or 429 to prompts that ask for it."""
import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest

from infra_lab import cli
from infra_lab.orchestration import bench_metrics, launch, loadgen
from infra_lab.orchestration.loadgen import BenchRequest

FAST_GAP_S = 0.2
UNIT_S = 0.2  # the slow test's unit of time: its chunks come 10 units apart


class FakeServer:
    """An OpenAI-compatible streaming server on 127.0.0.1 with a free port, in a thread."""

    def __init__(self, gap_s: float):
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        self.gap_s, self.active, self.most_active, self.bodies, self.auth = gap_s, 0, 0, [], []
        app = FastAPI()

        async def answer(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            self.auth.append(request.headers.get("authorization"))
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            if prompt.startswith("fail-500"):
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if prompt.startswith("fail-429"):
                return JSONResponse({"error": {"message": "queue full"}}, status_code=429,
                                    headers={"Retry-After": "1"})
            if prompt.startswith("cut-short"):
                return StreamingResponse(iter([self.chunk("a", chat)]), media_type="text/event-stream")
            if prompt.startswith("bad-usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 5}}
                return StreamingResponse(iter([self.chunk("a", chat, usage), "data: [DONE]\n\n"]),
                                         media_type="text/event-stream")
            return StreamingResponse(self.events(chat), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await answer(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await answer(request, chat=True)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)

    def chunk(self, text: str, chat: bool, usage: dict | None = None) -> str:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        event = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}
        if usage:
            event["usage"] = usage
        return f"data: {json.dumps(event)}\n\n"

    async def events(self, chat: bool):
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            yield self.chunk("a", chat)
            await asyncio.sleep(self.gap_s)
            yield self.chunk("b" * 10, chat)
            await asyncio.sleep(self.gap_s)
            usage = {"prompt_tokens": 8, "completion_tokens": 21, "total_tokens": 29,
                     "prompt_tokens_details": {"cached_tokens": 2}}
            yield self.chunk("c" * 10, chat, usage)
        finally:
            self.active -= 1  # before [DONE], so a client that has read [DONE] sees this stream ended
        yield "data: [DONE]\n\n"

    def reset(self) -> None:
        self.most_active, self.bodies, self.auth = 0, [], []

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake():
    server = FakeServer(FAST_GAP_S)
    yield server
    server.stop()


@pytest.fixture
def server(fake):
    fake.reset()
    return fake


def requests(n: int, prompt: str = "def f():", max_tokens: int = 21) -> list[BenchRequest]:
    return [BenchRequest(prompt, max_tokens, len(prompt))] * n


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# ---- TPOT and ITL over HTTP ------------------------------------------------------------------------

def test_tpot_is_1_unit_and_itl_is_10_units_with_10_token_chunks_every_10_units():
    """Absolute times, to 1%: chunks of 10 tokens UNIT_S * 10 apart give a TPOT of one unit and
    an ITL of ten. A unit of 0.2 s leaves 20 ms of slack on each gap; beside 4 busy processes
    the means came within 0.2% (at 0.1 s units too), so a longer wait would prove nothing more."""
    slow = FakeServer(gap_s=10 * UNIT_S)
    try:
        traces, _ = loadgen.run(slow.url, "fake", requests(3))
    finally:
        slow.stop()
    m = bench_metrics.compute(traces, 20 * UNIT_S)
    assert m["completed"] == 3 and m["total_output_tokens"] == 63
    assert m["mean_tpot_ms"] == pytest.approx(UNIT_S * 1000, rel=0.01)
    assert m["mean_itl_ms"] == pytest.approx(10 * UNIT_S * 1000, rel=0.01)


@pytest.mark.parametrize("endpoint", loadgen.ENDPOINTS)
def test_itl_is_ten_tpots_with_10_token_chunks(server, endpoint):
    traces, duration_s = loadgen.run(server.url, "fake", requests(4), endpoint=endpoint)
    m = bench_metrics.compute(traces, duration_s)
    assert m["completed"] == 4 and m["failed"] == 0
    assert (m["total_output_tokens"], m["total_input_tokens"], m["total_cached_tokens"]) == (84, 32, 8)
    # ITL pools 2 gaps a request, TPOT spreads the same 2 gaps over 20 tokens: the ratio is exactly 10
    assert m["mean_itl_ms"] / m["mean_tpot_ms"] == pytest.approx(10, rel=1e-9)
    assert 0.9 * FAST_GAP_S * 1000 <= m["mean_itl_ms"] < FAST_GAP_S * 1000 + 1000  # loose: any machine
    assert m["mean_ttft_ms"] < m["mean_itl_ms"]
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["ignore_eos"], body["temperature"], body["max_tokens"], body["model"]) == (True, 0, 21, "fake")
    assert ("messages" in body) == (endpoint == "/v1/chat/completions")


def test_sync_run_works_inside_a_running_event_loop(server):
    async def notebook_cell():
        return loadgen.run(server.url, "fake", requests(2))

    traces, _ = asyncio.run(notebook_cell())
    assert [t.success for t in traces] == [True, True]


# ---- arrivals and concurrency ----------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_are_gamma_with_mean_1_over_rate_and_shape_burstiness(burstiness):
    arrivals = loadgen.arrival_times_s(50_000, rate_per_s=4.0, burstiness=burstiness, seed=0)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.mean() ** 2 / gaps.var() == pytest.approx(burstiness, rel=0.05)  # a gamma's shape
    assert np.array_equal(arrivals, loadgen.arrival_times_s(50_000, 4.0, burstiness, seed=0))
    assert not np.array_equal(arrivals, loadgen.arrival_times_s(50_000, 4.0, burstiness, seed=1))


def test_infinite_rate_sends_all_at_once(server):
    assert np.array_equal(loadgen.arrival_times_s(5, math.inf), np.zeros(5))
    traces, _ = loadgen.run(server.url, "fake", requests(6))
    assert server.most_active == 6
    sends = [t.send_s for t in traces]
    assert max(sends) - min(sends) < FAST_GAP_S  # all sent before the first one's second chunk


def test_requests_wait_for_their_arrival(server):
    traces, duration_s = loadgen.run(server.url, "fake", requests(4), rate_per_s=10.0, seed=3)
    arrivals = loadgen.arrival_times_s(4, 10.0, seed=3)
    assert duration_s >= 0.95 * (arrivals[-1] + 2 * FAST_GAP_S)
    sends = np.array([t.send_s for t in traces])
    assert np.all(sends - sends[0] >= arrivals - 0.05)  # never early (50 ms for a late first send)


@pytest.mark.parametrize("cap", [1, 3])
def test_max_concurrency_is_never_exceeded(server, cap):
    traces, duration_s = loadgen.run(server.url, "fake", requests(7), max_concurrency=cap)
    assert all(t.success for t in traces)
    assert server.most_active == cap
    assert duration_s >= 0.95 * math.ceil(7 / cap) * 2 * FAST_GAP_S


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="burstiness.*-1"):
        loadgen.arrival_times_s(3, 1.0, burstiness=-1)
    with pytest.raises(ValueError, match="rate_per_s.*0"):
        loadgen.arrival_times_s(3, 0.0)
    with pytest.raises(ValueError, match="'/v1/embeddings'"):
        loadgen.run("http://127.0.0.1:1", "m", requests(1), endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="max_concurrency.*0"):
        loadgen.run("http://127.0.0.1:1", "m", requests(1), max_concurrency=0)


# ---- failures -------------------------------------------------------------------------------------

def test_failed_requests_are_counted_with_their_status(server):
    batch = requests(2) + requests(1, "fail-500") + requests(2, "fail-429")
    traces, duration_s = loadgen.run(server.url, "fake", batch)
    assert [t.status for t in traces] == [200, 200, 500, 429, 429]
    assert [t.success for t in traces] == [True, True, False, False, False]
    assert "boom" in traces[2].error and "queue full" in traces[3].error
    m = bench_metrics.compute(traces, duration_s)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 3, 42)


def test_a_stream_cut_short_or_with_unusable_usage_fails(server):
    traces, _ = loadgen.run(server.url, "fake", requests(1, "cut-short") + requests(1, "bad-usage"))
    assert [t.success for t in traces] == [False, False]
    assert "[DONE]" in traces[0].error and "cached_tokens=5" in traces[1].error


def test_an_unreachable_server_fails_each_request_naming_the_url():
    url = closed_port_url()
    traces, _ = loadgen.run(url, "fake", requests(2), timeout_s=10)
    assert [t.success for t in traces] == [False, False]
    assert all(t.status is None and url in t.error for t in traces)


# ---- workloads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", loadgen.WORKLOADS)
def test_workloads_fit_the_context_and_repeat_with_the_seed(name):
    batch = loadgen.workload(name, 20, seed=1, max_len=256)
    assert len(batch) == 20 and batch == loadgen.workload(name, 20, seed=1, max_len=256)
    assert batch != loadgen.workload(name, 20, seed=2, max_len=256)
    assert all(r.prompt and 1 <= r.max_tokens and r.prompt_bytes + r.max_tokens <= 256 for r in batch)
    fixed = loadgen.workload(name, 20, seed=1, max_len=256, max_tokens=100)
    assert all(r.max_tokens == 100 and r.prompt_bytes + 100 <= 256 for r in fixed)


def test_shared_prefix_prompts_share_openings():
    batch = loadgen.workload("shared-prefix", 12, seed=0)
    openings = {r.prompt[:64] for r in batch}
    assert len(openings) <= 3


@pytest.mark.parametrize("kwargs, named", [
    (dict(name="alpaca"), "'alpaca'.*sharegpt, shared-prefix"),
    (dict(max_tokens=512), "max_tokens.*512"),
    (dict(name="shared-prefix", max_len=100), "max_len=100"),
])
def test_bad_workload_names_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        loadgen.workload(**{"name": "sharegpt", "n": 3, **kwargs})


# ---- the command ----------------------------------------------------------------------------------

def test_cli_writes_the_result_json(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    status = cli.main(["bench", "serve", "--base-url", server.url, "--model", "fake", "--num-prompts", "5",
                       "--request-rate", "50", "--burstiness", "2", "--max-concurrency", "4", "--seed", "7",
                       "--goodput", "ttft:5000", "tpot:1", "--percentiles", "50,99.9", "--no-progress",
                       "--result-json", str(out), "--api-key", "secret"])
    assert status == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Mean TPOT (ms):" in table and "P99.9 ITL (ms):" in table
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert (settings["num_prompts"], settings["request_rate"], settings["max_concurrency"]) == (5, 50.0, 4)
    assert settings["goodput"] == ["ttft:5000", "tpot:1"] and settings["workload"] == "sharegpt"
    assert {"platform", "cpu", "cores", "python", "date_utc"} <= set(result["machine"])
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (5, 0, 105)
    assert metrics["request_goodput"] == 0  # no request has TPOT <= 1 ms
    assert "p99.9_itl_ms" in metrics and "median_e2el_ms" in metrics
    assert len(result["requests"]) == 5 and len(result["requests"][0]["itl_ms"]) == 2
    assert server.most_active <= 4
    assert set(server.auth) == {"Bearer secret"}


def test_cli_returns_1_when_every_request_fails(tmp_path, capsys):
    url = closed_port_url()
    status = cli.main(["bench", "serve", "--base-url", url, "--model", "fake", "--num-prompts", "2",
                       "--no-progress", "--timeout", "10", "--result-json", str(tmp_path / "r.json")])
    assert status == 1
    assert url in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["request_rate"] == "inf"


def test_cli_names_a_bad_goodput(capsys):
    assert cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "m",
                     "--goodput", "latency:5"]) == 2
    assert "'latency'" in capsys.readouterr().err


# ---- the book's own server --------------------------------------------------------------------------

@pytest.mark.slow
def test_against_the_books_server():
    pytest.importorskip("infra_lab.orchestration.server")
    with launch.start("serve", ["--model", "target"], threads=1) as served:
        traces, duration_s = loadgen.run(served.url, "target", loadgen.workload("sharegpt", 3, max_tokens=8))
    m = bench_metrics.compute(traces, duration_s)
    assert m["completed"] == 3, [t.error for t in traces]
    assert m["total_output_tokens"] == 24 and m["total_input_tokens"] > 0
