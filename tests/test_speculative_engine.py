"""Speculative decoding in the engine (chapter 07): whatever γ, drafter, policy, budget and memory
pressure (preemption by recompute and by swap, the radix cache), each greedy request gets the
target's greedy tokens, every block of the pool and of the drafter's pool goes back, and a bad
drafter or setting is refused by name with the engine still serving exactly afterwards."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import backend as backends
from infra_lab.model.generate import generate_many
from infra_lab.model.transformer import load
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import RequestState, SamplingParams
from infra_lab.serving.traffic import stdlib_prompts
from conftest import check_blocks, check_clean, run
from conftest import tiny_model

# Two from the corpus (code repeats: prompt lookup drafts well), one of random bytes (it does not).
PROMPTS = stdlib_prompts([20, 37], seed=2) + [np.random.default_rng(0).integers(32, 127, 9).tolist()]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    return load("target")


@pytest.fixture(scope="module")
def draft():
    return load("draft")


_REFERENCE: dict = {}


def reference(target, name: str) -> list[list[int]]:
    """Each prompt's first MAX_TOKENS greedy tokens, decoded without speculation."""
    if name not in _REFERENCE:
        _REFERENCE[name] = generate_many(target, PROMPTS, MAX_TOKENS, backend=backends.resolve(name))
    return _REFERENCE[name]


def expected_output(target, name: str, index: int, params: SamplingParams) -> list[int]:
    out = reference(target, name)[index][:params.max_tokens]
    stops = [i for i, t in enumerate(out) if t in params.stop_tokens]
    return out[:stops[0] + 1] if stops else out


def make_drafter(kind: str, draft, name: str) -> Drafter:
    return ModelDrafter(draft, backend=backends.resolve(name)) if kind == "model" else PromptLookupDrafter(256)


def check_drafter_clean(drafter: Drafter) -> None:
    """The drafter keeps no sequence once every request has ended."""
    if isinstance(drafter, ModelDrafter):
        assert not drafter.seqs and not drafter.pool.tables
        assert drafter.pool.num_free == drafter.pool.allocator.num_blocks


# Every γ on torch with both drafters and both policies; a subset on numba (slower on this machine).
ENGINE_CASES = [("torch", gamma, kind, "chunked" if (gamma + (kind == "lookup")) % 2 else "continuous")
                for gamma in range(1, 9) for kind in ("model", "lookup")] + [
    ("numba", 2, "model", "chunked"), ("numba", 7, "lookup", "continuous"), ("numba", 5, "lookup", "chunked")]


@pytest.mark.slow
@pytest.mark.parametrize("name, gamma, kind, policy", ENGINE_CASES)
def test_batched_greedy_is_the_targets_greedy(target, draft, name, gamma, kind, policy):
    drafter = make_drafter(kind, draft, name)
    config = EngineConfig(policy=policy, num_speculative_tokens=gamma, token_budget=96, num_blocks=32, block_size=8)
    engine = Engine(target, config, backends.resolve(name), drafter=drafter)
    assert engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)) == reference(target, name)
    tally = engine.runner.tally
    assert tally.rounds > 0 and tally.kept.sum() > 0  # speculation ran, and some drafts were kept
    assert len(engine.log) < len(PROMPTS) * MAX_TOKENS  # fewer steps than one token per request per step
    check_clean(engine)
    check_drafter_clean(drafter)


def test_the_draft_model_frees_each_finished_requests_sequence(target, draft):
    """The last requests to finish are in no later batch: their draft sequences must go anyway."""
    drafter = ModelDrafter(draft, backend=backends.resolve("torch"))
    config = EngineConfig(num_speculative_tokens=3, num_blocks=32, block_size=8)
    engine = Engine(target, config, backends.resolve("torch"),
                    drafter=drafter)
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=m)) for prompt, m in zip(PROMPTS, (4, 12, 8))]
    while engine.has_unfinished:
        engine.step()
        running = {i for i in ids if not engine.requests[i].is_done}
        assert set(drafter.seqs) <= running  # a finished request's draft state goes in its last step
    check_drafter_clean(drafter)


# ---- random configurations under memory pressure ---------------------------------------------------


