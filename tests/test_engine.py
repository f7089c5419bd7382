"""The serving engine (chapter 05): whatever the policy, the preemption, the prefix cache and the
backend, each request gets the tokens it gets alone (greedy, or sampled with its own seed), every
block goes back, and bad input is refused by name with the engine left as it was."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend, model
from infra_lab.serving.clock import VirtualClock
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import RequestState, SamplingParams
from infra_lab.serving.traffic import TimedRequest
from conftest import FOUR, GREEDY, alone, check_blocks, check_clean, check_step_rules, finish, run

BACKENDS = ["numba", "torch"]
SHARED = [list(b"def main():\n    "), list(b"import numpy as np\n")]  # openings that prompts share
CASES = [("static", "recompute", None), ("dynamic", "recompute", None)] + [
    (policy, preemption, cache) for policy in ("continuous", "chunked") for preemption in ("recompute", "swap")
    for cache in (None, "radix")]


@pytest.fixture(scope="module")
def target():
    return model.load("target")


def make_config(policy, preemption, cache, rng, longest: int) -> EngineConfig:
    """A pool just large enough for the longest request (so requests preempt each other)."""
    block_size = 1 if cache else int(rng.choice([2, 4, 8]))
    num_blocks = -(-longest // block_size) + int(rng.integers(0, 2))
    budget = {"continuous": longest + int(rng.integers(0, 16)), "chunked": int(rng.integers(16, 49))}.get(policy, 64)
    batch_at_once = policy in ("static", "dynamic")
    return EngineConfig(
        policy=policy, max_batch=int(rng.integers(1, 5) if batch_at_once else rng.integers(2, 9)),
        token_budget=max(budget, block_size), num_blocks=num_blocks, block_size=block_size,
        chunk_size=int(rng.choice([4, 8, 16])) if policy == "chunked" and rng.random() < 0.7 else None,
        preemption=preemption, prefix_cache=cache, max_len=64 if policy == "dynamic" else None,
        host_blocks=int(rng.integers(num_blocks // 2 + 1, 2 * num_blocks + 1)) if preemption == "swap" else 0)


def random_arrivals(rng, n: int) -> list[tuple[int, list[int], SamplingParams]]:
    arrivals = []
    for _ in range(n):
        opening = SHARED[int(rng.integers(2))][:int(rng.integers(0, 18))] if rng.random() < 0.6 else []
        prompt = opening + rng.integers(32, 127, int(rng.integers(1, 12))).tolist()
        sampled = rng.random() < 0.5
        params = SamplingParams(temperature=0.8 if sampled else 0.0, top_k=int(rng.choice([0, 20])),
                                top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1000)),
                                max_tokens=int(rng.integers(1, 9)), stop_tokens=(10,) if rng.random() < 0.3 else ())
        arrivals.append((int(rng.integers(0, 8)), prompt, params))
    return arrivals


def longest_of(policy, arrivals) -> int:
    """Tokens whose KV the longest request stores (a static batch reserves one more)."""
    extra = 0 if policy in ("static", "dynamic") else -1
    return max(len(prompt) + params.max_tokens + extra for _, prompt, params in arrivals)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("policy, preemption, cache", CASES)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_each_request_gets_its_tokens_alone(target, name, policy, preemption, cache, seed):
    rng = np.random.default_rng(seed)
    arrivals = random_arrivals(rng, int(rng.integers(2, 6)))
    config = make_config(policy, preemption, cache, rng, longest_of(policy, arrivals))
    engine = Engine(target, config, backend=backend.resolve(name, "cpu"))
    produced = run(engine, arrivals)
    for (_, prompt, params), request in zip(sorted(arrivals, key=lambda a: a[0]), engine.requests.values()):
        assert request.prompt == prompt
        assert request.output == produced[request.request_id] == alone(target, prompt, params, name), config
    check_clean(engine)
    check_step_rules(engine)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("policy, preemption, cache", CASES[2:])
def test_a_burst_in_a_pool_for_one_preempts_and_the_tokens_stay_exact(target, name, policy, preemption, cache):
    """Four requests at once in a pool that holds the longest alone: they must preempt."""
    rng = np.random.default_rng(5)
    arrivals = [(0, rng.integers(32, 127, 5).tolist() if i % 2 else SHARED[0][:6 + i],
                 SamplingParams(temperature=0.8 * (i % 2), top_k=20, seed=i, max_tokens=10)) for i in range(4)]
    config = make_config(policy, preemption, cache, rng, longest_of(policy, arrivals))
    engine = Engine(target, config, backend=backend.resolve(name, "cpu"))
    produced = run(engine, arrivals)
    for (_, prompt, params), request in zip(arrivals, engine.requests.values()):
        assert request.output == produced[request.request_id] == alone(target, prompt, params, name)
    assert sum(len(r.preempted) for r in engine.log) >= 1
    if preemption == "swap":
        swapped_out = [i for r in engine.log for i in r.swapped_out]
        assert swapped_out and sorted(swapped_out) == sorted(i for r in engine.log for i in r.swapped_in)
    check_clean(engine)
    check_step_rules(engine)


# ---- the API -------------------------------------------------------------------------------------

def pressed(target, preemption="swap", name="numba"):
    """A, B, C admitted in one step, D waiting (max_batch 3); in the next step A's decode takes
    the last free block and B's preempts C. After it: A, B run, C is swapped (or waits to be
    recomputed, at the head of the queue), D waits."""
    config = EngineConfig(policy="continuous", max_batch=3, token_budget=64, num_blocks=4, block_size=4,
                          preemption=preemption, host_blocks=8 if preemption == "swap" else 0)
    engine = Engine(target, config, backend=backend.resolve(name, "cpu"))
    ids = [engine.add_request(prompt, GREEDY) for prompt in FOUR]
    engine.step()
    engine.step()
    return engine, ids


@pytest.mark.parametrize("name", BACKENDS)
def test_a_request_alone_in_an_engine_gets_what_model_generate_gives(target, name):
    """The oracle above, checked once: greedy and seeded sampling alike."""
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11, max_tokens=12)]
    for prompt, q in zip(FOUR[:2], params):
        engine = Engine(target, EngineConfig(num_blocks=8, block_size=4), backend=backend.resolve(name, "cpu"))
        assert engine.generate([prompt], q) == [alone(target, prompt, q, name)]


def test_serve_replays_a_timed_workload_on_the_clock(target):
    clock = VirtualClock()
    engine = Engine(target, EngineConfig(token_budget=32, num_blocks=16, block_size=4), clock=clock)
    workload = [TimedRequest(t, prompt, 6) for t, prompt in zip([0.0, 0.5, 0.5, 3.0], FOUR)]
    served = engine.serve(workload)
    assert [r.arrival_s for r in served] == [0.0, 0.5, 0.5, 3.0] and clock() == 3.0
    assert [r.output for r in served] == [alone(target, p, SamplingParams(max_tokens=6), "numba") for p in FOUR]
    assert served[3].admitted_s == 3.0
    check_clean(engine)


def test_step_returns_each_token_as_it_comes(target):
    engine = Engine(target, EngineConfig(token_budget=32, chunk_size=8, num_blocks=12, block_size=4))
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=3 + i)) for i, prompt in enumerate(FOUR)]
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    for request_id, prompt in zip(ids, FOUR):
        mine = [out for out in outputs if out.request_id == request_id]
        request = engine.requests[request_id]
        assert [out.token for out in mine] == request.output == alone(target, prompt, request.params, "numba")
        assert [out.finished for out in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == request.finish_reason == "length"
    check_clean(engine)


def test_stream_yields_exactly_the_requests_tokens_while_the_others_go_on(target):
    engine, ids = pressed(target)
    assert list(engine.stream(ids[2])) == alone(target, FOUR[2], GREEDY, "numba")  # the swapped one
    assert list(engine.stream(ids[2])) == engine.requests[ids[2]].output  # again, once it is done
    finish(engine)
    assert [engine.requests[i].output for i in ids] == [alone(target, p, GREEDY, "numba") for p in FOUR]
    check_clean(engine)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_frees_the_requests_blocks_and_the_others_finish_exactly(target, preemption, where):
    engine, ids = pressed(target, preemption)
    victim = {"waiting": ids[3], "running": ids[1], "preempted": ids[2]}[where]
    request, pool = engine.requests[victim], engine.blocks.pool
    assert request.state is {"waiting": RequestState.WAITING, "running": RequestState.RUNNING,
                             "preempted": RequestState.PREEMPTED}[where]
    held = len(pool.tables[request.seq]) if request.seq is not None else 0
    free = pool.num_free
    assert engine.abort(victim) is True
    assert (request.state, request.finish_reason, request.seq) == (RequestState.ABORTED, "abort", None)
    assert pool.num_free == free + held
    check_blocks(engine)
    if where == "preempted":  # swapped: its host blocks go back too; recomputed: it leaves the queue's head
        assert not engine.blocks.swapped and not engine.scheduler.swapped
        assert [r.request_id for r in engine.scheduler.waiting] == [ids[3]]
    finish(engine)
    for request_id, prompt in zip(ids, FOUR):
        if request_id != victim:
            assert engine.requests[request_id].output == alone(target, prompt, GREEDY, "numba")
    assert engine.abort(victim) is False and engine.abort(ids[0]) is False  # aborted, finished
    with pytest.raises(KeyError, match="no request 99; known ids: \\[0, 1, 2, 3\\]"):
        engine.abort(99)
    check_clean(engine)


# ---- bad input --------------------------------------------------------------------------------------

def snapshot(engine) -> tuple:
    s = engine.scheduler
    ids = lambda queue: [r.request_id for r in queue]  # noqa: E731
    return (dict(engine.requests), ids(s.waiting), ids(s.running), ids(s.swapped), engine.blocks.pool.num_free,
            engine.blocks.host.num_free, engine._next_id)


def test_bad_input_is_refused_by_name_and_changes_nothing(target):
    engine, ids = pressed(target)
    before = snapshot(engine)
    refused = [
        (lambda: engine.add_request(b""), "the prompt is empty"),
        (lambda: engine.add_request([]), "the prompt is empty"),
        (lambda: engine.add_request([65, 256]), r"token 256 is outside the vocabulary \[0, 256\)"),
        (lambda: engine.add_request([-1, 65]), r"token -1 is outside the vocabulary"),
        (lambda: engine.add_request([65] * 500, SamplingParams(max_tokens=20)),
         "request 4: 500 prompt tokens \\+ max_tokens 20 = 520 exceeds the model's context of 512"),
        (lambda: engine.add_request([65] * 10, SamplingParams(max_tokens=8)),
         r"request 4: 10 prompt tokens \+ max_tokens 8 needs more KV than the whole pool holds \(4 blocks of 4 = 16"),
        (lambda: engine.add_request(b"ab", request_id=ids[1]), "request id 1 is taken"),
        (lambda: engine.generate([b"ab", b"", b"cd"], GREEDY), "the prompt is empty"),
        (lambda: engine.generate([b"ab", [65] * 20], GREEDY), "request 5: 20 prompt tokens"),
        (lambda: engine.generate([b"ab"], [GREEDY, GREEDY]), "got 1 prompts but 2 sampling parameters"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens must be a whole number >= 1; got 0"),
        (lambda: SamplingParams(max_tokens=-3), "max_tokens must be a whole number >= 1; got -3"),
        (lambda: SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        (lambda: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]; got 0.0"),
        (lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]; got 1.5"),
        (lambda: SamplingParams(top_k=-1), "top_k must be >= 0"),
        # caught here, not by a step that has committed part of its batch
        (lambda: SamplingParams(temperature=float("nan")), "temperature must be >= 0 and finite .*got nan"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature must be >= 0 and finite .*got inf"),
        (lambda: SamplingParams(top_k=2.5), "top_k must be >= 0 and a whole number .*got 2.5"),
        (lambda: SamplingParams(top_p=float("nan")), r"top_p must be in \(0, 1\]; got nan"),
        (lambda: SamplingParams(seed=-1), "seed must be >= 0 and a whole number; got -1"),
        (lambda: SamplingParams(seed=1.5), "seed must be >= 0 and a whole number; got 1.5"),
        (lambda: SamplingParams(max_tokens=2.5), "max_tokens must be a whole number >= 1; got 2.5"),
        (lambda: SamplingParams(stop_tokens=[10]), r"stop_tokens must be a tuple of token ids >= 0; got \[10\]"),
        (lambda: SamplingParams(stop_tokens=(-1,)), r"stop_tokens must be a tuple of token ids >= 0; got \(-1,\)"),
        (lambda: EngineConfig(token_budget=8, block_size=16), "token_budget 8 is smaller than one block"),
        (lambda: EngineConfig(policy="chunked", token_budget=32, chunk_size=64), "chunk_size must be in"),
        (lambda: EngineConfig(policy="fifo"), "policy must be one of"),
        (lambda: EngineConfig(preemption="swap"), "needs swap space"),
        (lambda: EngineConfig(prefix_cache="radix", block_size=4), "needs block_size 1"),
        (lambda: EngineConfig(policy="dynamic"), "dynamic batching needs max_len"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
        assert snapshot(engine) == before, message
    with pytest.raises(KeyError, match="no request 99"):
        engine.abort(99)
    assert snapshot(engine) == before
    finish(engine)  # and it still serves
    assert [engine.requests[i].output for i in ids] == [alone(target, p, GREEDY, "numba") for p in FOUR]
    check_clean(engine)
