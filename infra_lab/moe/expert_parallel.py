"""Expert parallelism on torch.distributed: E experts spread over N processes, E / N each, and
tokens sent to their experts' owners and back with `all_to_all_single` (GShard, Lepikhin et al.
2021; gloo on CPUs, NCCL on GPUs).

Every rank holds its own tokens and a copy of the router. A forward pass on rank r:
1. routes its tokens (T_r, d) to their top-k experts;
2. decides which assignments fit their experts' capacity, exactly as the single-process layer
   would on all ranks' tokens stacked in rank order: an all-gather of every rank's counts per
   (choice, expert) tells each rank how many assignments queue ahead of its own;
3. sorts its kept assignments by expert, which groups them by owner, since rank q owns experts
   q E/N to (q + 1) E/N - 1, and sends each owner its rows (dispatch);
4. as an owner, runs each of its experts on the rows it received, from every rank;
5. sends the outputs back the way they came (combine), and adds each token's outputs times its
   gate weights.
The two exchanges go through `AllToAll`, whose backward is the same exchange the other way (the
gradient of a row goes back to the rank that sent it), so gradients reach x, the router and the
experts.
`overlapped` splits the kept assignments into chunks and exchanges one chunk while the experts
work on another (forward only).
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from infra_lab.moe import torch_moe
from infra_lab.moe.routing import capacity, check_capacity_factor, check_top_k


class Exchange(NamedTuple):
    rows_to: list[int]  # (N,): rows this rank sends each rank in dispatch (and gets back in combine)
    rows_from: list[int]  # (N,): rows it receives from each rank in dispatch
    bytes_to_others: int  # dispatch bytes sent to other ranks (combine returns as many)
    bytes_from_others: int


def experts_per_rank(n_experts: int, world: int) -> int:
    if n_experts % world:
        raise ValueError(f"{world} processes cannot share {n_experts} experts evenly: the world size must "
                         f"divide the number of experts (a divisor of {n_experts})")
    return n_experts // world


def check_agreement(group, **settings) -> None:
    """Raise the same ValueError on every rank when the ranks disagree on a setting (a width, an
    expert count, k), before any exchange whose sizes depend on it could hang."""
    world = dist.get_world_size(group)
    names = sorted(settings)
    mine = torch.tensor([float(settings[n]) for n in names], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    disagreements = []
    for i, name in enumerate(names):
        values = [float(t[i]) for t in every]
        if len(set(values)) > 1:
            disagreements.append(f"{name} ({', '.join(f'rank {r}: {v:g}' for r, v in enumerate(values))})")
    if disagreements:
        raise ValueError(f"the ranks disagree on {' and '.join(disagreements)}")


def global_kept(routing: torch_moe.TorchRouting, n_experts: int, capacity_factor: float | None,
                group) -> torch.Tensor:
    """(T_r, k) bool: which of this rank's assignments the single-process layer keeps, with every
    rank's tokens stacked in rank order."""
    experts = routing.experts
    n_tokens, k = experts.shape
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.stack([torch.bincount(experts[:, j], minlength=n_experts) for j in range(k)])  # (k, E)
    tokens = torch.tensor([n_tokens], dtype=torch.int64)
    every_counts, every_tokens = [torch.empty_like(mine) for _ in range(world)], [torch.empty_like(tokens)
                                                                                  for _ in range(world)]
    dist.all_gather(every_counts, mine, group=group)
    dist.all_gather(every_tokens, tokens, group=group)
    slots = capacity(int(sum(t.item() for t in every_tokens)), n_experts, k, capacity_factor)
    if slots is None:
        return torch.ones_like(experts, dtype=torch.bool)
    counts = torch.stack(every_counts)  # (N, k, E)
    before = counts.sum(0).cumsum(0) - counts.sum(0)  # (k, E): all ranks' earlier choices
    before = before + counts[:rank].sum(0)  # ... and earlier ranks' same choice
    kept = torch.empty_like(experts, dtype=torch.bool)
    for j in range(k):
        column = experts[:, j]
        order = torch.sort(column, stable=True).indices
        per_expert = torch.bincount(column, minlength=n_experts)
        place = torch.empty_like(order)
        place[order] = torch.arange(n_tokens) - torch.repeat_interleave(per_expert.cumsum(0) - per_expert, per_expert)
        kept[:, j] = before[j, column] + place < slots
    return kept


