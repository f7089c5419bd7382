"""Top-k routing for a mixture of experts, and the three ways to keep the experts' loads even.

A router scores every token against every expert (logits = x @ W_router, (T, E)), and each token
goes to the k experts with the highest scores. Its output is the experts' outputs weighted by the
softmax of the scores, renormalised over the k chosen (Mixtral: a softmax over the top-k logits,
the same thing). Left alone, a router learns to favour a few experts, which then do most of the
work while the rest idle. Three fixes, each computed here:
- the Switch Transformer's auxiliary loss (Fedus et al. 2022, eq. 4), E * sum_i f_i P_i, with f_i
  the share of assignments expert i received and P_i its mean router probability: 1 at uniform
  routing, up to E when one expert takes everything;
- ST-MoE's router z-loss (Zoph et al. 2022, eq. 5), the mean squared log-sum-exp of the logits,
  which keeps them small enough for low-precision arithmetic;
- DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024, Section 2.1.2): a bias per
  expert added to the scores for choosing experts only, nudged down for an overloaded expert and
  up for an underloaded one by a fixed step times the sign of its load error.
A capacity (Switch, eq. 3: capacity factor x tokens x k / E slots per expert) bounds each
expert's work; assignments past it are dropped, first choices before second ones and earlier
tokens first. Without a capacity the routing is dropless.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np


class Routing(NamedTuple):
    experts: np.ndarray  # (T, k) int64: each token's chosen experts, best first
    weights: np.ndarray  # (T, k) float32: their gate weights, summing to 1 per token
    probs: np.ndarray  # (T, E) float32: the softmax of the logits over every expert
    kept: np.ndarray  # (T, k) bool: False where the expert's capacity was full (dropped)


def check_top_k(k, n_experts: int) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n_experts:
        raise ValueError(f"experts per token k must be an integer from 1 to the {n_experts} experts; got {k!r}")
    return int(k)


def check_capacity_factor(factor) -> float | None:
    """None (dropless) or a positive number."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor > 0:
        raise ValueError(f"the capacity factor must be a number > 0, or None for dropless routing; got {factor!r}")
    return float(factor)


def check_bias(bias, n_experts: int) -> np.ndarray:
    """The balancing bias as float32 (E,), or a ValueError naming its shape."""
    bias = np.asarray(bias, np.float32)
    if bias.shape != (n_experts,):
        raise ValueError(f"the balancing bias must be ({n_experts},), one per expert; got {bias.shape}")
    return bias


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(-1, keepdims=True)


def capacity(tokens: int, n_experts: int, k: int, factor: float | None) -> int | None:
    """Slots per expert: ceil(factor * tokens * k / E); None is dropless."""
    if check_capacity_factor(factor) is None:
        return None
    return math.ceil(factor * tokens * k / n_experts)


def route(logits, k: int, capacity_factor: float | None = None, bias=None) -> Routing:
    """Top-k routing of logits (T, E). `bias` (E,) is added to the probabilities when choosing
    experts, never to the gate weights (auxiliary-loss-free balancing)."""
    logits = np.asarray(logits, np.float32)
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"router logits must be (tokens, experts); got shape {logits.shape}")
    n_tokens, n_experts = logits.shape
    k = check_top_k(k, n_experts)
    probs = softmax(logits)
    scores = probs
    if bias is not None:
        scores = probs + check_bias(bias, n_experts)
    experts = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # ties: the lower expert first
    chosen = np.take_along_axis(probs, experts, axis=1)
    weights = (chosen / chosen.sum(1, keepdims=True)).astype(np.float32)
    slots = capacity(n_tokens, n_experts, k, capacity_factor)
    return Routing(experts, weights, probs, keep_within_capacity(experts, n_experts, slots))


def keep_within_capacity(experts: np.ndarray, n_experts: int, slots: int | None) -> np.ndarray:
    """(T, k) bool: each assignment kept while its expert has a free slot, taken in the order
    every token's first choice (token by token), then every second choice, and so on."""
    if slots is None:
        return np.ones(experts.shape, bool)
    n_tokens, k = experts.shape
    by_priority = experts.T.reshape(-1)  # (k * T,): all first choices in token order, then the second ...
    order = np.argsort(by_priority, kind="stable")  # grouped by expert, in priority order within each
    counts = np.bincount(by_priority, minlength=n_experts)
    starts = np.cumsum(counts) - counts
    place = np.empty(len(order), np.int64)
    place[order] = np.arange(len(order)) - np.repeat(starts, counts)  # its place in its expert's queue
    return (place < slots).reshape(k, n_tokens).T


def expert_loads(experts: np.ndarray, kept: np.ndarray, n_experts: int) -> np.ndarray:
    """(E,) int64: the assignments each expert received and kept."""
    return np.bincount(experts[kept], minlength=n_experts)


def switch_aux_loss(probs, experts) -> float:
    """E * sum_i f_i P_i: f_i the share of the T * k assignments routed to expert i (before any
    drops), P_i the mean probability the router gave it. 1 when both are uniform. (Hugging Face's
    load_balancing_loss_func divides by T instead of T * k, so it gives k there.)"""
    probs, experts = np.asarray(probs, np.float64), np.asarray(experts)
    n_experts = probs.shape[1]
    shares = np.bincount(experts.reshape(-1), minlength=n_experts) / experts.size
    return float(n_experts * np.sum(shares * probs.mean(0)))


def router_z_loss(logits) -> float:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(1))
    return float(np.mean(lse ** 2))


def update_bias(bias, loads, rate: float) -> np.ndarray:
    """DeepSeek-V3's step: b_i + rate * sign(mean load - load_i), a new (E,) float32 array."""
    bias, loads = np.asarray(bias, np.float32), np.asarray(loads, np.float64)
    if bias.shape != loads.shape or bias.ndim != 1:
        raise ValueError(f"need one bias and one load per expert; got bias {bias.shape}, loads {loads.shape}")
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not rate >= 0:
        raise ValueError(f"the bias update rate must be a number >= 0; got {rate!r}")
    return (bias + np.float32(rate) * np.sign(loads.mean() - loads).astype(np.float32)).astype(np.float32)
