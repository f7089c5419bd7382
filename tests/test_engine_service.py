"""The engine as a service: n samples that share their prompt's blocks, log-probabilities that
equal a full forward, stop strings and min_tokens, weights updated between steps (checked by
name, the prefix cache flushed, in-flight requests continued or recomputed), requests and their
K and V moved to another engine (in this process and in another), and a step that fails in the
runner leaving every request and block as it was."""
import multiprocessing
import threading

import numpy as np
import pytest
import torch

from conftest import alone, check_blocks, check_clean, finish
from infra_lab import backend as backends
from infra_lab import model
from infra_lab.kv.paged import SequenceKV
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import PromptLookupDrafter
from infra_lab.serving.engine import Engine
from infra_lab.serving.engine_loop import EngineLoop
from infra_lab.serving.request import MAX_LOGPROBS, RequestState, SamplingParams
from infra_lab.serving.runner import log_softmax

NUMBA = backends.resolve("numba", "cpu")
CONFIG = EngineConfig(policy="chunked", max_batch=16, token_budget=512, num_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def target():
    return model.load("target")


@pytest.fixture(scope="module")
def perturbed(target):
    """Other weights of the same shapes: the target's, each moved by 30% of its spread."""
    rng = np.random.default_rng(1)
    return {name: (w + 0.3 * w.std() * rng.standard_normal(w.shape)).astype(np.float32)
            for name, w in target.w.items()}


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(32, 127, length).tolist()


def in_use(engine) -> int:
    return engine.config.num_blocks - engine.blocks.pool.num_free


# ---- n samples ------------------------------------------------------------------------------------

def test_n_samples_hold_the_prompt_once_and_each_draws_as_its_own_seed(target):
    """n = 8 over a 256-token prompt (16 blocks of 16): the prompt is computed once and its blocks
    are shared, so the pool holds 16 blocks after the prefill and 16 + 8 after the first decode
    (one new block per sample), not 8 x 17; sample i's tokens are a one-sample run's with seed + i."""
    engine = Engine(target, CONFIG, NUMBA)
    prompt, params = prompt_of(256), SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=8, n=8)
    rid = engine.add_request(prompt, params)
    outputs = engine.step()
    assert in_use(engine) == 16 and engine.blocks.forks == 7
    assert sorted(out.index for out in outputs) == list(range(8)) and {o.request_id for o in outputs} == {rid}
    engine.step()
    assert in_use(engine) == 16 + 8
    check_blocks(engine)
    finish(engine)
    for i, sample in enumerate(engine.group(rid)):
        assert sample.output == alone(target, prompt, params.for_sample(i), "numba"), i
    check_clean(engine)


@pytest.mark.parametrize("config", [
    EngineConfig(policy="chunked", max_batch=8, token_budget=16, num_blocks=24, block_size=4),
    EngineConfig(policy="continuous", max_batch=8, token_budget=64, num_blocks=30, block_size=4, host_blocks=16,
                 preemption="swap"),
    EngineConfig(policy="chunked", max_batch=8, token_budget=32, num_blocks=90, block_size=1, prefix_cache="radix"),
], ids=["chunked-recompute", "continuous-swap", "radix"])
def test_samples_under_memory_pressure_and_prefix_caching_keep_their_tokens(target, config):
    """Small pools preempt samples (recompute or swap), the radix cache shares prompts: each
    sample's tokens are still its own seed's alone, and every block comes back."""
    rng = np.random.default_rng(3)
    engine, wanted = Engine(target, config, NUMBA), []
    for k in range(4):
        prompt = prompt_of(int(rng.integers(3, 14)), seed=k % 2)  # two prompts, twice each: prefix hits
        params = SamplingParams(temperature=0.8, seed=k, max_tokens=int(rng.integers(2, 9)), n=int(rng.integers(1, 4)))
        wanted.append((engine.add_request(prompt, params), prompt, params))
    for _ in range(3000):
        if not engine.has_unfinished:
            break
        engine.step()
        check_blocks(engine)
    for rid, prompt, params in wanted:
        for i, sample in enumerate(engine.group(rid)):
            assert sample.output == alone(target, prompt, params.for_sample(i), "numba"), (rid, i)
    check_clean(engine)


