"""The engine loop: many threads and asyncio tasks submit, stream and abort at once, and each
surviving request gets the tokens it gets alone; every block goes back, the thread stops, an idle
loop sleeps, a full queue refuses with a retry estimate, and bad input is refused by name with
the loop still serving."""
import asyncio
import os
import threading
import time
from pathlib import Path

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import alone, check_clean
from infra_lab import model
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.engine_loop import EngineLoop, LoopStopped, Overloaded
from infra_lab.serving.request import SamplingParams

CONFIG = EngineConfig(policy="chunked", max_batch=8, token_budget=64, num_blocks=96, block_size=4)


@pytest.fixture(scope="module")
def target():
    return model.load("target")


def random_request(rng):
    prompt = rng.integers(32, 127, int(rng.integers(1, 24))).tolist()
    sampled = rng.random() < 0.5
    params = SamplingParams(temperature=0.8 if sampled else 0.0, top_k=int(rng.choice([0, 20])),
                            top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1000)),
                            max_tokens=int(rng.integers(1, 17)), stop_tokens=(10,) if rng.random() < 0.3 else ())
    return prompt, params


def served_mix(rng):
    """A random request with the service's options too: n samples, log-probabilities, stop
    strings, min_tokens."""
    prompt, params = random_request(rng)
    n = int(rng.choice([1, 1, 1, 2, 3]))
    min_tokens = int(rng.integers(0, params.max_tokens + 1)) if rng.random() < 0.3 else 0
    return prompt, replace(params, n=n, logprobs=int(rng.choice([0, 2])) if rng.random() < 0.3 else None,
                           stop=(" ", "e") if rng.random() < 0.2 else (), min_tokens=min_tokens)


def alone_in_an_engine(target, prompt, params) -> list[list[int]]:
    """The request served by a fresh engine of its own: each sample's tokens."""
    engine = Engine(target, CONFIG)
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished:
        engine.step()
    return [r.output for r in engine.group(rid)]


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_threads_that_stream_and_abort_get_the_tokens_they_get_alone(target, seed):
    """64 client threads, each submits a random request (n samples, log-probabilities, stop
    strings and min_tokens among them) and streams it; a random quarter abort after their first
    token. The survivors' samples are what the request gets alone in an engine of its own (greedy
    or with its seeds); the aborted ones end with "abort" and a prefix of those tokens. After:
    every block is free and the loop's thread is gone."""
    rng = np.random.default_rng(seed)
    requests = [served_mix(rng) for _ in range(64)]
    aborting = set(rng.choice(64, 16, replace=False).tolist())
    engine = Engine(target, CONFIG)
    loop = EngineLoop(engine)
    got, errors, start = {}, [], threading.Barrier(64)

    def client(i):
        try:
            prompt, params = requests[i]
            start.wait()
            handle = loop.submit(prompt, params, request_id=f"client-{i}")
            for count, _ in enumerate(handle, 1):
                if i in aborting and count == 1:
                    loop.abort(handle.request_id)
            got[i] = handle
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append((i, error))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    loop.shutdown()
    for i, (prompt, params) in enumerate(requests):
        expected, handle = alone_in_an_engine(target, prompt, params), got[i]
        for index, (tokens, reason) in enumerate(zip(handle.samples, handle.finish_reasons)):
            if reason == "abort":
                assert i in aborting and tokens == expected[index][:len(tokens)]
            else:
                assert tokens == expected[index] and reason in ("stop", "length"), (i, index, reason)
        events = [e for e in handle.events if e.token is not None]
        assert all((e.logprob is not None) == (params.logprobs is not None) for e in events)
        for index in range(params.n):  # each sample's last event, and only it, ends the sample
            ends = [e.finish_reason is not None for e in handle.events if e.index == index]
            assert ends[-1] and not any(ends[:-1])
    assert not any(t.name == "engine-loop" and t.is_alive() for t in threading.enumerate())
    check_clean(engine)


@pytest.mark.slow
def test_asyncio_tasks_stream_beside_threads(target):
    rng = np.random.default_rng(2)
    requests = [random_request(rng) for _ in range(12)]
    with EngineLoop(Engine(target, CONFIG)) as loop:
        async def one(prompt, params):
            return [event.token async for event in loop.submit(prompt, params)]

        async def every():
            return await asyncio.gather(*(one(p, q) for p, q in requests))

        from_threads = [loop.submit(p, q) for p, q in requests]
        from_tasks = asyncio.run(every())
        for (prompt, params), streamed, handle in zip(requests, from_tasks, from_threads):
            expected = alone(target, prompt, params, "numba")
            assert streamed == expected and handle.result(60) == expected


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds a thread of this process has used (Linux: /proc, in clock ticks)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a thread's CPU time from Linux's /proc")
def test_an_idle_loop_sleeps(target):
    """No busy wait: the loop's thread uses at most two clock ticks of CPU in half a second with
    nothing to do (a polling loop would use all 50). The process as a whole is no measure: numba's
    worker threads spin for a while after a parallel region."""
    with EngineLoop(Engine(target, CONFIG)) as loop:
        loop.submit(b"def ", SamplingParams(max_tokens=2)).result(30)
        before = thread_cpu_s(loop._thread.native_id)
        time.sleep(0.5)
        assert thread_cpu_s(loop._thread.native_id) - before <= 2 / os.sysconf("SC_CLK_TCK")