class AllToAll(torch.autograd.Function):
    """rows (sum(rows_to), d) -> (sum(rows_from), d): rows_to[q] rows go to rank q, rows_from[q]
    come from it. Backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, rows, rows_to: list[int], rows_from: list[int], group):
        ctx.rows_to, ctx.rows_from, ctx.group = rows_to, rows_from, group
        arrived = rows.new_empty(sum(rows_from), rows.shape[1])
        dist.all_to_all_single(arrived, rows.contiguous(), rows_from, rows_to, group=group)
        return arrived

    @staticmethod
    def backward(ctx, grad_arrived):
        grad_rows = grad_arrived.new_empty(sum(ctx.rows_to), grad_arrived.shape[1])
        dist.all_to_all_single(grad_rows, grad_arrived.contiguous(), ctx.rows_to, ctx.rows_from, group=ctx.group)
        return grad_rows, None, None, None


class _Plan(NamedTuple):
    routing: torch_moe.TorchRouting
    order: torch_moe.Sorted  # this rank's kept assignments, sorted by expert
    exchange: Exchange
    received_counts: torch.Tensor  # (N, E / N): rows from each rank for each of this rank's experts


def _plan(x, router, n_experts, k, capacity_factor, bias, group) -> _Plan:
    world = dist.get_world_size(group)
    local = experts_per_rank(n_experts, world)
    check_top_k(k, n_experts)
    capacity_factor = check_capacity_factor(capacity_factor)
    check_agreement(group, width=x.shape[1], experts=n_experts, k=k, capacity_factor=capacity_factor or 0)
    if router.shape != (x.shape[1], n_experts):
        raise ValueError(f"the router must be ({x.shape[1]}, {n_experts}); got {tuple(router.shape)}")
    routing = torch_moe.route(x @ router, k, None, bias)
    routing = routing._replace(kept=global_kept(routing, n_experts, capacity_factor, group))
    order = torch_moe.sort_by_expert(routing, n_experts)
    send_counts = torch.tensor(order.counts, dtype=torch.int64)  # (E,): rows for each expert
    received = torch.empty_like(send_counts)  # (N * local,): rows from rank s for my expert l at s * local + l
    dist.all_to_all_single(received, send_counts, group=group)
    rows_to = send_counts.reshape(world, local).sum(1).tolist()
    rows_from = received.reshape(world, local).sum(1).tolist()
    rank, width, item = dist.get_rank(group), x.shape[1], x.element_size()
    exchange = Exchange(rows_to, rows_from, width * item * (sum(rows_to) - rows_to[rank]),
                        width * item * (sum(rows_from) - rows_from[rank]))
    return _Plan(routing, order, exchange, received.reshape(world, local))


def _by_expert(received_counts: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups received rows (source-major: rank s's runs for each of my
    experts) expert-major, each expert's rows still in source order."""
    world, local = received_counts.shape
    starts = (received_counts.reshape(-1).cumsum(0) - received_counts.reshape(-1)).reshape(world, local)
    runs = [torch.arange(starts[s, e], starts[s, e] + received_counts[s, e])
            for e in range(local) for s in range(world)]
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64)


class ParallelOutput(NamedTuple):
    y: torch.Tensor  # (T_r, d)
    routing: torch_moe.TorchRouting
    exchange: Exchange


