"""The engine's model runner: any way of splitting requests into steps and mixing them in a batch
gives each request the tokens it gets alone, greedy or sampled with its seed."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend, model
from infra_lab.kv.paged import OutOfBlocks
from infra_lab.serving.request import Request, RequestState, SamplingParams
from infra_lab.serving.runner import ModelRunner


@pytest.fixture(scope="module")
def target():
    return model.load("target")


def requests_from(rng, n: int) -> list[Request]:
    out = []
    for i in range(n):
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 20])),
                                seed=int(rng.integers(1000)), max_tokens=int(rng.integers(1, 12)),
                                stop_tokens=(10,) if rng.random() < 0.3 else ())
        out.append(Request(i, rng.integers(32, 127, int(rng.integers(1, 70))).tolist(), params))
    return out


def alone(target, request: Request, chosen) -> list[int]:
    """The request run by itself: its whole prompt in one step, then one token per step."""
    solo = Request(request.request_id, request.prompt, request.params, state=RequestState.RUNNING)
    runner = ModelRunner(target, target.new_paged_cache(64, 4, backend=chosen), chosen)
    while not solo.is_done:
        runner.run([(solo, solo.num_uncomputed)])
    return solo.output


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 16]), name=st.sampled_from(["numba", "torch"]))
def test_any_schedule_gives_each_request_its_tokens_alone(target, seed, block_size, name):
    rng = np.random.default_rng(seed)
    chosen = backend.resolve(name, "cpu")
    requests = requests_from(rng, int(rng.integers(2, 6)))
    runner = ModelRunner(target, target.new_paged_cache(700 // block_size + 8, block_size, backend=chosen), chosen)
    waiting = list(requests)
    while any(not r.is_done for r in requests):
        for request in waiting[: int(rng.integers(0, 3))]:  # some join at each step
            request.state = RequestState.RUNNING
        waiting = [r for r in waiting if r.state is RequestState.WAITING]
        running = [r for r in requests if r.state is RequestState.RUNNING]
        if not running:
            continue
        chosen_now = [r for r in running if rng.random() < 0.8] or running[:1]
        batch = [(r, int(min(r.num_uncomputed, rng.choice([1, 5, 64])))) for r in chosen_now]
        runner.run(batch)
        for request in chosen_now:
            if request.is_done:
                runner.release(request)
    for request in requests:
        assert request.output == alone(target, request, chosen), request
    assert runner.pool.num_free == runner.pool.allocator.num_blocks


def test_bad_steps_are_named_and_change_nothing(target):
    runner = ModelRunner(target, target.new_paged_cache(3, 4))
    a = Request(0, list(b"abcdefgh"), state=RequestState.RUNNING)
    b = Request(1, list(b"ijklmnop"), state=RequestState.RUNNING)
    with pytest.raises(ValueError, match="request 0 has 8 uncomputed tokens; a step can run 1 to that many, not 9"):
        runner.run([(a, 9)])
    with pytest.raises(ValueError, match=r"request ids \[0, 0\] name a request twice"):
        runner.run([(a, 1), (a, 1)])
    with pytest.raises(ValueError, match="request 2 is waiting; only running requests"):
        runner.run([(Request(2, [1, 2]), 1)])
    with pytest.raises(OutOfBlocks, match="need 4 blocks for 2 sequences but only 3 of 3"):
        runner.run([(a, 8), (b, 8)])
    assert (a.seq, b.seq, a.num_computed, a.output) == (None, None, 0, [])
    assert runner.pool.num_free == 3 and not runner.pool.tables
    with pytest.raises(ValueError, match="max_tokens must be >= 1; got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="request 3 has an empty prompt"):
        Request(3, [])