# ---- log-probabilities --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["numba", "torch"])
def test_logprobs_equal_a_full_forward_of_the_torch_model(target, name):
    """Each token's log-probability (and its 5 likeliest rivals) equals log_softmax of a full
    forward of the torch model over the same sequence, in float32, within 1e-4."""
    engine = Engine(target, CONFIG, backends.resolve(name, "cpu"))
    greedy = engine.add_request(prompt_of(40), SamplingParams(max_tokens=12, logprobs=5))
    sampled = engine.add_request(prompt_of(9, 1), SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=0,
                                                                 n=2))
    finish(engine)
    scorer = target.to_torch().eval()
    for request in engine.group(greedy) + engine.group(sampled):
        sequence = request.prompt + request.output
        with torch.no_grad():
            logits = scorer(torch.tensor([sequence[:-1]]))[0].numpy()  # (T - 1, vocab)
        rows = log_softmax(logits[len(request.prompt) - 1:])  # the rows that predicted each output token
        expected = rows[np.arange(len(request.output)), request.output]
        np.testing.assert_allclose(request.logprobs, expected, atol=1e-4, rtol=0)
        k = request.params.logprobs
        for row, top in zip(rows, request.top_logprobs):
            assert len(top) == k and [t for t, _ in top] == list(np.argsort(-row, kind="stable")[:k])
            np.testing.assert_allclose([x for _, x in top], np.sort(row)[::-1][:k], atol=1e-4, rtol=0)
        if request.params.temperature == 0 and k:  # greedy: the chosen token is the likeliest
            assert [top[0][0] for top in request.top_logprobs] == request.output


def test_logprobs_of_drafted_tokens_are_the_targets(target):
    """With speculative decoding, an accepted draft's log-probability is the target's (the row
    that verified it), equal to what the engine reports without drafts."""
    plain = Engine(target, CONFIG, NUMBA)
    spec = Engine(target, EngineConfig(policy="chunked", num_speculative_tokens=3, num_blocks=64, block_size=16),
                  NUMBA, drafter=PromptLookupDrafter(256))
    prompt = list(b"for i in range(10):\n    print(i)\nfor i in range(10):\n    print(")
    ids = [e.add_request(prompt, SamplingParams(max_tokens=16, logprobs=2)) for e in (plain, spec)]
    finish(plain), finish(spec)
    a, b = plain.requests[ids[0]], spec.requests[ids[1]]
    assert a.output == b.output and spec.runner.tally.kept.sum() > 0
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


# ---- stop strings and min_tokens ---------------------------------------------------------------------

def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(target):
    prompt = list(b"import os\nimport sys\nimport ")
    free = alone(target, prompt, SamplingParams(max_tokens=24), "numba")
    text = bytes(free).decode("utf-8", "replace")
    stop = text[5:7]
    cut = next(j for j in range(len(free)) if stop in bytes(free[:j + 1]).decode("utf-8", "replace"))
    engine = Engine(target, CONFIG, NUMBA)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24, stop=("never there", stop)))
    finish(engine)
    request = engine.requests[rid]
    assert request.output == free[:cut + 1] and request.finish_reason == "stop"


def test_min_tokens_keeps_stop_tokens_from_being_drawn_until_then(target):
    prompt = list(b"x = 1\n")
    first = alone(target, prompt, SamplingParams(max_tokens=1), "numba")[0]
    engine = Engine(target, CONFIG, NUMBA)
    early = engine.add_request(prompt, SamplingParams(max_tokens=8, stop_tokens=(first,)))
    held = engine.add_request(prompt, SamplingParams(max_tokens=8, stop_tokens=(first,), min_tokens=4))
    sampled = engine.add_request(prompt, SamplingParams(temperature=2.0, max_tokens=30, stop_tokens=(first, 10),
                                                        min_tokens=30))
    finish(engine)
    assert engine.requests[early].output == [first]
    assert first not in engine.requests[held].output[:4] and len(engine.requests[held].output) >= 5
    assert not {first, 10} & set(engine.requests[sampled].output) and len(engine.requests[sampled].output) == 30


