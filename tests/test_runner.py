"""The engine's model runner: any way of splitting requests into steps and mixing them in a batch
gives each request the tokens it gets alone, greedy or sampled with its seed. The runner changes
no book of the pool: here, as in the engine, the block manager reserves before a step and records
after it."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend, model
from infra_lab.serving.block_manager import BlockManager
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


def run_step(runner: ModelRunner, blocks: BlockManager, batch: list[tuple[Request, int]]) -> None:
    """One step as the engine runs it: room first, the runner, then the books and the tokens."""
    for request, n in batch:
        if request.seq is None:
            blocks.start(request)
        blocks.reserve(request, n)
    out = runner.run(batch)
    for request, _ in batch:
        blocks.record(request, out.computed[request.request_id], out.kept[request.request_id])
        request.num_computed += out.kept[request.request_id]
        request.extend(out.tokens.get(request.request_id, []), 0.0)


def alone(target, request: Request, chosen) -> list[int]:
    """The request run by itself: its whole prompt in one step, then one token per step."""
    solo = Request(request.request_id, request.prompt, request.params, state=RequestState.RUNNING)
    runner = ModelRunner(target, target.new_paged_cache(64, 4, backend=chosen), chosen)
    blocks = BlockManager(runner.pool)
    while not solo.is_done:
        run_step(runner, blocks, [(solo, solo.num_uncomputed)])
    return solo.output


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 16]), name=st.sampled_from(["numba", "torch"]))
def test_any_schedule_gives_each_request_its_tokens_alone(target, seed, block_size, name):
    rng = np.random.default_rng(seed)
    chosen = backend.resolve(name, "cpu")
    requests = requests_from(rng, int(rng.integers(2, 6)))
    runner = ModelRunner(target, target.new_paged_cache(700 // block_size + 8, block_size, backend=chosen), chosen)
    blocks = BlockManager(runner.pool)
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
        run_step(runner, blocks, batch)
        for request in chosen_now:
            if request.is_done:
                blocks.release(request)
    for request in requests:
        assert request.output == alone(target, request, chosen), request
    assert runner.pool.num_free == runner.pool.allocator.num_blocks


def test_bad_steps_are_named_and_change_nothing(target):
    runner = ModelRunner(target, target.new_paged_cache(3, 4))
    blocks = BlockManager(runner.pool)
    a = Request(0, list(b"abcdefgh"), state=RequestState.RUNNING)
    b = Request(1, list(b"ijklmnop"), state=RequestState.RUNNING)
    with pytest.raises(ValueError, match="request 0 holds no sequence in the pool; the block manager starts it"):
        runner.run([(a, 8)])
    blocks.start(a), blocks.start(b)
    with pytest.raises(ValueError, match="request 0 has 8 uncomputed tokens; a step can run 1 to that many, not 9"):
        runner.run([(a, 9)])
    with pytest.raises(ValueError, match=r"request ids \[0, 0\] name a request twice"):
        runner.run([(a, 1), (a, 1)])
    with pytest.raises(ValueError, match="request 2 is waiting; only running requests"):
        runner.run([(Request(2, [1, 2]), 1)])
    with pytest.raises(ValueError, match="sequence 0 holds 0 tokens in 0 blocks of 4: reserve room for 8 more first"):
        runner.run([(a, 8), (b, 8)])  # the block manager reserves; the runner never does
    assert (a.num_computed, a.output, runner.pool.lengths) == (0, [], {0: 0, 1: 0})
    assert runner.pool.num_free == 3
    with pytest.raises(ValueError, match="max_tokens must be a whole number >= 1; got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="request 3 has an empty prompt"):
        Request(3, [])
