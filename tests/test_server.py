"""`infra-lab serve` as its users meet it: a real server process on 127.0.0.1, the official
`openai` client, raw HTTP for what the client hides (server-sent events, error objects, status
codes, headers), and /metrics read with prometheus_client's parser."""
from __future__ import annotations

import json
import time

import httpx
import numba
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from threadpoolctl import threadpool_limits

from infra_lab.orchestration import launch
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams

pytestmark = pytest.mark.slow  # a server process: about 5 s to start
MAX_N = 4
PROMPT = "def main(argv):\n    "


@pytest.fixture(scope="module")
def server():
    with launch.start("serve", ["--model", "target", "--max-n", str(MAX_N), "--admin-key", "secret"],
                      threads=1) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def engine_greedy(prompt: str, max_tokens: int) -> list[int]:
    """The engine's own greedy tokens for `prompt`, in this process on one thread, as the server runs."""
    from infra_lab.model.transformer import load

    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with threadpool_limits(1):
            engine = Engine(load("target"), EngineConfig(num_blocks=64))
            return engine.generate([prompt.encode()], SamplingParams(max_tokens=max_tokens))[0]
    finally:
        numba.set_num_threads(previous)


def sse_events(response: httpx.Response) -> list:
    """The data of each server-sent event, JSON-decoded, with '[DONE]' kept as is."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected line in the stream: {line!r}"
    return events


def metrics_of(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {sample.name + json.dumps({k: v for k, v in sample.labels.items() if k != "model_name"}, sort_keys=True):
            sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["target"]
    assert models[0].max_model_len == 512


def test_greedy_completion_plain_and_streamed_equal_the_engine(client):
    expected = bytes(engine_greedy(PROMPT, 24)).decode("utf-8", errors="replace")
    plain = client.completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0)
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (len(PROMPT.encode()), 24)
    assert plain.usage.total_tokens == len(PROMPT.encode()) + 24
    assert plain.system_fingerprint == "infra-lab-w0"
    chunks = list(client.completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert sum(len(e["choices"][0]["text"].encode()) for e in events[:-1]) == 8  # byte tokens: one per token


def test_chat_plain_and_streamed_with_n_seed_and_stop(client):
    messages = [{"role": "user", "content": "Write a function."}]
    first = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=1.0,
                                           n=3, seed=7)
    again = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=1.0,
                                           n=3, seed=7)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]  # a seed makes sampling repeat
    assert len(set(texts)) > 1 and [c.index for c in first.choices] == [0, 1, 2]
    assert first.usage.completion_tokens == sum(len(t.encode()) for t in texts) == 36
    streamed = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=1.0,
                                              n=3, seed=7, stream=True)
    pieces = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
    assert [pieces[i] for i in range(3)] == texts
    # a stop string ends the text before it, and the finish reason says "stop"
    full = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[10:12]
    cut = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    cut_stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                           stream=True)
    assert "".join(c.choices[0].text for c in cut_stream) == full[:full.find(stop)]


def test_logprobs_completions_and_chat(client):
    plain = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = plain.choices[0].logprobs
    assert "".join(logprobs.tokens) == plain.choices[0].text
    assert len(logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in logprobs.token_logprobs)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)  # greedy: the likeliest
        assert top[token] == pytest.approx(value)
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": "target", "prompt": 3}, 400, "prompt"),
    ({"model": "target", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "target", "prompt": "x", "max_tokens": "9"}, 400, "max_tokens"),
    ({"model": "target", "prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ({"model": "target", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "target", "prompt": "x", "stop": [1]}, 400, "stop"),
    ({"model": "target", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "target", "prompt": "x" * 500, "max_tokens": 100}, 400, "prompt"),
])
def test_bad_input_gets_openai_error_objects(server, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + "/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if body == {"model": "target", "prompt": "x" * 500, "max_tokens": 100}:
        assert "500" in error["message"] and "512" in error["message"] and "600" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_bad_chat_messages_are_named(server):
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"model": "target", "messages": [{"role": "robot", "content": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0]"


def test_admin_reload_needs_the_key(server, tmp_path):
    for headers in ({}, {"authorization": "Bearer wrong"}):
        response = httpx.post(server.url + "/admin/weights", json={"path": str(tmp_path / "w.npz")}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_metrics_parse_and_count(server, client):
    client.completions.create(model="target", prompt=PROMPT, max_tokens=5, temperature=0)
    metrics = metrics_of(server)
    assert metrics["infra_lab_generation_tokens_total{}"] >= 5
    assert metrics["infra_lab_time_to_first_token_seconds_count{}"] >= 1
    assert metrics['infra_lab_requests_total{"outcome": "length"}'] >= 1
    assert metrics["infra_lab_kv_blocks_used{}"] == 0 and metrics["infra_lab_kv_blocks_total{}"] == 1024
    assert metrics["infra_lab_weight_version{}"] == 0


def test_disconnected_streams_are_aborted_within_one_step_and_free_their_blocks(server):
    """100 streams, each cut after a random number of chunks: the engine frees each within one
    step of the disconnect, and afterwards no KV block is in use."""
    before = metrics_of(server)
    rng = np.random.default_rng(0)
    cuts = rng.integers(1, 30, size=100)
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 200, "temperature": 0.8, "stream": True}
    with httpx.Client(timeout=60) as http:
        for cut in cuts:
            with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                for i, _ in enumerate(response.iter_lines()):
                    if i >= 2 * cut:  # an event is two lines
                        break
    deadline = time.monotonic() + 30
    while True:
        after = metrics_of(server)
        aborted = after["infra_lab_abort_delay_steps_count{}"] - before.get("infra_lab_abort_delay_steps_count{}", 0)
        if aborted >= 100 or time.monotonic() > deadline:
            break
    assert aborted == 100
    within_one = after['infra_lab_abort_delay_steps_bucket{"le": "1.0"}'] - \
        before.get('infra_lab_abort_delay_steps_bucket{"le": "1.0"}', 0)
    assert within_one == 100
    assert after["infra_lab_kv_blocks_used{}"] == 0 and after["infra_lab_num_requests_running{}"] == 0
