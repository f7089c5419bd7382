"""Hot weight reload in place, under load; refused files; the pretrained model chatting through the
official client; a full queue answering 429; SIGTERM draining what is in flight."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import pytest

from infra_lab.model import pretrained, weights
from infra_lab.orchestration import launch
from infra_lab.orchestration.weights_file import sha256_of

pytestmark = pytest.mark.slow
PROMPT = "import os\n"
PAUSE_TARGET_S = 0.100  # the source article's target for a hot reload


def weight_file(path, scale: float):
    """The shipped target's weights, every matrix scaled: same names and shapes, other tokens."""
    state, config, figures = weights.load(weights.path_for("target"))
    weights.save({name: value * scale if value.ndim == 2 else value for name, value in state.items()},
                 config, path, figures)
    return str(path), sha256_of(path)


def reload(url: str, path: str, sha: str, key: str = "secret", **extra) -> httpx.Response:
    return httpx.post(url + "/admin/weights", json={"path": path, "sha256": sha, **extra},
                      headers={"authorization": f"Bearer {key}"}, timeout=60)


def steady_load(client: openai.OpenAI, stop: threading.Event, outcomes: list) -> None:
    """Stream 16 greedy tokens at a time until `stop`: each response's set of fingerprints (the
    weight versions its chunks came from), or its error."""
    while not stop.is_set():
        try:
            chunks = list(client.completions.create(model="target", prompt=PROMPT, max_tokens=16, temperature=0,
                                                    stream=True))
            outcomes.append({c.system_fingerprint for c in chunks})
        except openai.OpenAIError as error:
            outcomes.append(error)


def test_in_place_reloads_under_load_fail_nothing_and_pause_briefly(tmp_path):
    files = [weight_file(tmp_path / f"w{i}.npz", scale) for i, scale in enumerate((1.0, 0.9))]
    with launch.start("serve", ["--model", "target", "--admin-key", "secret"], threads=1) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        outcomes, stop = [], threading.Event()

        senders = [threading.Thread(target=steady_load, args=(client, stop, outcomes)) for _ in range(3)]
        for sender in senders:
            sender.start()
        pauses = []
        for i in range(10):
            path, sha = files[i % 2]
            answer = reload(server.url, path, sha)
            assert answer.status_code == 200, answer.text
            assert answer.json()["version"] == i + 1
            pauses.append(answer.json()["pause_s"])
            time.sleep(0.2)
        stop.set()
        for sender in senders:
            sender.join()
        failed = [o for o in outcomes if isinstance(o, Exception)]
        assert not failed and len(outcomes) >= 10
        seen = set().union(*outcomes)  # each response's fingerprint names the versions its tokens came from
        assert len(seen) >= 3, seen
        assert max(pauses) < PAUSE_TARGET_S
        assert client.models.list().data[0].weight_version == 10


def test_refused_files_keep_the_old_weights_serving(tmp_path):
    path, sha = weight_file(tmp_path / "good.npz", 0.9)
    corrupt = tmp_path / "corrupt.npz"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    state, config, figures = weights.load(weights.path_for("target"))
    state["embed"] = state["embed"][:, :-1]
    misshapen = tmp_path / "misshapen.npz"
    weights.save(state, config, misshapen, figures)
    with launch.start("serve", ["--model", "target", "--admin-key", "secret"], threads=1) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        before = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0)
        cases = [(str(corrupt), sha, "SHA-256"), (str(misshapen), sha256_of(misshapen), "embed"),
                 (str(tmp_path / "missing.npz"), sha, "no weights file")]
        for bad_path, bad_sha, named in cases:
            answer = reload(server.url, bad_path, bad_sha)
            assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.text
            assert "still serving version 0" in answer.json()["error"]["message"]
        after = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0)
        assert after.choices[0].text == before.choices[0].text and after.system_fingerprint == "infra-lab-w0"
        assert reload(server.url, path, sha).status_code == 200
        changed = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0)
        assert changed.system_fingerprint == "infra-lab-w1"


def test_a_full_queue_answers_429_with_retry_after_and_sigterm_drains():
    with launch.start("serve", ["--model", "target", "--max-queue", "2", "--max-batch", "2"], threads=1) as server:
        body = {"model": "target", "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
        with httpx.Client(timeout=60) as http:
            answers = []
            threads = [threading.Thread(target=lambda: answers.append(http.post(server.url + "/v1/completions",
                                                                              json=body))) for _ in range(12)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        statuses = sorted(a.status_code for a in answers)
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
        refused = next(a for a in answers if a.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        # SIGTERM while a request streams: it finishes, then the server exits
        finished = []

        def long_request():
            finished.append(httpx.post(server.url + "/v1/completions", json=dict(body, max_tokens=300), timeout=60))

        sender = threading.Thread(target=long_request)
        sender.start()
        time.sleep(0.5)
        server.stop(timeout_s=60)
        sender.join()
        assert finished[0].status_code == 200 and finished[0].json()["usage"]["completion_tokens"] == 300


@pytest.mark.skipif("smollm2-135m" not in pretrained.pulled(), reason="run `infra-lab models pull smollm2-135m`")
def test_the_pretrained_model_chats_through_the_openai_client():
    with launch.start("serve", ["--model", "smollm2-135m", "--num-blocks", "64"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32,
                                                temperature=0)
        assert "Paris" in answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"
        assert "<|im_end|>" not in answer.choices[0].message.content
        streamed = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32,
                                                  temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content
        text = client.completions.create(model="smollm2-135m", prompt="def fibonacci(n):", max_tokens=8,
                                         temperature=0)
        assert text.usage.completion_tokens == 8 and np.isfinite(text.usage.prompt_tokens)


def test_rolling_updates_through_the_router_serve_each_response_from_one_version(tmp_path):
    """Two rolling updates under steady load: no request fails, and every response's chunks name
    one weight version (the worker it came from)."""
    from infra_lab.orchestration import rolling

    files = [weight_file(tmp_path / f"w{i}.npz", scale)[0] for i, scale in enumerate((0.9, 1.0))]
    worker = launch.start("serve", ["--model", "target"], threads=1)
    route = ["--worker", worker.url, "--admin-key", "secret", "--health-interval", "0.2"]
    with launch.start("route", route) as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        outcomes, stop = [], threading.Event()

        sender = threading.Thread(target=steady_load, args=(client, stop, outcomes))
        sender.start()
        for i, path in enumerate(files):
            time.sleep(0.5)
            args = ["--model", path, "--served-model-name", "target", "--weight-version", str(i + 1)]
            worker, timings = rolling.rolling_update(router.url, "secret", worker, args, threads=1)
            assert timings["total_s"] > 0
        time.sleep(0.5)
        stop.set()
        sender.join()
    worker.stop()
    assert [o for o in outcomes if isinstance(o, Exception)] == []
    assert all(len(fingerprints) == 1 for fingerprints in outcomes)
    assert set().union(*outcomes) == {"infra-lab-w0", "infra-lab-w1", "infra-lab-w2"}
