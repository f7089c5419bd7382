"""Prefill/decode disaggregation across real processes (chapter 06): a prefill worker and a decode
worker behind the front, over gloo and over shared memory, talked to with the official client.
The same tokens as one engine, the exact K and V bytes, every block free after; bad transfers
refused by name; a decode worker killed mid-run, and nothing hangs."""
from __future__ import annotations

import concurrent.futures
import threading

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import alone
from infra_lab import backend as backends
from infra_lab import model
from infra_lab.orchestration import kv_transfer, pd_router
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.engine_loop import EngineLoop
from infra_lab.serving.request import SamplingParams

NUMBA = backends.resolve("numba", "cpu")
TEXTS = ["def ", "import os\n", "class Node:\n    def __init__(self", "for i in range(", "return self."]


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def front_health(url: str) -> list[str]:
    """The front's health and retry lines: why it routed as it did."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return [line for line in text.splitlines() if not line.startswith("#") and "created" not in line
            and ("healthy" in line or "retries" in line or "pd_requests" in line)]


def prompts(n: int) -> list[str]:
    return [TEXTS[i % len(TEXTS)] + "x" * (i % 7) for i in range(n)]


def ask_all(url: str, texts: list[str], seeded: bool) -> list[list[int]]:
    """Each prompt's token ids (the byte model's text is its bytes), 8 requests at a time."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(i_text):
        i, text = i_text
        extra = {"temperature": 0.8, "seed": 100 + i} if seeded else {"temperature": 0}
        answer = client.completions.create(model="target", prompt=text, max_tokens=12, **extra)
        return list(answer.choices[0].text.encode("latin-1"))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(ask, enumerate(texts)))


@pytest.fixture(scope="module")
def target():
    return model.load("target")


@pytest.fixture(scope="module")
def over_gloo():
    with pd_router.deploy(1, 1, "gloo", ["--model", "target"], kv_timeout_s=5) as deployment:
        yield deployment


# ---- the wire format and its checks, in one process ------------------------------------------------

def moved(target, block_size=16, prompt=b"def hello(x):"):
    with EngineLoop(Engine(target, EngineConfig(num_blocks=32, block_size=block_size), NUMBA)) as loop:
        handle = loop.submit(prompt, SamplingParams(max_tokens=8), hand_off=True)
        handle.result()
        assert handle.finish_reason == "exported" and loop.engine.blocks.pool.num_free == 32
        return handle.moved


def test_the_wire_carries_the_state_and_exactly_the_k_and_v_bytes(target):
    state, kv = moved(target)
    header, payload = kv_transfer.pack("t1", state, kv, 16)
    c = target.config
    assert payload.size == 2 * c.n_layers * c.n_kv_heads * c.head_dim * len(b"def hello(x):") * 4
    got, kv2 = kv_transfer.unpack(header, payload)
    assert got["state"] == state and kv2.tokens == kv.tokens and np.array_equal(kv2.data, kv.data)


def test_a_transfer_that_does_not_fit_is_refused_by_name_and_changes_no_pool(target):
    state, kv = moved(target)
    sink = Engine(target, EngineConfig(num_blocks=32, block_size=8), NUMBA)
    header, payload = kv_transfer.pack("t2", state, kv, 16)
    with pytest.raises(kv_transfer.TransferRefused, match=r"'block_size': \(16, 8\)"):
        kv_transfer.check(kv_transfer.unpack(header, payload)[0], sink)
    as_float64 = type(kv)(kv.data.astype(np.float64), kv.tokens)
    header, payload = kv_transfer.pack("t3", state, as_float64, 8)
    with pytest.raises(kv_transfer.TransferRefused, match=r"'dtype': \('float64', 'float32'\)"):
        kv_transfer.check(kv_transfer.unpack(header, payload)[0], sink)
    draft = Engine(model.load("draft"), EngineConfig(num_blocks=32, block_size=16), NUMBA)
    header, payload = kv_transfer.pack("t4", state, kv, 16)
    with pytest.raises(kv_transfer.TransferRefused, match=r"another model: .*'n_layers': \(4, 2\)"):
        kv_transfer.check(kv_transfer.unpack(header, payload)[0], draft)
    with pytest.raises(kv_transfer.TransferRefused, match="bytes of K and V, but its header describes"):
        kv_transfer.unpack(header, payload[:-4])
    assert sink.blocks.pool.num_free == 32 and draft.blocks.pool.num_free == 32 and not sink.requests


