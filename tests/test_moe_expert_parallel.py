"""moe.expert_parallel on 2 and 4 gloo processes: outputs, gradients and dropped tokens equal the
single-process layer's, the bytes exchanged equal the count from the routing, the chunked
(overlapped) exchange gives the same outputs, and bad input fails on every rank without hanging.
Both sides compute in float64: the outputs agree to float64's rounding whatever the CPU's
kernels, and no near-tie of two experts' scores can fall apart differently on the two sides."""
import functools

import numpy as np
import pytest
import torch
from _numerics import FP64_RELATIVE

from infra_lab.moe import expert_parallel, torch_moe
from infra_lab.processes import run_on_ranks

D, F, E = 8, 12, 8
DTYPE = torch.float64
ELEMENT = torch.empty((), dtype=DTYPE).element_size()  # bytes of one element of a token's row


def problem(seed: int, tokens_per_rank: list[int]):
    """Every rank's tokens stacked in rank order, the router, the experts, and the gradient that
    flows into y."""
    g = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_rank)
    x = torch.randn(total, D, generator=g, dtype=DTYPE)
    router = torch.randn(D, E, generator=g, dtype=DTYPE)
    gate = torch.randn(E, D, F, generator=g, dtype=DTYPE) / D ** 0.5
    up = torch.randn(E, D, F, generator=g, dtype=DTYPE) / D ** 0.5
    down = torch.randn(E, F, D, generator=g, dtype=DTYPE) / F ** 0.5
    return x, router, gate, up, down, torch.randn(total, D, generator=g, dtype=DTYPE)


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to float64's rounding: within FP64_RELATIVE of the expected tensor's largest value
    (measured: 2e-16 of it; in float32 it was 1.3e-7)."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0  # a rank may have no tokens
    return got.dtype == expected.dtype == DTYPE and torch.allclose(got, expected, rtol=0, atol=FP64_RELATIVE * scale)


def on_rank(seed, tokens_per_rank, k, factor):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, router, gate, up, down, grad_y = problem(seed, tokens_per_rank)
    first = sum(tokens_per_rank[:rank])
    rows = slice(first, first + tokens_per_rank[rank])
    local = E // world
    mine = slice(rank * local, (rank + 1) * local)
    x_r = x[rows].clone().requires_grad_()
    params = [t[mine].clone().requires_grad_() for t in (gate, up, down)]
    router_r = router.clone().requires_grad_()
    out = expert_parallel.moe_forward(x_r, router_r, *params, n_experts=E, k=k, capacity_factor=factor)
    (out.y * grad_y[rows]).sum().backward()
    chunked, _ = expert_parallel.timed_forward(x[rows], router, *(t[mine] for t in (gate, up, down)), n_experts=E,
                                               k=k, chunks=3, capacity_factor=factor)
    return {"y": out.y.detach(), "kept": out.routing.kept, "experts": out.routing.experts, "grad_x": x_r.grad,
            "grad_router": router_r.grad, "grad_experts": [p.grad for p in params], "exchange": out.exchange,
            "chunked_y": chunked}


CASES = [(2, [13, 9], 2, None), (2, [16, 16], 2, 1.0), (4, [7, 11, 0, 9], 2, 0.75), (4, [10, 10, 10, 10], 1, 1.25)]


def cases_on_rank(cases: list[tuple]) -> list[dict]:
    return [on_rank(world * 100 + k, tokens_per_rank, k, factor) for world, tokens_per_rank, k, factor in cases]


@functools.cache
def spawned(world: int) -> dict[tuple, list[dict]]:
    """Every case of one world size from one spawn (each costs seconds): case -> each rank's result."""
    cases = [case for case in CASES if case[0] == world]
    ranks = run_on_ranks(cases_on_rank, world, cases)
    return {repr(case): [rank[i] for rank in ranks] for i, case in enumerate(cases)}


@pytest.mark.numerics
@pytest.mark.parametrize("world, tokens_per_rank, k, factor", CASES)
def test_the_parallel_layer_equals_the_single_process_layer(world, tokens_per_rank, k, factor):
    seed = world * 100 + k
    results = spawned(world)[repr((world, tokens_per_rank, k, factor))]
    x, router, gate, up, down, grad_y = problem(seed, tokens_per_rank)
    x, params, router = x.requires_grad_(), [t.clone().requires_grad_() for t in (gate, up, down)], \
        router.clone().requires_grad_()
    y, routing, _ = torch_moe.moe_forward(x, router, *params, k, factor)
    (y * grad_y).sum().backward()
    if factor is not None:
        assert not routing.kept.all()  # the case drops tokens
    starts = np.cumsum([0] + tokens_per_rank)
    local = E // world
    for rank, result in enumerate(results):
        rows = slice(starts[rank], starts[rank + 1])
        assert (result["experts"] == routing.experts[rows]).all()
        assert (result["kept"] == routing.kept[rows]).all()  # the same tokens dropped
        assert close(result["y"], y[rows].detach())
        assert close(result["chunked_y"], y[rows].detach())
        assert close(result["grad_x"], x.grad[rows])
        for got, param in zip(result["grad_experts"], params):
            assert close(got, param.grad[rank * local:(rank + 1) * local])
        # bytes as predicted: every kept assignment whose expert another rank owns, d elements each
        owners = routing.experts[rows] // local
        away = int(((owners != rank) & routing.kept[rows]).sum())
        assert result["exchange"].bytes_to_others == away * D * ELEMENT
        assert sum(result["exchange"].rows_to) == int(routing.kept[rows].sum())
    assert close(sum(r["grad_router"] for r in results), router.grad)  # a replicated router
    assert sum(r["exchange"].bytes_to_others for r in results) == sum(r["exchange"].bytes_from_others for r in results)


def bad_rank(case):
    import torch.distributed as dist

    rank = dist.get_rank()
    width = D + (rank if case == "widths" else 0)
    x = torch.randn(5, width)
    experts = 6 if case == "divide" else E
    local = experts // dist.get_world_size() if case != "divide" else 1
    return expert_parallel.moe_forward(x, torch.randn(width, experts), torch.randn(local, width, F),
                                       torch.randn(local, width, F), torch.randn(local, F, width), n_experts=experts,
                                       k=2 if case != "k" else 9, capacity_factor=0 if case == "capacity" else None)


@pytest.mark.parametrize("world, case, message", [
    (4, "divide", "4 processes cannot share 6 experts evenly"),
    (2, "widths", r"the ranks disagree on width \(rank 0: 8, rank 1: 9\)"),
    (2, "k", "k must be an integer from 1 to the 8 experts; got 9"),
    (2, "capacity", "capacity factor must be a number > 0"),
])
def test_bad_input_fails_on_every_rank_without_hanging(world, case, message):
    with pytest.raises(ValueError, match=message):
        run_on_ranks(bad_rank, world, case, timeout_s=20)
