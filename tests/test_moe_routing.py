"""moe.routing: top-k gating, capacity dropping, the balance losses and the bias update, each
against a brute-force model written from its paper's definition."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab.moe.routing import (capacity, expert_loads, route, router_z_loss, switch_aux_loss,
                                   update_bias)


def brute_route(logits, k, slots, bias):
    """Token by token: softmax, rank experts by prob + bias (lower index first on ties), renormalise
    the chosen probs; then fill each expert's slots first choices first, earlier tokens first."""
    n_tokens, n_experts = logits.shape
    experts, weights = [], []
    for t in range(n_tokens):
        e = np.exp(logits[t].astype(np.float64) - logits[t].max())
        p = (e / e.sum()).astype(np.float32)
        score = p + (bias if bias is not None else 0)
        ranked = sorted(range(n_experts), key=lambda i: (-score[i], i))[:k]
        experts.append(ranked)
        weights.append([p[i] / sum(p[j] for j in ranked) for i in ranked])
    kept = np.ones((n_tokens, k), bool)
    if slots is not None:
        used = [0] * n_experts
        for j in range(k):
            for t in range(n_tokens):
                kept[t, j] = used[experts[t][j]] < slots
                used[experts[t][j]] += kept[t, j]
    return np.array(experts), np.array(weights), kept


@pytest.mark.numerics
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tokens=st.integers(1, 40), n_experts=st.integers(1, 9),
       k=st.integers(1, 4), factor=st.sampled_from([None, 0.25, 0.5, 1.0, 1.25, 2.0]), biased=st.booleans(),
       coarse=st.booleans())
def test_routing_matches_the_brute_force_model(seed, n_tokens, n_experts, k, factor, biased, coarse):
    k = min(k, n_experts)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n_tokens, n_experts)).astype(np.float32)
    if coarse:  # many exact ties
        logits = np.round(logits)
    bias = rng.uniform(-0.2, 0.2, n_experts).astype(np.float32) if biased else None
    routing = route(logits, k, factor, bias)
    slots = capacity(n_tokens, n_experts, k, factor)
    experts, weights, kept = brute_route(logits, k, slots, bias)
    assert (routing.experts == experts).all()
    assert np.allclose(routing.weights, weights, atol=1e-6) and np.allclose(routing.weights.sum(1), 1, atol=1e-6)
    assert (routing.kept == kept).all()
    loads = expert_loads(routing.experts, routing.kept, n_experts)
    assert loads.sum() == kept.sum() and (slots is None or loads.max() <= slots)


def test_capacity_is_the_switch_formula():
    assert capacity(4096, 8, 2, 1.25) == math.ceil(1.25 * 4096 * 2 / 8) == 1280
    assert capacity(10, 3, 1, 1.0) == 4 and capacity(10, 3, 1, None) is None


def test_the_bias_chooses_experts_but_never_weighs_them():
    logits = np.array([[2.0, 1.0, 0.0]], np.float32)
    plain, biased = route(logits, 2), route(logits, 2, bias=np.array([0, -1, 1], np.float32))
    assert plain.experts.tolist() == [[0, 1]] and biased.experts.tolist() == [[2, 0]]
    p = plain.probs[0]
    assert np.allclose(biased.weights[0], [p[2] / (p[0] + p[2]), p[0] / (p[0] + p[2])])


def test_the_switch_loss_is_one_when_uniform_and_the_expert_count_when_collapsed():
    n_experts = 8
    probs = np.full((64, n_experts), 1 / n_experts)
    spread = np.arange(128).reshape(64, 2) % n_experts  # every expert gets 16 of the 128 assignments
    assert switch_aux_loss(probs, spread) == pytest.approx(1)
    collapsed = np.zeros((64, n_experts))
    collapsed[:, 3] = 1
    assert switch_aux_loss(collapsed, np.full((64, 1), 3)) == pytest.approx(n_experts)


def test_the_z_loss_is_the_mean_squared_log_sum_exp():
    logits = np.array([[0.0, 0.0], [1000.0, 1000.0]])  # the second row would overflow a naive exp
    assert router_z_loss(logits) == pytest.approx((np.log(2) ** 2 + (1000 + np.log(2)) ** 2) / 2)


def test_the_bias_moves_against_each_experts_load_error():
    bias = update_bias(np.zeros(4), np.array([10, 2, 4, 4]), 0.01)  # mean load 5
    assert bias.dtype == np.float32 and np.allclose(bias, [-0.01, 0.01, 0.01, 0.01])
    assert np.allclose(update_bias(bias, np.array([5, 5, 5, 5]), 0.01), bias)


@pytest.mark.parametrize("call, message", [
    (lambda: route(np.zeros((4, 3)), 4), "k must be an integer from 1 to the 3 experts; got 4"),
    (lambda: route(np.zeros((4, 3)), 0), "k must be an integer from 1 to the 3 experts; got 0"),
    (lambda: route(np.zeros((4, 3)), 1, 0), r"capacity factor must be a number > 0, or None .*; got 0"),
    (lambda: route(np.zeros((4, 3)), 1, -1.5), r"capacity factor must be a number > 0, or None .*; got -1.5"),
    (lambda: route(np.zeros(3), 1), r"logits must be \(tokens, experts\); got shape \(3,\)"),
    (lambda: route(np.zeros((4, 3)), 1, bias=np.zeros(2)), r"bias must be \(3,\), one per expert; got \(2,\)"),
    (lambda: update_bias(np.zeros(3), np.zeros(3), -1), "rate must be a number >= 0; got -1"),
    (lambda: update_bias(np.zeros(3), np.zeros(4), 0.1), r"one load per expert; got bias \(3,\), loads \(4,\)"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_deepseek_v3s_parameters_counted_from_its_config_are_the_reports():
    from infra_lab.moe import published

    count = published.deepseek_v3_params()
    assert round(count.total / 1e9) == 671  # DeepSeek-V3 report, abstract: 671B total
    assert abs(count.active / 1e9 - 37) < 0.5  # and 37B activated per token
