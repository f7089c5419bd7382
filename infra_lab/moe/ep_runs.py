"""What each process runs when chapter 09 and benchmarks/moe.py try expert parallelism: functions
for `infra_lab.processes.run_on_ranks`, which must import them by name in a fresh process.

- `exactness_rank`: the expert-parallel layer's output, gradients, drops and bytes on this rank,
  against the single-process layer over every rank's tokens, which each rank also computes;
- `overlap_rank`: the layer's exposed communication with the exchange whole and in chunks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from infra_lab.moe import expert_parallel, torch_moe


def problem(seed: int, tokens: int, d: int, f: int, n_experts: int):
    """x (tokens, d), router (d, E), gate/up (E, d, f), down (E, f, d) and the gradient flowing
    into y (tokens, d), float32, the same on every rank for a seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    router = torch.randn(d, n_experts, generator=g) / d ** 0.5
    gate, up = (torch.randn(n_experts, d, f, generator=g) / d ** 0.5 for _ in range(2))
    down = torch.randn(n_experts, f, d, generator=g) / f ** 0.5
    return x, router, gate, up, down, torch.randn(tokens, d, generator=g)


def exactness_rank(seed: int, tokens_per_rank: list[int], d: int, f: int, n_experts: int, k: int,
                   capacity_factor: float | None) -> dict:
    """On this rank: the parallel layer on its tokens, forward and backward, beside the
    single-process layer on all tokens. Largest differences, whether the same assignments were
    dropped, the rows sent to each rank, and the bytes sent to others against the count from the
    routing (every kept assignment whose expert another rank owns: d values of 4 bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, router, gate, up, down, grad_y = problem(seed, sum(tokens_per_rank), d, f, n_experts)
    first = sum(tokens_per_rank[:rank])
    rows = slice(first, first + tokens_per_rank[rank])
    local = expert_parallel.experts_per_rank(n_experts, world)
    mine = slice(rank * local, (rank + 1) * local)
    x_r = x[rows].clone().requires_grad_()
    params = [t[mine].clone().requires_grad_() for t in (gate, up, down)]
    out = expert_parallel.moe_forward(x_r, router, *params, n_experts=n_experts, k=k, capacity_factor=capacity_factor)
    (out.y * grad_y[rows]).sum().backward()
    x_all, every = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in (gate, up, down)]
    y, single, _ = torch_moe.moe_forward(x_all, router, *every, k, capacity_factor)
    (y * grad_y).sum().backward()
    owners = out.routing.experts // local
    away = int(((owners != rank) & out.routing.kept).sum())
    y, out_y = y.detach(), out.y.detach()
    return {"y_gap": float((out_y - y[rows]).abs().max()) if out_y.numel() else 0.0,
            "grad_x_gap": float((x_r.grad - x_all.grad[rows]).abs().max()) if x_r.grad.numel() else 0.0,
            "grad_experts_gap": max(float((p.grad - e.grad[mine]).abs().max()) for p, e in zip(params, every)),
            "same_drops": bool((out.routing.kept == single.kept[rows]).all()),
            "dropped": int((~out.routing.kept).sum()), "rows_to": list(out.exchange.rows_to),
            "bytes_to_others": out.exchange.bytes_to_others, "bytes_by_count": away * d * x.element_size()}


def overlap_rank(sizes: dict, rounds: int, seed: int) -> dict:
    """This rank's timings of the layer with one chunk and with sizes["chunks"], `rounds` each
    after a warm-up, taking turns; whether both give the same output; bytes sent against the count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d, f, e, k = sizes["d"], sizes["f"], sizes["experts"], sizes["k"]
    x_all, router, gate, up, down, _ = problem(seed, 1, d, f, e)
    local = expert_parallel.experts_per_rank(e, world)
    mine = [w[rank * local:(rank + 1) * local].contiguous() for w in (gate, up, down)]
    x = torch.randn(sizes["ep_tokens_per_rank"], d, generator=torch.Generator().manual_seed(seed + 1 + rank))
    timings = {1: [], sizes["chunks"]: []}
    outputs = {}
    for _ in range(rounds + 1):  # the first round warms up
        for chunks in timings:
            dist.barrier()
            y, timing = expert_parallel.timed_forward(x, router, *mine, n_experts=e, k=k, chunks=chunks)
            timings[chunks].append(timing)
            outputs[chunks] = y
    same = bool(torch.allclose(outputs[1], outputs[sizes["chunks"]], atol=1e-5))
    with torch.no_grad():
        plain = expert_parallel.moe_forward(x, router, *mine, n_experts=e, k=k)
    owners = plain.routing.experts // local
    away = int(((owners != rank) & plain.routing.kept).sum())
    return {"timings": {c: [t._asdict() for t in ts[1:]] for c, ts in timings.items()}, "same_output": same,
            "bytes_to_others": plain.exchange.bytes_to_others, "bytes_by_formula": away * d * x.element_size()}
