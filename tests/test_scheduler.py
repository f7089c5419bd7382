"""The scheduler's rules, seen through the engine's step log: the victim of a preemption is the
running request admitted last, a recomputed one rejoins at the head of the queue and a swapped
one comes back before any new admission; a static batch holds its finished members' slots until
its longest ends; a dynamic batch waits max_wait_s to fill; chunked prefill puts decodes first
and keeps every step within its budget and every chunk within chunk_size; admission refuses what
could never run, and rejects a burst beyond max_waiting."""
import pytest

from infra_lab import backend, model
from infra_lab.serving.clock import VirtualClock
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import RequestState, SamplingParams
from conftest import FOUR, GREEDY, alone, check_blocks, check_clean, check_step_rules, finish

IDS = [7, 3, 5, 1]  # added in this order: admission order, not id order, picks the victim


@pytest.fixture(scope="module")
def target():
    return model.load("target")


def first_step(engine, request_id: int, after: int = -1) -> tuple[int, int]:
    """(step, place in the step's batch) where `request_id` first computes after step `after`."""
    return next((r.index, [w.request_id for w in r.work].index(request_id)) for r in engine.log
                if r.index > after and request_id in [w.request_id for w in r.work])


def pressed(target, preemption: str) -> Engine:
    """7, 3, 5 admitted in step 0 (one block each), 1 waits (max_batch 3); in step 1 the decode
    of 7 takes the last free block, so 3's must preempt: the victim is 5, admitted last."""
    config = EngineConfig(policy="continuous", max_batch=3, token_budget=64, num_blocks=4, block_size=4,
                          preemption=preemption, host_blocks=8 if preemption == "swap" else 0)
    engine = Engine(target, config, backend=backend.resolve("numba", "cpu"))
    for request_id, prompt in zip(IDS, FOUR):
        engine.add_request(prompt, GREEDY, request_id=request_id)
    engine.step()
    engine.step()
    return engine


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_victim_is_the_running_request_admitted_last(target, preemption):
    engine = pressed(target, preemption)
    assert [w.request_id for w in engine.log[0].work] == [7, 3, 5]
    assert engine.log[1].preempted == (5,) and [w.request_id for w in engine.log[1].work] == [7, 3]
    assert engine.requests[5].state is RequestState.PREEMPTED and engine.requests[5].preemptions == 1
    if preemption == "recompute":  # it lost its blocks and waits at the head of the queue, before 1
        assert engine.log[1].swapped_out == () and engine.requests[5].seq is None
        assert [r.request_id for r in engine.scheduler.waiting] == [5, 1]
    else:  # its blocks wait in host memory, and it keeps what it computed
        assert engine.log[1].swapped_out == (5,) and [r.request_id for r in engine.scheduler.swapped] == [5]
        assert engine.requests[5].num_computed == 4 and [r.request_id for r in engine.scheduler.waiting] == [1]
    finish(engine)
    assert [engine.requests[i].output for i in IDS] == [alone(target, p, GREEDY, "numba") for p in FOUR]
    back = first_step(engine, 5, after=1)
    assert back < first_step(engine, 1)  # the preempted one runs again before the new one starts
    if preemption == "swap":
        assert engine.log[back[0]].swapped_in == (5,)
        assert all(1 not in [w.request_id for w in r.work] for r in engine.log[:back[0]])
    check_clean(engine)


