"""One mixture-of-experts layer, end to end: route, permute, run the experts, combine. On numba
every step is compiled (moe.numba_layer); elsewhere routing and dispatch run in numpy and the
experts on the backend's face."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from infra_lab import backend as backends
from infra_lab.moe import dispatch as dispatching
from infra_lab.moe.experts import ExpertWeights, run_experts
from infra_lab.moe.numba_layer import moe_layer_numba
from infra_lab.moe.routing import Routing, route


class MoeOutput(NamedTuple):
    y: np.ndarray  # (T, d) float32
    logits: np.ndarray  # (T, E): the router's scores
    routing: Routing
    dispatch: dispatching.Dispatch


def moe_layer(x, router, weights: ExpertWeights, k: int, capacity_factor: float | None = None, bias=None,
              backend: backends.Backend | None = None) -> MoeOutput:
    """x (T, d) through router (d, E) and the experts: y[t] = sum over t's kept experts e of
    gate weight * expert_e(x[t]). A token whose every choice was dropped gets 0 (the residual
    stream carries it past the layer)."""
    x, router = np.asarray(x, np.float32), np.asarray(router, np.float32)
    if x.ndim != 2 or router.ndim != 2 or router.shape[0] != x.shape[1]:
        raise ValueError(f"need x (tokens, d) and a router (d, experts); got x {x.shape}, router {router.shape}")
    if router.shape[1] != weights.n_experts:
        raise ValueError(f"the router scores {router.shape[1]} experts but there are {weights.n_experts}")
    if (backend or backends.current()).name == "numba":
        return MoeOutput(*moe_layer_numba(x, router, weights, k, capacity_factor, bias))
    logits = x @ router  # (T, E)
    routing = route(logits, k, capacity_factor, bias)
    plan = dispatching.plan(routing, weights.n_experts)
    out_sorted = run_experts(dispatching.permute(x, plan), plan.offsets, weights, backend)
    return MoeOutput(dispatching.combine(np.asarray(out_sorted, np.float32), plan), logits, routing, plan)
