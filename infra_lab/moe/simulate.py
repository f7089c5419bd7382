"""A toy router for chapter 09's explorer: what balancing does for any number of experts and k.

The trained MoE model has one shape (8 experts, top-2). To see loads for other shapes without
training a model for each, this simulates a router that has learned to prefer some experts:
each token's logits are a fixed preference per expert (a normal draw times SKEW, the same for
every token) plus the token's own normal noise. The balancing methods then correct the
preference with the package's own functions, for STEPS batches of TOKENS tokens:
- "bias": moe.routing.update_bias on every batch's loads, at a rate scaled to the
  probabilities' size (RATE / E, since an expert's probability is about 1 / E);
- "aux": gradient steps on the preference with the Switch auxiliary loss
  (moe.torch_moe.switch_aux_loss, the gradient flowing through the mean probabilities);
- "none": the preference as it is.
A fresh batch is then routed with the capacity factor. There is no language-model loss pulling
against the balancing here, so the methods balance better than in real training; the trained
model's real loads are the chapter's experiment, this is its explorer.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from infra_lab.moe import routing

SKEW = 1.0  # the preference's spread, in logits
TOKENS, STEPS = 1024, 50  # per batch; batches of balancing
RATE = 0.2  # the bias step, times 1 / E
AUX_STEP = 0.3  # gradient step on the preference for the aux loss, times E (its gradient scales as 1 / E)
METHODS = ("none", "aux", "bias")


class SimulatedLoads(NamedTuple):
    received: np.ndarray  # (E,) assignments routed to each expert
    kept: np.ndarray  # (E,) assignments each expert kept within its capacity
    slots: int | None  # capacity per expert
    dropped: float  # share of assignments dropped

    @property
    def max_over_mean(self) -> float:
        return float(self.received.max() / self.received.mean())


def _batch(preference: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return (preference + rng.standard_normal((TOKENS, len(preference)))).astype(np.float32)


class ToyRouter(NamedTuple):
    preference: np.ndarray  # (E,) float32: the logit each expert gets on every token
    bias: np.ndarray  # (E,) float32: the balancing bias (zero unless "bias")
    k: int


def balanced_router(n_experts: int, k: int, method: str, seed: int = 0) -> ToyRouter:
    """The toy router's preference after STEPS batches of balancing by `method`."""
    k = routing.check_top_k(k, n_experts)
    if method not in METHODS:
        raise ValueError(f"unknown balancing {method!r}; choose one of {', '.join(METHODS)}")
    rng = np.random.default_rng(seed)
    preference = (rng.standard_normal(n_experts) * SKEW).astype(np.float32)
    bias = np.zeros(n_experts, np.float32)
    if method == "bias":
        for _ in range(STEPS):
            chosen = routing.route(_batch(preference, rng), k, bias=bias)
            bias = routing.update_bias(bias, routing.expert_loads(chosen.experts, chosen.kept, n_experts),
                                       RATE / n_experts)
    elif method == "aux":
        preference = _aux_balanced(preference, k, rng)
    return ToyRouter(preference, bias, k)


def loads(router: ToyRouter, capacity_factor: float | None, seed: int = 1) -> SimulatedLoads:
    """The router's loads on a fresh batch of TOKENS tokens, within the capacity."""
    n_experts = len(router.preference)
    final = routing.route(_batch(router.preference, np.random.default_rng(seed)), router.k, capacity_factor,
                          bias=router.bias)
    received = np.bincount(final.experts.reshape(-1), minlength=n_experts)
    kept = routing.expert_loads(final.experts, final.kept, n_experts)
    slots = routing.capacity(TOKENS, n_experts, router.k, capacity_factor)
    return SimulatedLoads(received, kept, slots, float(1 - kept.sum() / received.sum()))


def simulate(n_experts: int, k: int, method: str, capacity_factor: float | None, seed: int = 0) -> SimulatedLoads:
    """Loads of the toy router after balancing by `method`, on a fresh batch."""
    routing.check_capacity_factor(capacity_factor)
    return loads(balanced_router(n_experts, k, method, seed), capacity_factor, seed + 1)


def _aux_balanced(preference: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    import torch

    from infra_lab.moe import torch_moe

    learned = torch.tensor(preference, requires_grad=True)
    for _ in range(STEPS):
        logits = learned + torch.from_numpy(rng.standard_normal((TOKENS, len(preference))).astype(np.float32))
        loss = torch_moe.switch_aux_loss(torch_moe.route(logits, k))
        (gradient,) = torch.autograd.grad(loss, learned)
        with torch.no_grad():
            learned -= AUX_STEP * len(preference) * gradient
    return learned.detach().numpy()
