"""Shared by the tests: hypothesis's profiles, the `root` fixture, and the helpers several test
files use (imported as `from conftest import ...`): the engine's bookkeeping checks and a
request's tokens alone (test_engine, test_scheduler, test_speculative_engine), a tiny random
model (test_speculative, test_speculative_engine), and a scattered KV pool with its relative
error and the error float32 explains (test_extend_attention, test_extend_triton), and the torch
pass's environment, ON_TORCH (test_notebooks_on_torch, test_grade_chapters). Tolerances
derived from sizes live in tests/_numerics.py, which spawned processes import too."""
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from _numerics import fp32_tolerance
from infra_lab import backend, model
from infra_lab.kernels import paged_attention
from infra_lab.model.config import ModelConfig, weight_shapes
from infra_lab.model.transformer import Transformer
from infra_lab.serving.request import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def root() -> Path:
    return ROOT


# The torch pass of the notebooks (test_notebooks_on_torch, test_grade_chapters' solutions): the
# Colab path on torch's CPU build, at quick sizes, one thread per kernel. The pass proves that
# cells run, and beside the other worker's processes two threads each oversubscribe two cores (a
# run of chapter 07 once took 308 s for its 10 s alone).
ON_TORCH = {"INFRA_LAB_BACKEND": "torch", "INFRA_LAB_QUICK": "1", "MPLBACKEND": "Agg",
            **{threads: "1" for threads in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                                            "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}



# ---- the engine (chapter 05) ---------------------------------------------------------------------

FOUR = [list(b"def "), list(b"for "), list(b"if x"), list(b"impo")]  # one block of 4 each
GREEDY = SamplingParams(max_tokens=8)


_ALONE: dict = {}


def alone(target, prompt: list[int], params: SamplingParams, name: str) -> list[int]:
    """The request's tokens from infra_lab.model.generate (one contiguous cache, no engine), cut
    after its first stop token."""
    key = (tuple(prompt), params, name)
    if key not in _ALONE:
        out = model.generate(target, prompt, params.max_tokens, params.temperature, params.top_k, params.top_p,
                             params.seed, backend=backend.resolve(name, "cpu")).new_tokens
        stops = [i for i, t in enumerate(out) if t in params.stop_tokens]
        _ALONE[key] = out[:stops[0] + 1] if stops else out
    return _ALONE[key]


def tree_slots(engine) -> list[int]:
    tree = engine.blocks.tree
    slots, stack = [], list(tree.root.children.values()) if tree else []
    while stack:
        node = stack.pop()
        slots += node.slots.tolist()
        stack += node.children.values()
    return slots


def check_blocks(engine) -> None:
    """Between steps, every block's reference count is the number of tables and tree edges that
    hold it, and the host pool holds exactly the swapped requests' blocks."""
    pool, blocks = engine.blocks.pool, engine.blocks
    holders = Counter(b for table in pool.tables.values() for b in table) + Counter(tree_slots(engine))
    assert pool.allocator.ref_counts == [holders[b] for b in range(pool.allocator.num_blocks)]
    if blocks.host:
        swapped = sum(len(s.host_blocks) for s in blocks.swapped.values())
        assert blocks.host.num_free + swapped == engine.config.host_blocks


def check_clean(engine) -> None:
    """After a run: every block is free but those the tree caches, the host pool is empty, no
    queue holds anything, nothing stays locked."""
    check_blocks(engine)
    tree = engine.blocks.tree
    assert engine.blocks.pool.num_free + (tree.total_size if tree else 0) == engine.config.num_blocks
    assert not engine.blocks.pool.tables and not engine.blocks.locked and not engine.blocks.swapped
    assert tree is None or tree.locked_size == 0
    scheduler = engine.scheduler
    assert not scheduler.waiting and not scheduler.running and not scheduler.swapped
    assert all(r.is_done for r in engine.requests.values())


def check_step_rules(engine) -> None:
    """Every step stays in the token budget; chunked: decodes come before prefill chunks (those of
    requests that were running; swapped-in ones follow), and no chunk exceeds chunk_size."""
    config = engine.config
    for record in engine.log:
        if not config.batch_at_once:
            assert record.n_tokens <= config.token_budget, record
        if config.chunked:
            kinds = [w.kind for w in record.work if w.request_id not in record.swapped_in]
            assert kinds == sorted(kinds), record  # "decode" < "prefill"
            assert all(w.n_tokens <= config.prefill_chunk for w in record.work if w.kind == "prefill"), record


def run(engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[int, list[int]]:
    """Add each (step, prompt, params) before that step; step until all end. Returns what step()
    said each request produced."""
    pending, produced, step = sorted(arrivals, key=lambda a: a[0]), {}, 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            engine.add_request(pending[0][1], pending[0][2])
            pending.pop(0)
        for out in engine.step():
            produced.setdefault(out.request_id, []).append(out.token)
        check_blocks(engine)
        step += 1
        assert step < 3000, "the engine made no progress"
    return produced


def finish(engine) -> None:
    for _ in range(3000):
        if not engine.has_unfinished:
            return
        engine.step()
    raise AssertionError("the engine made no progress")


# ---- models -----------------------------------------------------------------------------------

def tiny_model(vocab: int, seed: int = 0) -> Transformer:
    """A one-layer model with random weights and a vocabulary of its own."""
    config = ModelConfig("tiny", n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab=vocab)
    rng = np.random.default_rng(seed)
    return Transformer(config, {name: rng.normal(0, 0.1, shape) for name, shape in weight_shapes(config).items()})


# ---- extend attention's pools ---------------------------------------------------------------------

def scattered_pool(rng, query_lens, prefix_lens, n_kv, group, d, block_size):
    """q, k_pool, v_pool (views of one K-beside-V pool), block tables of blocks scattered at
    random, query_starts and context_lens, for sequences adding `query_lens` tokens after
    `prefix_lens` cached ones."""
    context = np.asarray(prefix_lens) + np.asarray(query_lens)
    per_seq = -(-context // block_size)
    num_blocks = int(per_seq.sum()) + 3
    pool = rng.standard_normal((num_blocks, 2, block_size, n_kv, d)).astype(np.float32)
    order = rng.permutation(num_blocks)
    tables = np.full((len(context), per_seq.max()), -1, np.int64)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    q = rng.standard_normal((starts[-1], n_kv * group, d)).astype(np.float32)
    return q, pool[:, 0], pool[:, 1], tables, starts, context


def relative_error(got, reference) -> float:
    return float(np.abs(np.asarray(got, np.float64) - reference).max() / np.abs(reference).max())


def tolerance(args, reference) -> float:
    """The largest relative_error float32 rounding explains, statistically (errors of random
    sign): a score is a dot of D terms, A = max sum_t |q_t k_t| / sqrt(D) over the pairs, off by
    about sqrt(D) eps A; a softmax weight by twice that (its own score and the row's sum) plus
    the sums over the L <= context keys of both weights and weighted values, 2 sqrt(L) eps; a few
    more eps for exp and the final division. The output moves by that times max |v|."""
    q, k_pool, v_pool, tables, starts, context = args
    d = q.shape[-1]
    keys, values = (paged_attention.gather(pool, tables, context) for pool in (k_pool, v_pool))  # (B, ctx, K, D)
    largest_score, largest_value = 0.0, 0.0
    for b, length in enumerate(context):
        queries = np.abs(q[starts[b]:starts[b + 1]].astype(np.float64)).reshape(-1, d)
        own = np.abs(keys[b, :length].astype(np.float64)).reshape(-1, d)
        largest_score = max(largest_score, float((queries @ own.T).max()) / np.sqrt(d))
        largest_value = max(largest_value, float(np.abs(values[b, :length]).max()))
    terms = fp32_tolerance(d, 2 * largest_score, statistical=True) + fp32_tolerance(int(context.max()), 2,
                                                                                       statistical=True)
    return (terms + fp32_tolerance(4)) * largest_value / float(np.abs(reference).max())