def test_a_full_queue_refuses_with_a_retry_estimate(target):
    loop = EngineLoop(Engine(target, CONFIG), max_waiting=2, start=False)
    first, second = (loop.submit(b"ab", SamplingParams(max_tokens=3)) for _ in range(2))
    with pytest.raises(Overloaded, match=r"2 requests already wait \(max_waiting 2\); retry after") as refused:
        loop.submit(b"cd")
    assert refused.value.retry_after_s > 0 and loop.waiting == 2
    loop.start()
    assert len(first.result(30)) == len(second.result(30)) == 3
    loop.submit(b"cd").result(30)  # room again
    loop.shutdown()


def test_shutdown_drains_or_aborts(target):
    loop = EngineLoop(Engine(target, CONFIG), start=False)
    kept = [loop.submit(b"def ", SamplingParams(max_tokens=4)) for _ in range(3)]
    loop.start()
    loop.shutdown(drain=True)
    assert [len(h.result(1)) for h in kept] == [4, 4, 4]
    with pytest.raises(LoopStopped, match="shut down; it takes no new requests"):
        loop.submit(b"x")
    engine = Engine(target, CONFIG)
    loop = EngineLoop(engine, start=False)
    dropped = [loop.submit(b"def ", SamplingParams(max_tokens=200)) for _ in range(3)]
    loop.start()
    next(iter(dropped[0]))  # running
    loop.shutdown(drain=False)
    assert {h.finish_reason for h in dropped} == {"abort"}
    check_clean(engine)


def test_bad_input_is_refused_by_name_and_the_loop_still_serves(target):
    with EngineLoop(Engine(target, CONFIG)) as loop:
        loop.submit(b"ab", request_id="mine").result(30)
        refused = [
            (lambda: loop.submit(b"ab", request_id="mine"), ValueError, "request id 'mine' is taken"),
            (lambda: loop.submit(b"ab", request_id=7), ValueError, "a request id must be a non-empty string; got 7"),
            (lambda: loop.submit(b""), ValueError, "the prompt is empty"),
            (lambda: loop.submit([300]), ValueError, r"token 300 is outside the vocabulary \[0, 256\)"),
            (lambda: loop.submit(b"ab" * 300), ValueError, "exceeds the model's context of 512"),
            (lambda: loop.submit(b"ab", {"max_tokens": 3}), TypeError, "params must be a SamplingParams; got dict"),
            (lambda: loop.abort("nobody"), KeyError, "no request 'nobody'"),
            (lambda: EngineLoop(Engine(target, CONFIG), max_waiting=0), ValueError, "max_waiting must be"),
        ]
        for call, kind, message in refused:
            with pytest.raises(kind, match=message):
                call()
        assert loop.abort("mine") is False  # it had ended
        assert loop.submit(b"def ", SamplingParams(max_tokens=3)).result(30) == \
            alone(target, list(b"def "), SamplingParams(max_tokens=3), "numba")


def test_a_long_running_loop_keeps_bounded_books(target):
    """A service runs for long: the loop keeps the last keep_finished ended requests (here and in
    the engine) and the last keep_steps step records; a forgotten id is unknown, and free again."""
    engine = Engine(target, CONFIG)
    with EngineLoop(engine, keep_finished=4, keep_steps=5) as loop:
        for k in range(20):
            loop.submit(b"def f", SamplingParams(max_tokens=3), request_id=f"r{k}").result(30)
        assert len(loop._handles) == 4 and len(engine.requests) == 4 and len(engine.log) <= 10
        assert engine.steps >= 20 * 3 and loop.abort("r19") is False
        with pytest.raises(KeyError, match="no request 'r0'"):
            loop.abort("r0")
        assert loop.submit(b"def f", SamplingParams(max_tokens=3), request_id="r0").result(30)
    with pytest.raises(ValueError, match="keep_finished must be a whole number >= 1; got 0"):
        EngineLoop(Engine(target, CONFIG), keep_finished=0, start=False)
    check_clean(engine)
