"""moe.dispatch, moe.experts and moe.layer: the sort-based permutation and its inverse, the three
faces of the grouped expert MLPs, and a whole layer against a token-by-token brute force."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab import backend as backends
from infra_lab.moe import dispatch as dispatching
from infra_lab.moe.experts import ExpertWeights, experts_numba, experts_numpy, experts_torch, silu
from infra_lab.moe.layer import moe_layer
from infra_lab.moe.routing import route

FACES = [experts_numpy, experts_numba]
try:
    import torch  # noqa: F401

    FACES.append(experts_torch)
except ImportError:
    pass


def random_experts(rng, n_experts, d, f):
    return ExpertWeights(*((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
                           for shape in ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tokens=st.integers(1, 30), n_experts=st.integers(1, 6),
       k=st.integers(1, 3), factor=st.sampled_from([None, 0.5, 1.0, 2.0]))
def test_the_sort_groups_each_experts_tokens_and_its_inverse_finds_them(seed, n_tokens, n_experts, k, factor):
    k = min(k, n_experts)
    rng = np.random.default_rng(seed)
    routing = route(rng.standard_normal((n_tokens, n_experts)), k, factor)
    plan = dispatching.plan(routing, n_experts)
    assert plan.offsets[0] == 0 and plan.offsets[-1] == routing.kept.sum() == len(plan.tokens)
    for e in range(n_experts):  # expert e's run: its kept tokens, in token order
        run = plan.tokens[plan.offsets[e]:plan.offsets[e + 1]]
        assert run.tolist() == sorted(t for t in range(n_tokens) for j in range(k)
                                      if routing.experts[t, j] == e and routing.kept[t, j])
    for t in range(n_tokens):
        for j in range(k):
            slot = plan.slot_of[t, j]
            assert (slot >= 0) == routing.kept[t, j]
            if slot >= 0:
                assert plan.tokens[slot] == t and plan.offsets[routing.experts[t, j]] <= slot \
                    < plan.offsets[routing.experts[t, j] + 1]
    x = rng.standard_normal((n_tokens, 5)).astype(np.float32)
    identity = dispatching.combine(dispatching.permute(x, plan), plan)  # experts that return their input
    assert np.allclose(identity, x * (routing.weights * routing.kept).sum(1, keepdims=True), atol=1e-6)


@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), counts=st.lists(st.integers(0, 9), min_size=1, max_size=5))
def test_every_face_runs_each_expert_on_its_run(seed, counts):
    rng = np.random.default_rng(seed)
    weights = random_experts(rng, len(counts), 8, 12)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    x = rng.standard_normal((offsets[-1], 8)).astype(np.float32)
    expected = np.zeros_like(x, dtype=np.float64)
    for e in range(len(counts)):
        for i in range(offsets[e], offsets[e + 1]):  # row by row, in float64
            row = x[i].astype(np.float64)
            hidden = silu(row @ weights.gate[e]) * (row @ weights.up[e])
            expected[i] = hidden @ weights.down[e]
    for face in FACES:
        assert np.allclose(face(x, offsets, weights), expected, rtol=1e-4, atol=1e-4), face.__name__


@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tokens=st.integers(1, 24), factor=st.sampled_from([None, 0.5, 1.5]),
       k=st.integers(1, 3))
def test_the_layer_is_the_token_by_token_sum_of_its_kept_experts(seed, n_tokens, factor, k):
    rng = np.random.default_rng(seed)
    n_experts, d = 4, 8
    weights, router = random_experts(rng, n_experts, d, 16), rng.standard_normal((d, n_experts)).astype(np.float32)
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    out = moe_layer(x, router, weights, k, factor)
    expected = np.zeros((n_tokens, d))
    for t in range(n_tokens):
        for j in range(k):
            if out.routing.kept[t, j]:
                e = out.routing.experts[t, j]
                hidden = silu(x[t] @ weights.gate[e]) * (x[t] @ weights.up[e])
                expected[t] += out.routing.weights[t, j] * (hidden @ weights.down[e])
    assert np.allclose(out.y, expected, rtol=1e-4, atol=1e-4)


W = ExpertWeights(np.zeros((2, 4, 6), np.float32), np.zeros((2, 4, 6), np.float32), np.zeros((2, 6, 4), np.float32))


@pytest.mark.parametrize("call, message", [
    (lambda: experts_numpy(np.zeros((3, 5)), [0, 1, 3], W), r"tokens must be \(N, 4\) for experts of width 4; got \(3, 5\)"),
    (lambda: experts_numba(np.zeros((3, 4)), [0, 2, 2], W), r"offsets must rise from 0 to the 3 rows"),
    (lambda: experts_numba(np.zeros((3, 4)), [0, 2], W), r"one run per each of 2 experts; got \[0, 2\]"),
    (lambda: experts_numpy(np.zeros((3, 4)), [0, 1, 3], W._replace(down=np.zeros((2, 4, 6)))),
     r"gate and up \(E, d, f\), down \(E, f, d\)"),
    (lambda: moe_layer(np.zeros((3, 4)), np.zeros((4, 3)), W, 1), "the router scores 3 experts but there are 2"),
    (lambda: moe_layer(np.zeros((3, 4)), np.zeros((5, 2)), W, 1), r"router \(d, experts\); got x \(3, 4\), router \(5, 2\)"),
    (lambda: moe_layer(np.zeros((3, 4)), np.zeros((4, 2)), W, 3), "k must be an integer from 1 to the 2 experts; got 3"),
    (lambda: moe_layer(np.zeros((3, 4)), np.zeros((4, 2)), W, 1, bias=np.zeros(5), backend=backends.resolve("numba")),
     r"the balancing bias must be \(2,\), one per expert; got \(5,\)"),
    (lambda: moe_layer(np.zeros((3, 4)), np.zeros((4, 2)), W, 1, 0, backend=backends.resolve("numba")),
     "capacity factor must be a number > 0"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.numerics
@pytest.mark.parametrize("factor", [None, 0.5, 1.25])
def test_the_differentiable_torch_layer_is_the_numpy_layer(factor):
    torch = pytest.importorskip("torch")
    from infra_lab.moe import torch_moe

    rng = np.random.default_rng(7)
    weights, router = random_experts(rng, 6, 8, 16), rng.standard_normal((8, 6)).astype(np.float32)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    bias = rng.uniform(-0.05, 0.05, 6).astype(np.float32)
    reference = moe_layer(x, router, weights, 2, factor, bias)
    y, routing, _ = torch_moe.moe_forward(torch.from_numpy(x), torch.from_numpy(router),
                                          *(torch.from_numpy(w) for w in weights), 2, factor, torch.from_numpy(bias))
    assert (routing.experts.numpy() == reference.routing.experts).all()
    assert (routing.kept.numpy() == reference.routing.kept).all()
    assert np.allclose(y.numpy(), reference.y, atol=1e-5)


@pytest.mark.numerics
def test_the_vectorised_silu_matches_float64_everywhere():
    from infra_lab.moe.experts import silu_times

    x = np.concatenate([np.linspace(-120, 120, 4001), [0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 200, -200]])
    hidden = x.astype(np.float32).reshape(1, -1).repeat(3, axis=0)
    lifted = np.random.default_rng(0).uniform(-2, 2, hidden.shape).astype(np.float32)
    expected = hidden.astype(np.float64) / (1 + np.exp(-hidden.astype(np.float64))) * lifted
    silu_times(hidden, lifted)
    assert np.allclose(hidden, expected, rtol=1e-5, atol=1e-30)  # float32 t = -x log2 e: about 4e-6 at x = -70


@pytest.mark.numerics
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tokens=st.integers(1, 40), n_experts=st.integers(1, 8), k=st.integers(1, 3),
       factor=st.sampled_from([None, 0.5, 1.25]), biased=st.booleans(), coarse=st.booleans())
def test_the_numba_layer_routes_sorts_and_combines_as_the_numpy_modules_do(seed, n_tokens, n_experts, k, factor,
                                                                         biased, coarse):
    from infra_lab.moe import numba_layer

    k = min(k, n_experts)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, 8)).astype(np.float32)
    router = np.round(rng.standard_normal((8, n_experts))) if coarse else rng.standard_normal((8, n_experts))
    x = np.round(x) if coarse else x  # integer logits: exact ties between experts
    router = router.astype(np.float32)
    bias = rng.uniform(-0.1, 0.1, n_experts).astype(np.float32) if biased else None
    weights = random_experts(rng, n_experts, 8, 12)
    y, logits, routing, plan = numba_layer.moe_layer_numba(x, router, weights, k, factor, bias)
    reference = moe_layer(x, router, weights, k, factor, bias, backend=backends.resolve("numpy"))
    assert (routing.experts == reference.routing.experts).all() and (routing.kept == reference.routing.kept).all()
    assert np.allclose(routing.weights, reference.routing.weights, atol=1e-6)
    for got, want in zip(plan, reference.dispatch):
        assert np.array_equal(got, want) if got.dtype.kind == "i" else np.allclose(got, want, atol=1e-6)
    assert np.allclose(y, reference.y, rtol=1e-4, atol=1e-4)