# ---- weights -----------------------------------------------------------------------------------------

def greedy_on(weights: dict, prompt: list[int], max_tokens: int) -> list[int]:
    """A fresh engine over `weights`: what they give greedily."""
    base = model.load("target")
    fresh = model.Transformer(base.config, weights)
    return model.generate(fresh, prompt, max_tokens, 0.0, backend=NUMBA).new_tokens


def test_updates_under_load_fail_no_request_and_each_token_names_its_weights(target, perturbed):
    """20 updates, alternating two weight sets, while 32 requests stream through the loop: none
    fails, every token records a version that was serving, versions never go back within a
    request, and afterwards greedy tokens are those of a fresh engine on the last weights."""
    served = model.Transformer(target.config, target.w)
    states = [dict(target.w), perturbed]
    rng = np.random.default_rng(4)
    with EngineLoop(Engine(served, EngineConfig(policy="chunked", max_batch=32, num_blocks=256, block_size=16),
                           NUMBA)) as loop:
        handles = [loop.submit(prompt_of(int(rng.integers(4, 40)), k),
                               SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=k, max_tokens=40))
                   for k in range(32)]
        pauses = [loop.update_weights(states[version % 2], version) for version in range(1, 21)]
        for handle in handles:
            handle.result(120)
        probe = prompt_of(12, 99)
        after = loop.submit(probe, SamplingParams(max_tokens=10)).result(60)
    assert all(h.finish_reason == "length" for h in handles)
    for handle in handles:
        versions = [e.weight_version for e in handle.events if e.token is not None]
        assert len(versions) == 40 and versions == sorted(versions) and set(versions) <= set(range(21))
    assert len(pauses) == 20 and max(pauses) < 0.5  # the swap itself: benchmarks/engine_service.py times it
    assert after == greedy_on(states[20 % 2], probe, 10)
    assert served.version == 20
    check_clean(loop.engine)


def test_bad_weights_are_refused_by_name_and_the_old_ones_keep_serving(target, perturbed):
    served = model.Transformer(target.config, target.w, version=3)
    engine = Engine(served, CONFIG, NUMBA)
    prompt = prompt_of(10)
    before = alone(target, prompt, SamplingParams(max_tokens=6), "numba")
    shape = perturbed["layers.0.wq"].shape
    bad = [({k: v for k, v in perturbed.items() if k != "embed"}, "missing: embed"),
           (perturbed | {"layers.9.wq": perturbed["layers.0.wq"]}, "not weights of target: layers.9.wq"),
           (perturbed | {"layers.0.wq": perturbed["layers.0.wq"][:, :-1]},
            rf"layers.0.wq is \({shape[0]}, {shape[1] - 1}\), expected \({shape[0]}, {shape[1]}\)"),
           (perturbed | {"final_norm": np.full_like(perturbed["final_norm"], np.nan)}, "final_norm holds NaN"),
           (perturbed | {"lm_head": perturbed["lm_head"].astype(np.int32)}, "lm_head is int32, not a float array"),
           ("weights", "weights must be a dict")]
    for state, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.update_weights(state, 4)
    with pytest.raises(ValueError, match="a weight version is a whole number >= 0; got -1"):
        engine.update_weights(perturbed, -1)
    with pytest.raises(ValueError, match="in_flight must be one of 'continue', 'recompute'; got 'drain'"):
        engine.update_weights(perturbed, 4, in_flight="drain")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6))
    finish(engine)
    assert engine.requests[rid].output == before and engine.requests[rid].versions == [3] * 6


