"""Dispatch and combine by sorting: the tokens each expert must process, made contiguous.

Routing leaves T * k (token, expert) assignments in token order. Sorting them by expert (a stable
sort, so each expert's tokens keep their order) turns them into E contiguous runs, so each
expert multiplies one dense block of rows: x_sorted = x[tokens], expert e's rows are
x_sorted[offsets[e]:offsets[e + 1]]. The inverse permutation, slot_of[t, j] (the sorted row that
holds token t's j-th assignment, -1 where it was dropped), brings the results home: y[t] = sum
over j of weights[t, j] * out[slot_of[t, j]]. Every token gathers its own rows, so the combine
needs no atomic adds and gives the same sums in the same order on every run.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from infra_lab.moe.routing import Routing


class Dispatch(NamedTuple):
    tokens: np.ndarray  # (N,) int64: the token in each sorted row, N = kept assignments
    offsets: np.ndarray  # (E + 1,) int64: expert e's rows are [offsets[e], offsets[e + 1])
    slot_of: np.ndarray  # (T, k) int64: the sorted row of each assignment, -1 if dropped
    weights: np.ndarray  # (T, k) float32: the gate weights, 0 where dropped

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)


def plan(routing: Routing, n_experts: int) -> Dispatch:
    """The sort of routing's kept assignments by expert, and its inverse."""
    n_tokens, k = routing.experts.shape
    flat_experts = routing.experts.reshape(-1)  # (T * k,), token-major
    kept = np.flatnonzero(routing.kept.reshape(-1))
    order = kept[np.argsort(flat_experts[kept], kind="stable")]  # (N,): assignment ids by expert
    counts = np.bincount(flat_experts[order], minlength=n_experts)
    slot_of = np.full(n_tokens * k, -1, np.int64)
    slot_of[order] = np.arange(len(order))
    weights = np.where(routing.kept, routing.weights, 0).astype(np.float32)
    return Dispatch(order // k, np.concatenate([[0], np.cumsum(counts)]), slot_of.reshape(n_tokens, k), weights)


def permute(x: np.ndarray, dispatch: Dispatch) -> np.ndarray:
    """x (T, d) -> x_sorted (N, d): each expert's tokens in one contiguous run."""
    return np.ascontiguousarray(x[dispatch.tokens])


def combine(out_sorted: np.ndarray, dispatch: Dispatch) -> np.ndarray:
    """out_sorted (N, d) -> y (T, d): each token's expert outputs times its gate weights."""
    n_tokens, k = dispatch.slot_of.shape
    y = np.zeros((n_tokens, out_sorted.shape[1]), np.float32)
    for j in range(k):
        slots = dispatch.slot_of[:, j]
        has = slots >= 0
        y[has] += dispatch.weights[has, j, None] * out_sorted[slots[has]]
    return y