@st.composite
def scenarios(draw):
    gamma = draw(st.integers(1, 8))
    policy = draw(st.sampled_from(["chunked", "continuous"]))
    cache = draw(st.sampled_from([None, None, "radix"]))
    block_size = 1 if cache else draw(st.sampled_from([2, 4, 8]))
    arrivals = []
    for _ in range(draw(st.integers(2, 4))):
        index = draw(st.integers(0, len(PROMPTS) - 1))
        sampled = draw(st.integers(0, 4)) == 0
        params = SamplingParams(temperature=0.8 if sampled else 0.0, top_k=20, seed=draw(st.integers(0, 99)),
                                max_tokens=draw(st.integers(1, 12)),
                                stop_tokens=draw(st.sampled_from([(), (), (10,), (32,)])))
        arrivals.append((draw(st.integers(0, 6)), index, params))
    # The pool holds the longest request alone and no more: near its end, no draft room beyond max_tokens.
    longest = max(len(PROMPTS[i]) + p.max_tokens - 1 for _, i, p in arrivals)
    num_blocks = -(-longest // block_size) + draw(st.integers(0, 2))
    budget = (longest + draw(st.integers(0, 16)) if policy == "continuous" else draw(st.integers(16, 48)))
    preemption = draw(st.sampled_from(["recompute", "swap"]))
    config = EngineConfig(
        policy=policy, max_batch=draw(st.integers(1, 4)), token_budget=max(budget, block_size), num_blocks=num_blocks,
        block_size=block_size, prefix_cache=cache, num_speculative_tokens=gamma, preemption=preemption,
        chunk_size=draw(st.sampled_from([None, 4, 8, 16])) if policy == "chunked" else None,
        host_blocks=draw(st.integers(num_blocks // 2 + 1, 2 * num_blocks)) if preemption == "swap" else 0)
    return config, draw(st.sampled_from(["model", "lookup"])), arrivals


@pytest.mark.parametrize("name", ["torch", "numba"])
@settings(max_examples=12, deadline=None)
@given(scenario=scenarios())
def test_any_configuration_serves_greedy_exactly_and_frees_every_block(target, draft, name, scenario):
    config, kind, arrivals = scenario
    drafter = make_drafter(kind, draft, name)
    engine = Engine(target, config, backends.resolve(name), drafter=drafter)
    produced = run(engine, [(step, PROMPTS[i], params) for step, i, params in arrivals])  # checks blocks each step
    for (_, index, params), request in zip(sorted(arrivals, key=lambda a: a[0]), engine.requests.values()):
        assert request.output == produced[request.request_id]
        assert request.state is RequestState.FINISHED
        if params.temperature == 0:
            assert request.output == expected_output(target, name, index, params), config
        else:
            assert len(request.output) == params.max_tokens or request.output[-1] in params.stop_tokens
    check_clean(engine)
    if config.prefix_cache is None:
        assert engine.runner.pool.num_free == config.num_blocks
    check_drafter_clean(drafter)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_burst_in_a_pool_for_one_preempts_and_stays_exact(target, draft, preemption):
    """Three greedy requests at once in a pool that holds one of them (with its drafts): they
    must preempt each other, by recompute or swap, and still get the target's tokens."""
    name, gamma = "torch", 4
    params = SamplingParams(max_tokens=12)
    longest = max(len(p) for p in PROMPTS) + params.max_tokens - 1 + gamma
    config = EngineConfig(policy="chunked", max_batch=3, token_budget=32, num_blocks=-(-longest // 4) + 1,
                          block_size=4, num_speculative_tokens=gamma, preemption=preemption,
                          host_blocks=64 if preemption == "swap" else 0)
    drafter = make_drafter("model", draft, name)
    engine = Engine(target, config, backends.resolve(name), drafter=drafter)
    produced = run(engine, [(0, prompt, params) for prompt in PROMPTS])
    for index, request in enumerate(engine.requests.values()):
        assert request.output == produced[request.request_id] == expected_output(target, name, index, params)
    assert sum(len(r.preempted) for r in engine.log) >= 1
    if preemption == "swap":
        assert any(r.swapped_out for r in engine.log) and any(r.swapped_in for r in engine.log)
    check_clean(engine)
    check_drafter_clean(drafter)


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_room_for_drafts_that_never_came_goes_back(target, max_tokens):
    """The scheduler reserves γ drafts' room, but nothing is drafted: prompt lookup finds no
    repeat in "abcdefgh", or max_tokens 1 leaves no place for a draft. The unused slots must leave
    the table before the radix cache takes the request's slots (one per computed token)."""
    config = EngineConfig(policy="chunked", num_speculative_tokens=3, num_blocks=64, block_size=1, token_budget=32,
                          prefix_cache="radix")
    engine = Engine(target, config, backends.resolve("torch"), drafter=PromptLookupDrafter(256))
    prompt, params = list(b"abcdefgh"), SamplingParams(max_tokens=max_tokens)
    expected = generate_many(target, [prompt], max_tokens, backend=backends.resolve("torch"))
    assert engine.generate([prompt], params) == expected
    assert engine.generate([prompt], params) == expected  # again, from the tree
    check_clean(engine)


def test_a_request_that_fits_the_pool_alone_is_served_whatever_gamma(target):
    """6 prompt tokens + 6 new ones: at most 11 tokens' KV, in 3 blocks of 4. With γ = 8 the
    runner never drafts past the 6th token; the scheduler must not reserve blocks for more."""
    config = EngineConfig(policy="chunked", num_speculative_tokens=8, num_blocks=3, block_size=4, token_budget=16)
    engine = Engine(target, config, backends.resolve("torch"), drafter=PromptLookupDrafter(256))
    assert engine.generate([list(b"def ab")], SamplingParams(max_tokens=6)) == \
        generate_many(target, [list(b"def ab")], 6, backend=backends.resolve("torch"))


# ---- sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_sampling_runs_and_is_deterministic_for_a_seed(target, draft, kind):
    def serve(seed: int) -> list[list[int]]:
        params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed + i, max_tokens=16)
                  for i in range(len(PROMPTS))]
        config = EngineConfig(num_speculative_tokens=3, token_budget=64, num_blocks=32, block_size=8)
        drafter = make_drafter(kind, draft, "torch")
        engine = Engine(target, config, backends.resolve("torch"), drafter=drafter)
        outputs = engine.generate(PROMPTS, params)
        assert engine.runner.tally.rounds > 0
        check_clean(engine)
        check_drafter_clean(drafter)
        return outputs

    first = serve(0)
    assert [len(out) for out in first] == [16] * len(PROMPTS)
    assert serve(0) == first
    assert serve(100) != first


# ---- bad input ---------------------------------------------------------------------------------------


def test_bad_settings_are_refused_by_name(target, draft):
    torch = backends.resolve("torch")
    refused = [
        (lambda: EngineConfig(num_speculative_tokens=-1), "num_speculative_tokens must be >= 0 .* got -1"),
        (lambda: EngineConfig(policy="static", num_speculative_tokens=2),
         "speculative decoding works with the continuous and chunked policies; got 'static'"),
        (lambda: EngineConfig(policy="dynamic", max_len=64, num_speculative_tokens=2), "got 'dynamic'"),
        (lambda: Engine(target, EngineConfig(), torch, drafter=PromptLookupDrafter(256)),
         "needs both a drafter and num_speculative_tokens >= 1; got drafter=PromptLookupDrafter, "
         "num_speculative_tokens=0"),
        (lambda: Engine(target, EngineConfig(num_speculative_tokens=2), torch),
         "got drafter=None, num_speculative_tokens=2"),
        (lambda: Engine(target, EngineConfig(num_speculative_tokens=2), torch, drafter=ModelDrafter(tiny_model(128))),
         "vocabulary has 128 tokens but the target's has 256"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError, match="need a Drafter"):
        Engine(target, EngineConfig(num_speculative_tokens=2), torch, drafter=object())


class Spoiled(ModelDrafter):
    """The draft model, but its first `times` answers are replaced by `bad(jobs)`."""

    def __init__(self, model, backend, bad, times: int = 1):
        super().__init__(model, backend=backend)
        self.bad, self.times = bad, times

    def propose(self, jobs):
        drafts = super().propose(jobs)
        if self.times:
            self.times -= 1
            return self.bad(jobs, drafts)
        return drafts


def uniform_without(token: int) -> np.ndarray:
    q = np.full((1, 256), 1 / 255)
    q[0, token] = 0
    return q


BAD_DRAFTS = [
    (lambda jobs, drafts: [Draft((300,))] * len(jobs), r"proposed token 300, outside the vocabulary \[0, 256\)"),
    (lambda jobs, drafts: [Draft(tuple(range(job.k + 1))) for job in jobs], "must return a Draft of at most"),
    (lambda jobs, drafts: [Draft((65,), uniform_without(65))] * len(jobs),
     "proposed token 65 at position 0 with probability 0 in its own q"),
    (lambda jobs, drafts: [Draft(d.tokens, d.q * 2) for d in drafts], "q rows must be distributions"),
]


@pytest.mark.parametrize("bad, message", BAD_DRAFTS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_bad_draft_is_refused_and_the_engine_serves_on(target, draft, bad, message, temperature):
    """The step that got it changes no request and holds no block it should not; once the drafter
    behaves, every request finishes (greedy: exactly) and every block of both pools comes back."""
    name = "torch"
    drafter = Spoiled(draft, backends.resolve(name), bad, times=0)
    config = EngineConfig(num_speculative_tokens=3, token_budget=96, num_blocks=32, block_size=8)
    engine = Engine(target, config, backends.resolve(name), drafter=drafter)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=10)
    ids = [engine.add_request(prompt, params) for prompt in PROMPTS[:2]]
    engine.step()  # the prompts' last chunks, and their first drafts
    ids += [engine.add_request(PROMPTS[2], params)]
    drafter.times = 1  # the next step's drafts are spoiled: two decodes and a prompt's last chunk
    before = [(r.num_computed, list(r.output)) for r in engine.requests.values()]
    steps = len(engine.log)
    with pytest.raises(ValueError, match=message):
        engine.step()
    assert [(r.num_computed, list(r.output)) for r in engine.requests.values()] == before
    assert len(engine.log) == steps
    pool = engine.runner.pool
    for request in engine.requests.values():
        if request.seq is not None:  # the pool holds exactly what each request computed
            assert pool.lengths[request.seq] == request.num_computed
    check_blocks(engine)
    more = engine.generate([PROMPTS[0]], params)  # it serves on, the stuck requests with it
    while engine.has_unfinished:
        engine.step()
    if temperature == 0:
        assert more == [expected_output(target, name, 0, params)]
        assert [engine.requests[i].output for i in ids] == [expected_output(target, name, i, params) for i in range(3)]
    assert all(len(r.output) == 10 for r in engine.requests.values())
    check_clean(engine)
    check_drafter_clean(drafter)