def test_in_flight_requests_continue_or_recompute_on_the_new_weights(target, perturbed):
    """"recompute": a request in flight computes its prompt and output again on the new weights,
    so its next tokens are the new weights' continuation of what it had; "continue" keeps its old
    K and V; both record the version of every token."""
    prompt = prompt_of(20, 7)
    for rule in ("recompute", "continue"):
        served = model.Transformer(target.config, target.w)
        engine = Engine(served, CONFIG, NUMBA)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12))
        for _ in range(5):
            engine.step()
        engine.update_weights(perturbed, 1, in_flight=rule)
        finish(engine)
        request = engine.requests[rid]
        assert request.versions == [0] * 5 + [1] * 7
        assert request.output[:5] == alone(target, prompt, SamplingParams(max_tokens=5), "numba")
        if rule == "recompute":
            assert request.output[5:] == greedy_on(perturbed, prompt + request.output[:5], 7)
        check_clean(engine)


def test_an_update_flushes_the_radix_cache(target, perturbed):
    """After new weights, no request starts from K and V the old ones computed: a prompt cached
    before the update is computed again, and a request that held a cached prefix through the
    update gives its slots back when it ends."""
    config = EngineConfig(policy="chunked", num_blocks=200, block_size=1, prefix_cache="radix")
    served = model.Transformer(target.config, target.w)
    engine = Engine(served, config, NUMBA)
    prompt = prompt_of(30, 8)
    engine.add_request(prompt, SamplingParams(max_tokens=4))
    finish(engine)
    holding = engine.add_request(prompt, SamplingParams(max_tokens=8))
    engine.step()
    assert engine.requests[holding].cached_tokens == 29
    engine.update_weights(perturbed, 1)
    fresh = engine.add_request(prompt, SamplingParams(max_tokens=4))
    finish(engine)
    assert engine.requests[fresh].cached_tokens == 0
    assert engine.requests[fresh].output == greedy_on(perturbed, prompt, 4)
    assert not engine.blocks.stale_trees
    check_clean(engine)


def test_a_quantized_model_refuses_new_float_weights(target):
    from infra_lab.model.quantized import quantize_model

    quantized = quantize_model(target, "rtn", 8)
    with pytest.raises(ValueError, match="quantize the new weights"):
        quantized.load_weights(target.w, 1)


# ---- moving requests -------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(max_tokens=14, logprobs=1),
                                    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14)],
                         ids=["greedy", "seeded"])
def test_a_request_moved_mid_decode_finishes_as_if_it_had_stayed(target, params):
    """Exported after 5 tokens from an engine of 16-token blocks, with its K and V (2 x layers x
    KV heads x head size x tokens x 4 bytes), into one of 4-token blocks, and once without K and V
    (recomputed there): the same tokens as alone, its versions and log-probabilities kept."""
    prompt = prompt_of(23, 5)
    for with_kv in (True, False):
        source = Engine(target, CONFIG, NUMBA)
        rid = source.add_request(prompt, params)
        for _ in range(5):
            source.step()
        state, kv = source.export_request(rid)
        assert source.requests[rid].finish_reason == "exported" and source.blocks.pool.num_free == 64
        c = target.config
        assert kv.nbytes == 2 * c.n_layers * c.n_kv_heads * c.head_dim * (23 + 5 - 1) * 4
        sink = Engine(target, EngineConfig(policy="chunked", num_blocks=40, block_size=4), NUMBA)
        moved = sink.import_request(state, kv if with_kv else None)
        finish(sink)
        request = sink.requests[moved]
        assert request.output == alone(target, prompt, params, "numba")
        assert len(request.versions) == 14 and len(request.logprobs) == (14 if params.logprobs is not None else 0)
        check_clean(sink)


def _finish_elsewhere(state, kv, answers) -> None:
    """In another process: import the request into a fresh engine and finish it."""
    engine = Engine(model.load("target"), EngineConfig(policy="chunked", num_blocks=40, block_size=8),
                    backends.resolve("numba", "cpu"))
    rid = engine.import_request(state, kv)
    finish(engine)
    answers.put(engine.requests[rid].output)


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12),
                                    SamplingParams(temperature=0.8, seed=21, max_tokens=12)], ids=["greedy", "seeded"])