def test_a_first_token_that_ends_the_request_travels_without_k_and_v(target):
    with EngineLoop(Engine(target, EngineConfig(num_blocks=32), NUMBA)) as loop:
        handle = loop.submit(b"def ", SamplingParams(max_tokens=1), hand_off=True)
        handle.result()
        state, kv = handle.moved
        assert kv is None and state["finish_reason"] == "length" and handle.finish_reason == "length"
        replayed = loop.import_request(state, None, replay=True)
        assert replayed.result() == state["output"] and replayed.finish_reason == "length"
        assert loop.engine.blocks.pool.num_free == 32


# ---- real processes -----------------------------------------------------------------------------------

def idle_then_send(idle_s: float, timeout_s: float) -> float | list:
    """Rank 0 sends one transfer after the link sat idle `idle_s`, longer than its `timeout_s`;
    rank 1 returns what arrived."""
    import time

    import torch.distributed as dist

    link = kv_transfer.GlooLink(dist.get_rank(), 2, None, receive=dist.get_rank() == 1, timeout_s=timeout_s)
    if dist.get_rank() == 0:
        time.sleep(idle_s)
        link.send(1, b'{"transfer_id": "late"}', np.arange(8, dtype=np.uint8), timeout_s)
        return idle_s
    header, payload = link.claim("late", idle_s + 30)
    return [header.decode(), payload.tolist(), link.receive_errors]


def test_a_gloo_link_idle_past_its_timeout_still_carries_the_next_transfer():
    from infra_lab.processes import run_on_ranks

    _, (header, payload, errors) = run_on_ranks(idle_then_send, 2, 3.0, 1.0, timeout_s=1.0)
    assert header == '{"transfer_id": "late"}' and payload == list(range(8)) and errors == 0


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_hundred_prompts_through_the_pair_get_one_engines_tokens(over_gloo, target, seeded):
    texts = prompts(100 if not seeded else 30)
    before = metric(over_gloo.decode[0].url, "infra_lab_kv_transfer_bytes_total")
    got = ask_all(over_gloo.url, texts, seeded)
    for i, (text, tokens) in enumerate(zip(texts, got)):
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=100 + i) if seeded else \
            SamplingParams(max_tokens=12)
        assert tokens == alone(target, list(text.encode()), params, "numba"), text
    c = target.config
    fallbacks = metric(over_gloo.url, "pd_requests_total", outcome="fallback")
    assert fallbacks == 0, ("requests went to the prefill worker whole", front_health(over_gloo.url),
                            over_gloo.front.output()[-2000:], over_gloo.decode[0].alive,
                            over_gloo.decode[0].output()[-2000:])
    sent = metric(over_gloo.decode[0].url, "infra_lab_kv_transfer_bytes_total") - before
    assert sent == sum(2 * c.n_layers * c.n_kv_heads * c.head_dim * len(t.encode()) * 4 for t in texts)
    for worker in over_gloo.prefill + over_gloo.decode:
        assert metric(worker.url, "infra_lab_kv_blocks_used") == 0
    assert metric(over_gloo.url, "pd_requests_total", outcome="disaggregated") >= len(texts)


@pytest.mark.slow
def test_streams_and_chats_pass_through_the_front(over_gloo):
    client = openai.OpenAI(base_url=over_gloo.url + "/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="target", prompt="import os\n", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="target", prompt="import os\n", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len("import os\n")
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError, match="moves one sample"):
        client.completions.create(model="target", prompt="x", max_tokens=3, n=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="target", prompt="x", max_tokens=100_000)


