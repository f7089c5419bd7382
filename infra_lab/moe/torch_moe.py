"""The MoE layer in torch, differentiable: for training the MoE model, and as the single-process
layer that expert parallelism (moe.expert_parallel) must reproduce. It follows moe.routing and
moe.dispatch step for step: the same stable sort picks the experts (ties to the lower index), the
same choice-major order fills each expert's capacity, and the same sort groups the tokens.
Gradients flow into x through the experts and the gate weights, and into the router through the
gate weights (the choice of experts itself has none).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from infra_lab.moe.routing import capacity, check_top_k


class TorchRouting(NamedTuple):
    experts: torch.Tensor  # (T, k) int64
    weights: torch.Tensor  # (T, k) float: gate weights, renormalised over the k chosen
    probs: torch.Tensor  # (T, E)
    kept: torch.Tensor  # (T, k) bool


def route(logits: torch.Tensor, k: int, capacity_factor: float | None = None,
          bias: torch.Tensor | None = None, choose=None) -> TorchRouting:
    """moe.routing.route on tensors: logits (T, E) -> the top-k experts, weights and drops.
    `choose(logits, k, bias)`, given, picks the experts instead ((T, k) int64, from detached
    tensors): chapter 09's last exercise trains the model with the reader's router."""
    n_tokens, n_experts = logits.shape
    k = check_top_k(k, n_experts)
    probs = torch.softmax(logits.float(), dim=-1)
    if choose is not None:
        experts = choose(logits.detach(), k, None if bias is None else bias.detach())
    else:
        scores = probs.detach() if bias is None else probs.detach() + bias
        experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower first
    chosen = probs.gather(1, experts)
    weights = chosen / chosen.sum(1, keepdim=True)
    slots = capacity(n_tokens, n_experts, k, capacity_factor)
    return TorchRouting(experts, weights, probs, kept_within(experts, n_experts, slots))


def kept_within(experts: torch.Tensor, n_experts: int, slots: int | None) -> torch.Tensor:
    """moe.routing.keep_within_capacity on tensors."""
    if slots is None:
        return torch.ones_like(experts, dtype=torch.bool)
    n_tokens, k = experts.shape
    by_priority = experts.T.reshape(-1)  # (k * T,): every first choice in token order, then the second ...
    order = torch.sort(by_priority, stable=True).indices
    counts = torch.bincount(by_priority, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order), device=experts.device) - torch.repeat_interleave(starts, counts)
    return (place < slots).reshape(k, n_tokens).T


def swiglu_experts(x_sorted: torch.Tensor, counts: list[int], gate, up, down) -> torch.Tensor:
    """x_sorted (N, d), expert e's rows a run of counts[e]; gate/up (E, d, f), down (E, f, d)."""
    outs = []
    for e, rows in enumerate(torch.split(x_sorted, counts)):
        outs.append((F.silu(rows @ gate[e]) * (rows @ up[e])) @ down[e])
    return torch.cat(outs) if outs else x_sorted[:0]


class Sorted(NamedTuple):
    assignment: torch.Tensor  # (N,) int64: the kept assignments (t * k + j), sorted by expert
    counts: list[int]  # (E,): rows per expert


def sort_by_expert(routing: TorchRouting, n_experts: int) -> Sorted:
    flat = routing.experts.reshape(-1)
    kept = torch.nonzero(routing.kept.reshape(-1)).squeeze(1)
    order = kept[torch.sort(flat[kept], stable=True).indices]
    return Sorted(order, torch.bincount(flat[order], minlength=n_experts).tolist())


def combine(out_sorted: torch.Tensor, assignment: torch.Tensor, routing: TorchRouting) -> torch.Tensor:
    """y (T, d): each kept assignment's expert output times its gate weight, summed per token."""
    n_tokens, k = routing.experts.shape
    gates = routing.weights.reshape(-1)[assignment]  # (N,)
    y = torch.zeros(n_tokens, out_sorted.shape[1], dtype=out_sorted.dtype, device=out_sorted.device)
    return y.index_add(0, assignment // k, gates[:, None] * out_sorted)


def moe_forward(x: torch.Tensor, router: torch.Tensor, gate, up, down, k: int,
                capacity_factor: float | None = None, bias: torch.Tensor | None = None, choose=None):
    """x (T, d) -> (y (T, d), routing, logits): one process, every expert here."""
    logits = x @ router
    routing = route(logits, k, capacity_factor, bias, choose)
    order = sort_by_expert(routing, gate.shape[0])
    out_sorted = swiglu_experts(x[order.assignment // k], order.counts, gate, up, down)
    return combine(out_sorted, order.assignment, routing), routing, logits


def switch_aux_loss(routing: TorchRouting) -> torch.Tensor:
    """moe.routing.switch_aux_loss, differentiable through the mean probabilities P_i (the shares
    f_i are counts): 1 at uniform routing."""
    n_experts = routing.probs.shape[1]
    shares = torch.bincount(routing.experts.reshape(-1), minlength=n_experts).to(routing.probs.dtype)
    return n_experts * torch.sum(shares / routing.experts.numel() * routing.probs.mean(0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def mixtral_block(x, router, gate, up, down, k: int) -> torch.Tensor:
    """The peer the numba layer is measured against: a layer in the manner of Hugging Face's
    Mixtral sparse MoE block (modeling_mixtral.py). Top-k of the softmax, renormalised; then for
    each expert, the tokens its one-hot mask selects, its MLP on them, scaled by their gate
    weights and added back with index_add_. Dropless, no bias."""
    probs = torch.softmax(x @ router, dim=-1)
    weights, chosen = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    mask = F.one_hot(chosen, gate.shape[0]).permute(2, 1, 0)  # (E, k, T)
    for e in range(gate.shape[0]):
        slot, token = torch.where(mask[e])
        if token.numel() == 0:
            continue
        rows = x[token]
        out = (F.silu(rows @ gate[e]) * (rows @ up[e])) @ down[e]
        y.index_add_(0, token, out * weights[token, slot, None])
    return y
