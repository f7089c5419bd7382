"""The MoE layer's numba face: routing, the sort, the permutation and the combine compiled too,
so that the whole layer (route, permute, the experts' grouped GEMMs, combine) runs in numba, with
the matrix products on one BLAS (numba's np.dot). The numpy modules (moe.routing, moe.dispatch)
define what each step must give; these follow them step for step and the tests hold them equal.
"""
from __future__ import annotations

import numba
import numpy as np

from infra_lab.moe.dispatch import Dispatch
from infra_lab.moe.experts import ExpertWeights, experts_numba
from infra_lab.moe.routing import Routing, capacity, check_bias, check_top_k, keep_within_capacity


@numba.njit(parallel=True, fastmath=True, error_model="numpy", cache=True)
def _top_k(x, router, bias, k, experts, weights, probs):
    # x (T, d) @ router (d, E) -> probs (T, E); experts (T, k) the k highest probs + bias, ties to
    # the lower expert; weights (T, k) their probs renormalised
    logits = np.dot(x, router)
    n_experts = router.shape[1]
    for t in numba.prange(x.shape[0]):
        row = logits[t]
        top = row.max()
        total = np.float32(0)
        for e in range(n_experts):
            probs[t, e] = np.exp(row[e] - top)
            total += probs[t, e]
        for e in range(n_experts):
            probs[t, e] /= total
        chosen_sum = np.float32(0)
        for j in range(k):  # the best expert not yet chosen: a strict > keeps the lower one on ties
            best = -1
            for e in range(n_experts):
                taken = False
                for i in range(j):
                    taken = taken or experts[t, i] == e
                if not taken and (best < 0 or probs[t, e] + bias[e] > probs[t, best] + bias[best]):
                    best = e
            experts[t, j] = best
            chosen_sum += probs[t, best]
        for j in range(k):
            weights[t, j] = probs[t, experts[t, j]] / chosen_sum
    return logits


def route(x: np.ndarray, router: np.ndarray, k: int, capacity_factor=None, bias=None) -> tuple[Routing, np.ndarray]:
    """moe.routing.route of x @ router, in numba: (routing, logits (T, E))."""
    n_tokens, n_experts = x.shape[0], router.shape[1]
    k = check_top_k(k, n_experts)
    slots = capacity(n_tokens, n_experts, k, capacity_factor)
    bias = np.zeros(n_experts, np.float32) if bias is None else np.ascontiguousarray(check_bias(bias, n_experts))
    experts = np.empty((n_tokens, k), np.int64)
    weights = np.empty((n_tokens, k), np.float32)
    probs = np.empty((n_tokens, n_experts), np.float32)
    logits = _top_k(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(router, np.float32), bias, k,
                    experts, weights, probs)
    return Routing(experts, weights, probs, keep_within_capacity(experts, n_experts, slots)), logits


@numba.njit(cache=True)
def _counting_sort(experts, kept, n_experts, tokens, offsets, slot_of):
    # the kept assignments, token-major, placed expert by expert in their order: moe.dispatch.plan
    n_tokens, k = experts.shape
    counts = np.zeros(n_experts, np.int64)
    for t in range(n_tokens):
        for j in range(k):
            if kept[t, j]:
                counts[experts[t, j]] += 1
    offsets[0] = 0
    for e in range(n_experts):
        offsets[e + 1] = offsets[e] + counts[e]
    fill = offsets[:-1].copy()
    for t in range(n_tokens):
        for j in range(k):
            if kept[t, j]:
                slot = fill[experts[t, j]]
                fill[experts[t, j]] += 1
                tokens[slot], slot_of[t, j] = t, slot
            else:
                slot_of[t, j] = -1


def plan(routing: Routing, n_experts: int) -> Dispatch:
    """moe.dispatch.plan by a counting sort."""
    n_tokens, k = routing.experts.shape
    tokens = np.empty(int(routing.kept.sum()), np.int64)
    offsets = np.empty(n_experts + 1, np.int64)
    slot_of = np.empty((n_tokens, k), np.int64)
    _counting_sort(routing.experts, routing.kept, n_experts, tokens, offsets, slot_of)
    return Dispatch(tokens, offsets, slot_of, np.where(routing.kept, routing.weights, 0).astype(np.float32))


@numba.njit(parallel=True, cache=True)
def permute(x, tokens):  # x (T, d) -> (N, d): row i is x[tokens[i]]
    out = np.empty((tokens.shape[0], x.shape[1]), x.dtype)
    for i in numba.prange(tokens.shape[0]):
        out[i] = x[tokens[i]]
    return out


@numba.njit(parallel=True, fastmath=True, cache=True)
def combine(out_sorted, slot_of, weights):  # (N, d), (T, k), (T, k) -> y (T, d)
    y = np.zeros((slot_of.shape[0], out_sorted.shape[1]), np.float32)
    for t in numba.prange(slot_of.shape[0]):
        for j in range(slot_of.shape[1]):
            slot = slot_of[t, j]
            if slot >= 0:
                w = weights[t, j]
                for c in range(out_sorted.shape[1]):
                    y[t, c] += w * out_sorted[slot, c]
    return y


def moe_layer_numba(x, router, weights: ExpertWeights, k: int, capacity_factor=None, bias=None):
    """(y, logits, routing, dispatch), every step compiled."""
    routing, logits = route(x, router, k, capacity_factor, bias)
    dispatch = plan(routing, weights.n_experts)
    out_sorted = experts_numba(permute(np.ascontiguousarray(x, np.float32), dispatch.tokens), dispatch.offsets,
                               weights)
    return combine(out_sorted, dispatch.slot_of, dispatch.weights), logits, routing, dispatch