def test_a_request_moves_to_another_process(target, params):
    """The state and K and V travel through a multiprocessing queue (pickled plain data and a
    numpy array) to a spawned process, which finishes the request with the tokens it gets alone."""
    prompt = prompt_of(17, 6)
    source = Engine(target, CONFIG, NUMBA)
    rid = source.add_request(prompt, params)
    for _ in range(4):
        source.step()
    state, kv = source.export_request(rid)
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    worker = context.Process(target=_finish_elsewhere, args=(state, kv, answers))
    worker.start()
    try:
        got = answers.get(timeout=120)
    finally:
        worker.join(30)
    assert worker.exitcode == 0 and got == alone(target, prompt, params, "numba")


def test_bad_moves_are_refused_by_name_and_change_nothing(target):
    source = Engine(target, CONFIG, NUMBA)
    rid = source.add_request(prompt_of(12), SamplingParams(max_tokens=8))
    source.step(), source.step()
    state, kv = source.export_request(rid)
    with pytest.raises(ValueError, match="has ended \\(exported\\); only live requests move"):
        source.export_request(rid)
    sink = Engine(target, CONFIG, NUMBA)
    draft_config = model.load("draft").config
    from dataclasses import asdict

    other = state | {"model": asdict(draft_config)}
    with pytest.raises(ValueError, match="the request ran on another model: .*'n_layers': \\(2, 4\\)"):
        sink.import_request(other, kv)
    with pytest.raises(ValueError, match="do not fit this pool: .*'n_kv_heads': \\(1, 2\\)"):
        sink.import_request(state, SequenceKV(kv.data[:, :, :, :1], kv.tokens))
    with pytest.raises(ValueError, match="that are not the first of request"):
        sink.import_request(state, SequenceKV(kv.data, (1,) + kv.tokens[1:]))
    with pytest.raises(ValueError, match="an imported state is the dict export_request made"):
        sink.import_request({"prompt": [1]})
    with pytest.raises(ValueError, match="the 'static' policy fixes a batch"):
        Engine(target, EngineConfig(policy="static", num_blocks=64), NUMBA).import_request(state, kv)
    assert not sink.requests and sink.blocks.pool.num_free == CONFIG.num_blocks
    moved = sink.import_request(state, kv, request_id=7)
    with pytest.raises(ValueError, match="request id 7 is taken"):
        sink.import_request(state, kv, request_id=7)
    finish(sink)
    assert sink.requests[moved].output == alone(target, prompt_of(12), SamplingParams(max_tokens=8), "numba")


# ---- a step that fails ------------------------------------------------------------------------------

class FailingDrafter(PromptLookupDrafter):
    """Prompt lookup that raises on chosen calls, as a drafter with a bug would."""

    def __init__(self, fail_on: set[int]):
        super().__init__(256)
        self.calls, self.fail_on = 0, fail_on

    def propose(self, jobs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"drafter failed on call {self.calls}")
        return super().propose(jobs)


def snapshot(engine) -> tuple:
    pool, scheduler = engine.blocks.pool, engine.scheduler
    requests = tuple((r.request_id, r.state, len(r.output), r.num_computed, r.seq, r.admitted_s, r.cached_tokens)
                     for r in engine.requests.values())
    return (pool.num_free, {s: list(t) for s, t in pool.tables.items()}, dict(pool.lengths), requests,
            [r.request_id for r in scheduler.waiting], [r.request_id for r in scheduler.running])


def test_a_drafter_that_fails_mid_step_leaves_every_request_and_block_as_it_was(target):
    """The step that admits two requests fails in the drafter, and later a decode step does:
    each time the engine is as before the step (the blocks planned for it free again, the
    admitted requests waiting first in line), and the next steps give every request its tokens."""
    config = EngineConfig(policy="chunked", num_speculative_tokens=3, num_blocks=64, block_size=4)
    engine = Engine(target, config, NUMBA, drafter=FailingDrafter({1, 4}))
    prompts = [list(b"for i in range(3):\n    for "), list(b"x = x + 1\nx = x + ")]
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    for _ in range(2):
        before = snapshot(engine)
        with pytest.raises(RuntimeError, match="drafter failed"):
            while True:
                before = snapshot(engine)
                engine.step()
        assert snapshot(engine) == before
        check_blocks(engine)
    finish(engine)
    for rid, prompt in zip(ids, prompts):
        assert engine.requests[rid].output == alone(target, prompt, SamplingParams(max_tokens=12), "numba")
    check_clean(engine)