@pytest.mark.slow
def test_a_transfer_that_never_comes_is_counted_and_named(over_gloo):
    decode = over_gloo.decode[0].url
    answer = httpx.post(decode + "/v1/completions", timeout=30, json={
        "model": "target", "prompt": "x", "max_tokens": 3, "kv_transfer_params": {"transfer_id": "nowhere"}})
    assert answer.status_code == 504 and "did not arrive within 5 s" in answer.json()["error"]["message"]
    assert metric(decode, "infra_lab_kv_transfers_total", outcome="timed_out") == 1
    bad = httpx.post(over_gloo.prefill[0].url + "/kv/prefill", timeout=30, json={
        "model": "target", "prompt": "x", "kv_transfer_params": {"transfer_id": "../etc"}})
    assert bad.status_code == 400 and "letters and digits" in bad.json()["error"]["message"]


@pytest.mark.slow
def test_shared_memory_carries_the_same_tokens(target):
    texts = prompts(12)
    with pd_router.deploy(1, 1, "shm", ["--model", "target"]) as deployment:
        got = ask_all(deployment.url, texts, seeded=False)
        assert metric(deployment.decode[0].url, "infra_lab_kv_transfers_total", outcome="received") == len(texts)
    for text, tokens in zip(texts, got):
        assert tokens == alone(target, list(text.encode()), SamplingParams(max_tokens=12), "numba")


@pytest.mark.slow
def test_a_decode_worker_killed_mid_run_leaves_no_hang_and_no_held_block():
    """Requests stream while the decode worker dies: each ends answered, retried (the prefill
    worker serves it whole), or failed by name; the prefill worker holds no block after."""
    with pd_router.deploy(1, 1, "gloo", ["--model", "target"], kv_timeout_s=5) as deployment:
        client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        outcomes, started = [], threading.Event()

        def one(i):
            try:
                chunks = list(client.completions.create(model="target", prompt=TEXTS[i % 5], max_tokens=60,
                                                        temperature=0, stream=True))
                started.set()
                outcomes.append("answered" if chunks[-1].choices[0].finish_reason == "length" else "cut")
            except openai.APIError as error:
                outcomes.append(f"failed: {error.message}")

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(one, i) for i in range(24)]
            started.wait(60)
            deployment.decode[0].kill()
            concurrent.futures.wait(futures, timeout=120)
        assert len(outcomes) == 24, "every request ended"
        named = [o for o in outcomes if o.startswith("failed")]
        assert all("worker" in o for o in named), named
        assert outcomes.count("answered") >= 12
        after = client.completions.create(model="target", prompt="def ", max_tokens=5, temperature=0)
        assert after.choices[0].finish_reason == "length"  # served whole by the prefill worker
        assert metric(deployment.url, "pd_requests_total", outcome="fallback") >= 1
        assert metric(deployment.prefill[0].url, "infra_lab_kv_blocks_used") == 0


@pytest.mark.slow
def test_the_interference_harness_sends_exact_bytes_and_leaves_both_pools_free(target):
    from infra_lab.orchestration import interference

    mix = interference.Mix(decoders=3, decode_tokens=6, long_prompts=2, long_every_s=0.05, long_tokens=3)
    run, books = interference.disaggregated(mix)
    c = target.config
    assert books["prefill"]["kv_bytes"] == sum(2 * c.n_layers * c.n_kv_heads * c.head_dim * len(r.prompt) * 4
                                               for r in mix.requests())
    for side in ("prefill", "decode"):
        assert books[side]["free_blocks"] == books[side]["blocks"]
    assert sorted(len(t) for t in run.token_times_s) == sorted(r.max_tokens - 1 for r in mix.requests())
    assert len(run.itl_s()) == 3 * 4  # the decoding requests' gaps between the tokens made on the decode side