def test_a_static_batch_holds_its_finished_members_until_the_longest_ends(target):
    engine = Engine(target, EngineConfig(policy="static", max_batch=3, num_blocks=32, block_size=4))
    lengths = {0: 2, 1: 6, 2: 4}
    for request_id, n in lengths.items():
        engine.add_request(FOUR[request_id], SamplingParams(max_tokens=n))
    engine.step()
    late = engine.add_request(FOUR[3], GREEDY)  # arrives mid-batch: waits for the whole batch
    while not engine.requests[1].is_done:
        engine.step()
        record = engine.log[-1]
        done_before = tuple(i for i in lengths if i not in [w.request_id for w in record.work])
        assert record.held == done_before and late not in [w.request_id for w in record.work]
        if not engine.requests[1].is_done:  # the finished ones still hold their blocks
            assert all(engine.requests[i].seq in engine.blocks.pool.tables for i in lengths)
        check_blocks(engine)
    assert engine.log[-1].held == (0, 2) and engine.log[-1].finished == (1,)
    assert not engine.blocks.pool.tables  # the batch left together
    engine.step()
    assert [w.request_id for w in engine.log[-1].work] == [late]
    finish(engine)
    for request_id, prompt in enumerate(FOUR):
        request = engine.requests[request_id]
        assert request.output == alone(target, prompt, request.params, "numba")
    check_clean(engine)


def test_aborting_the_last_running_member_of_a_static_batch_lets_the_next_batch_run(target):
    engine = Engine(target, EngineConfig(policy="static", max_batch=2, num_blocks=32, block_size=4))
    short, long_ = engine.add_request(FOUR[0], SamplingParams(max_tokens=1)), engine.add_request(FOUR[1], GREEDY)
    late = engine.add_request(FOUR[2], GREEDY)
    engine.step()  # the short one is done and held
    assert engine.abort(long_) is True
    finish(engine)
    assert engine.requests[late].output == alone(target, FOUR[2], GREEDY, "numba")
    assert engine.requests[short].output == alone(target, FOUR[0], SamplingParams(max_tokens=1), "numba")
    check_clean(engine)


def test_a_dynamic_batch_waits_max_wait_s_to_fill(target):
    clock = VirtualClock()
    engine = Engine(target, EngineConfig(policy="dynamic", max_batch=3, max_len=32, max_wait_s=1.0, num_blocks=32,
                                         block_size=4), clock=clock)
    a = engine.add_request(FOUR[0], GREEDY)
    assert engine.step() == [] and not engine.log and engine.scheduler.next_decision_s(clock()) == 1.0
    clock.advance(0.4)
    b = engine.add_request(FOUR[1], GREEDY)
    assert engine.step() == [] and not engine.log
    clock.advance(0.6)  # the first request has waited max_wait_s: the batch starts as it is
    engine.step()
    assert [w.request_id for w in engine.log[0].work] == [a, b] and engine.log[0].start_s == 1.0
    c = engine.add_request(FOUR[2], GREEDY)  # at 1.0: waits for the batch, then for its own to fill
    while not engine.requests[b].is_done:
        assert c not in [w.request_id for w in engine.log[-1].work]
        engine.step()
    assert engine.step() == []  # 1.0 < 1.0 + max_wait_s
    outputs = engine.generate([FOUR[3], FOUR[0]], GREEDY)  # two more fill the batch: it starts now
    assert engine.log[-1].start_s == clock() == 1.0 and outputs == [alone(target, p, GREEDY, "numba")
                                                                   for p in (FOUR[3], FOUR[0])]
    assert [engine.requests[i].output for i in (a, b, c)] == [alone(target, p, GREEDY, "numba") for p in FOUR[:3]]
    check_clean(engine)


def test_dynamic_refuses_a_request_longer_than_max_len_by_name(target):
    engine = Engine(target, EngineConfig(policy="dynamic", max_len=16, num_blocks=32, block_size=4),
                    clock=VirtualClock())
    engine.add_request(FOUR[0], GREEDY)
    with pytest.raises(ValueError, match=r"request 1: 12 prompt tokens \+ max_tokens 8 = 20 is longer than dynamic "
                                         "batching's max_len 16"):
        engine.add_request([65] * 12, GREEDY)
    assert list(engine.requests) == [0] and len(engine.scheduler.waiting) == 1