# ---- bad input ----------------------------------------------------------------------------------------

def test_bad_requests_are_refused_by_name_and_change_nothing(target):
    engine = Engine(target, CONFIG, NUMBA)
    refused = [
        (lambda: SamplingParams(n=0), "n must be a whole number >= 1; got 0"),
        (lambda: SamplingParams(n=2.0), "n must be a whole number >= 1; got 2.0"),
        (lambda: SamplingParams(logprobs=MAX_LOGPROBS + 1), f"logprobs must be None or a whole number in \\[0, "
                                                            f"{MAX_LOGPROBS}\\].*got {MAX_LOGPROBS + 1}"),
        (lambda: SamplingParams(logprobs=-1), "logprobs must be None or a whole number"),
        (lambda: SamplingParams(stop=("",)), "stop must be a tuple of non-empty strings; got \\(''"),
        (lambda: SamplingParams(stop="\n"), "stop must be a tuple of non-empty strings"),
        (lambda: SamplingParams(min_tokens=-1), "min_tokens must be a whole number >= 0; got -1"),
        (lambda: SamplingParams(max_tokens=4, min_tokens=5), "min_tokens 5 is more than max_tokens 4"),
        (lambda: engine.add_request([1, 2], SamplingParams(n=17)), "n=17 samples run together, more than max_batch 16"),
        (lambda: Engine(target, EngineConfig(policy="static"), NUMBA).add_request([1], SamplingParams(n=2)),
         "the 'static' policy fixes a batch when it starts"),
        (lambda: EngineConfig(prefix_cache="hash", host_blocks=8, preemption="swap"),
         "the hash prefix cache keeps swapped-out blocks' digests"),
        (lambda: EngineConfig(policy="static", prefix_cache="hash"), "the hash prefix cache works with the continuous"),
        (lambda: EngineConfig(order="random"), "order must be one of 'fcfs', 'longest-prefix', 'dfs-weight'"),
        (lambda: EngineConfig(order="longest-prefix"), "it needs prefix_cache='radix' or 'hash'"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(KeyError, match="no request 5; known ids: none yet"):
        engine.abort(5)
    rid = engine.add_request([1, 2, 3], SamplingParams(n=3, max_tokens=2))
    with pytest.raises(ValueError, match=f"request id {rid} is taken"):
        engine.add_request([4], request_id=rid)
    with pytest.raises(ValueError, match=f"request {rid} is live .*only ended requests are forgotten"):
        engine.forget(rid)
    assert engine.abort(rid) and not engine.abort(rid)
    assert all(r.state is RequestState.ABORTED for r in engine.group(rid))
    check_clean(engine)
    engine.forget(rid)
    assert not engine.requests and not engine.groups


def test_a_loop_serves_n_samples_with_their_logprobs_and_versions(target):
    with EngineLoop(Engine(target, CONFIG, NUMBA)) as loop:
        handle = loop.submit(prompt_of(30), SamplingParams(temperature=0.7, seed=2, max_tokens=6, n=3, logprobs=0))
        handle.result(60)
        streamed: list = []
        thread = threading.Thread(target=lambda: streamed.extend(handle))
        thread.start()
        thread.join(10)
    assert handle.finish_reasons == ["length"] * 3
    for i, tokens in enumerate(handle.samples):
        assert tokens == alone(target, prompt_of(30), SamplingParams(temperature=0.7, seed=2 + i, max_tokens=6),
                               "numba")
    assert all(e.logprob is not None and e.logprob <= 0 and e.weight_version == 0 for e in streamed)
    assert len(streamed) == 18


def test_a_request_moves_between_two_loops_mid_stream(target):
    """Loop A streams 4 tokens of a seeded request, exports it between two steps (its handle ends
    "exported"), loop B imports it and streams the rest: together, the tokens it gets alone."""
    prompt, params = prompt_of(15, 9), SamplingParams(temperature=0.8, seed=4, max_tokens=16)
    with EngineLoop(Engine(target, CONFIG, NUMBA)) as a, EngineLoop(Engine(target, CONFIG, NUMBA)) as b:
        first = a.submit(prompt, params, request_id="r")
        for count, _ in enumerate(first, 1):
            if count == 4:
                state, kv = a.export("r")
        with pytest.raises(ValueError, match="has ended \\(exported\\); only live requests move"):
            a.export("r")
        with pytest.raises(KeyError, match="no request 'nobody'"):
            a.export("nobody")
        with pytest.raises(ValueError, match="the request ran on another model"):
            b.import_request(state | {"model": state["model"] | {"n_layers": 9}}, kv, request_id="r")
        second = b.import_request(state, kv, request_id="r")
        rest = second.result(60)
    assert first.finish_reason == "exported" and second.finish_reason == "length"
    assert state["output"] == first.tokens and first.tokens + rest == alone(target, prompt, params, "numba")
    check_clean(a.engine), check_clean(b.engine)


# ---- prefix caches and admission orders ------------------------------------------------------------

@pytest.mark.parametrize("prefix_cache,block_size,order", [
    ("hash", 4, "fcfs"), ("hash", 4, "longest-prefix"), ("hash", 4, "dfs-weight"), ("radix", 1, "dfs-weight"),
    (None, 4, "dfs-weight")])
def test_every_prefix_cache_and_order_gives_each_request_its_tokens(target, prefix_cache, block_size, order):
    """Chapter 03's block hashes and chapter 04's tree, both selectable in the engine, under each
    admission order: prompts that share a prefix are served from the cache (whole blocks for the
    hashes), every request gets its tokens alone, and every block comes back."""
    config = EngineConfig(policy="chunked", max_batch=4, token_budget=32, num_blocks=400 // block_size,
                          block_size=block_size, prefix_cache=prefix_cache, order=order)
    engine = Engine(target, config, NUMBA)
    shared = list(b"import os\nimport sys\n\n\ndef main():\n")
    prompts = [shared + list(tail) for tail in (b"    pass\n", b"    return 0\n", b"    x = 1\n", b"    os.exit()")]
    prompts += [list(b"class A:\n    pass\n")] + prompts[:2]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts[:2]]
    finish(engine)
    ids += [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts[2:]]
    finish(engine)
    for rid, prompt in zip(ids, prompts):
        assert engine.requests[rid].output == alone(target, prompt, SamplingParams(max_tokens=6), "numba")
    cached = [engine.requests[rid].cached_tokens for rid in ids]
    if prefix_cache is None:
        assert not any(cached)
    else:
        assert min(cached[2:4]) >= len(shared) // block_size * block_size - block_size + 1 and cached[4] == 0
    check_clean(engine)


def test_an_update_forgets_the_block_hashes(target, perturbed):
    config = EngineConfig(policy="chunked", num_blocks=64, block_size=4, prefix_cache="hash")
    engine = Engine(model.Transformer(target.config, target.w), config, NUMBA)
    prompt = prompt_of(30, 8)
    engine.add_request(prompt, SamplingParams(max_tokens=4))
    finish(engine)
    assert engine.blocks.cached_prefix(engine.requests[0]) == 32  # its 33 computed tokens: 8 whole blocks
    engine.update_weights(perturbed, 1)
    fresh = engine.add_request(prompt, SamplingParams(max_tokens=4))
    finish(engine)
    assert engine.requests[fresh].cached_tokens == 0
    assert engine.requests[fresh].output == greedy_on(perturbed, prompt, 4)
    check_clean(engine)