def moe_forward(x, router, gate, up, down, n_experts: int, k: int, capacity_factor: float | None = None,
                bias=None, group=None) -> ParallelOutput:
    """This rank's tokens x (T_r, d) through the expert-parallel layer; gate, up (E / N, d, f) and
    down (E / N, f, d) are this rank's experts. Differentiable."""
    plan = _plan(x, router, n_experts, k, capacity_factor, bias, group)
    world, local = plan.received_counts.shape
    if gate.shape[0] != local:
        raise ValueError(f"rank {dist.get_rank(group)} must hold {local} of the {n_experts} experts; got {gate.shape[0]}")
    rows = x[plan.order.assignment // k]  # (N_r, d), sorted by expert, so grouped by owner
    arrived = AllToAll.apply(rows, plan.exchange.rows_to, plan.exchange.rows_from, group)  # dispatch
    regroup = _by_expert(plan.received_counts)
    outputs = torch_moe.swiglu_experts(arrived[regroup], plan.received_counts.sum(0).tolist(), gate, up, down)
    outputs = torch.empty_like(outputs).index_copy(0, regroup, outputs)  # back to source-major
    returned = AllToAll.apply(outputs, plan.exchange.rows_from, plan.exchange.rows_to, group)  # combine
    return ParallelOutput(torch_moe.combine(returned, plan.order.assignment, plan.routing), plan.routing,
                          plan.exchange)


class Timing(NamedTuple):
    total_s: float  # the layer's wall time on this rank
    experts_s: float  # of which the experts' compute
    waiting_s: float  # of which blocked on an exchange: the exposed communication


@torch.no_grad()
def timed_forward(x, router, gate, up, down, n_experts: int, k: int, chunks: int = 1,
                  capacity_factor: float | None = None, group=None) -> tuple[torch.Tensor, Timing]:
    """The forward pass with its exchanges in `chunks` pieces. With one chunk each exchange must
    finish before the experts start; with more, chunk c + 1's dispatch is in flight while the
    experts work on chunk c, and chunk c's combine while they work on c + 1."""
    began = time.perf_counter()
    plan = _plan(x, router, n_experts, k, capacity_factor, None, group)
    world, local = plan.received_counts.shape
    rows = x[plan.order.assignment // k]
    # chunk c holds, of every (source, expert) run, the c-th share: each piece keeps the layout
    shares = [torch.div(plan.received_counts * (c + 1), chunks, rounding_mode="floor")
              - torch.div(plan.received_counts * c, chunks, rounding_mode="floor") for c in range(chunks)]
    sent = torch.tensor(plan.order.counts).reshape(world, local)
    send_shares = [torch.div(sent * (c + 1), chunks, rounding_mode="floor")
                   - torch.div(sent * c, chunks, rounding_mode="floor") for c in range(chunks)]
    pieces, starts = [], torch.cumsum(sent.reshape(-1), 0) - sent.reshape(-1)
    for c in range(chunks):  # the rows of chunk c, in expert order
        offset = sum(send_shares[:c], torch.zeros_like(sent)).reshape(-1)
        index = [torch.arange(starts[i] + offset[i], starts[i] + offset[i] + n)
                 for i, n in enumerate(send_shares[c].reshape(-1).tolist())]
        pieces.append(torch.cat(index) if index else torch.zeros(0, dtype=torch.int64))
    waiting = experts_time = 0.0
    dispatches = []
    for c in range(chunks):
        buffer = x.new_empty(int(shares[c].sum()), x.shape[1])
        work = dist.all_to_all_single(buffer, rows[pieces[c]].contiguous(), shares[c].sum(1).tolist(),
                                      send_shares[c].sum(1).tolist(), group=group, async_op=True)
        dispatches.append((buffer, work))
    combines = []
    for c in range(chunks):
        buffer, work = dispatches[c]
        started = time.perf_counter()
        work.wait()
        waiting += time.perf_counter() - started
        started = time.perf_counter()
        regroup = _by_expert(shares[c])
        out = torch_moe.swiglu_experts(buffer[regroup], shares[c].sum(0).tolist(), gate, up, down)
        out = torch.empty_like(out).index_copy(0, regroup, out)
        experts_time += time.perf_counter() - started
        back = x.new_empty(int(send_shares[c].sum()), x.shape[1])
        combines.append((back, dist.all_to_all_single(back, out, send_shares[c].sum(1).tolist(),
                                                      shares[c].sum(1).tolist(), group=group, async_op=True)))
    returned = x.new_empty(rows.shape[0], x.shape[1])
    for c, (back, work) in enumerate(combines):
        started = time.perf_counter()
        work.wait()
        waiting += time.perf_counter() - started
        returned[pieces[c]] = back
    y = torch_moe.combine(returned, plan.order.assignment, plan.routing)
    return y, Timing(time.perf_counter() - began, experts_time, waiting)