def test_chunked_prefill_never_stalls_the_decodes(target):
    """A long prompt arrives while two requests decode: it prefills in chunks of 8 inside a
    budget of 16, and the decodes still run in every step, first."""
    engine = Engine(target, EngineConfig(policy="chunked", token_budget=16, chunk_size=8, num_blocks=64,
                                         block_size=4))
    params = SamplingParams(max_tokens=14)
    short = [engine.add_request(prompt, params) for prompt in FOUR[:2]]
    engine.step()
    long_prompt = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")
    long_ = engine.add_request(long_prompt, GREEDY)
    while engine.requests[long_].is_prefilling:
        engine.step()
        work = engine.log[-1].work
        assert [(w.request_id, w.kind) for w in work[:2]] == [(i, "decode") for i in short]
        assert work[2].request_id == long_ and work[2].kind == "prefill" and work[2].n_tokens <= 8
    finish(engine)
    assert engine.requests[long_].output == alone(target, long_prompt, GREEDY, "numba")
    assert [engine.requests[i].output for i in short] == [alone(target, p, params, "numba") for p in FOUR[:2]]
    check_step_rules(engine)
    check_clean(engine)


def test_the_radix_cache_serves_a_repeated_prompt_and_counts_it_once(target):
    engine = Engine(target, EngineConfig(policy="chunked", token_budget=32, num_blocks=64, block_size=1,
                                         prefix_cache="radix"))
    prompt = list(b"import numpy as np\nimport os")
    first = engine.generate([prompt], GREEDY)
    again = engine.add_request(prompt, GREEDY)
    finish(engine)
    request = engine.requests[again]
    assert request.output == first[0] == alone(target, prompt, GREEDY, "numba")
    assert request.cached_tokens == len(prompt) - 1  # all but the last, which runs for its logits
    step, _ = first_step(engine, again)
    assert engine.log[step].work[0].n_tokens == 1  # its prefill is one token
    check_clean(engine)


def test_longest_prefix_order_admits_the_best_cached_request_first(target):
    engine = Engine(target, EngineConfig(policy="chunked", token_budget=64, max_batch=1, num_blocks=64,
                                         block_size=1, prefix_cache="radix", order="longest-prefix"))
    prompt = list(b"import numpy as np\n")
    engine.generate([prompt], SamplingParams(max_tokens=2))
    cold, warm = engine.add_request(list(b"for i in x"), GREEDY), engine.add_request(prompt + [65], GREEDY)
    engine.step()
    assert [w.request_id for w in engine.log[-1].work] == [warm]
    finish(engine)
    assert engine.requests[cold].output == alone(target, list(b"for i in x"), GREEDY, "numba")
    assert engine.requests[warm].output == alone(target, prompt + [65], GREEDY, "numba")
    check_clean(engine)


def test_continuous_refuses_a_request_whose_recompute_would_not_fit_one_step(target):
    engine = Engine(target, EngineConfig(policy="continuous", token_budget=16, num_blocks=64, block_size=4))
    with pytest.raises(ValueError, match="request 0: 12 prompt tokens \\+ max_tokens 6: without chunking"):
        engine.add_request([65] * 12, SamplingParams(max_tokens=6))
    assert not engine.requests and not engine.scheduler.waiting


def test_beyond_max_waiting_a_burst_is_rejected_at_once(target):
    engine = Engine(target, EngineConfig(token_budget=32, num_blocks=16, block_size=4, max_waiting=2))
    ids = [engine.add_request(prompt, GREEDY) for prompt in FOUR + FOUR]
    rejected = [engine.requests[i] for i in ids[2:]]
    assert [r.request_id for r in engine.scheduler.waiting] == ids[:2]
    assert all(r.state is RequestState.ABORTED and r.finish_reason.startswith("rejected") for r in rejected)
    assert all(r.finish_s is not None and not r.output and r.seq is None for r in rejected)
    assert engine.abort(ids[5]) is False
    finish(engine)
    assert [engine.requests[i].output for i in ids[:2]] == [alone(target, p, GREEDY, "numba") for p in FOUR[:2]]
    check_clean(engine)
