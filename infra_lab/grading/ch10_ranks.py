"""What each of the two processes runs for chapter 10's last check (grading.ch10.zero1_step): the
reader's ZeRO-1 step, built from its source, on 23 random flat buffers against the package's step,
then training the shipped model for some steps beside plain data parallelism on the same batches.
"""
from __future__ import annotations

import collections

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

LR = 0.1  # the step cases' SGD
# The training case runs in float64, beside data parallelism in float64: the two are equal in exact
# arithmetic, and AdamW turns a last-bit difference in a gradient into a visible one over 20
# steps, so float32 holds them only to a gap that depends on the CPU's BLAS and threads
TRAIN_DTYPE = torch.float64
CASES = [(int(n), seed) for seed, n in enumerate(np.random.default_rng(10).integers(1, 300, 23))]  # (elements, seed)


class CountingDist:
    """torch.distributed as the reader's code sees it: every call counted by name."""

    def __init__(self):
        self.calls = collections.Counter()

    def __getattr__(self, name: str):
        found = getattr(dist, name)
        if not callable(found):
            return found

        def call(*args, **kwargs):
            self.calls[name] += 1
            return found(*args, **kwargs)
        return call


def _build(source: str, name: str, counting: CountingDist):
    namespace = {"torch": torch, "dist": counting, "nn": nn, "np": np}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102: the reader's own exercise
    return namespace[name]


def _one_case(step, reference, elements: int, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = world * -(-elements // world)
    g = torch.Generator().manual_seed(seed)
    start = torch.zeros(padded)
    start[:elements] = torch.randn(elements, generator=g)
    grads = torch.zeros(world, padded)
    grads[:, :elements] = torch.randn(world, elements, generator=g)
    results = []
    for function in (reference, step):  # plain SGD: Adam would hide a gradient that is not averaged
        flat, flat_grads = start.clone(), grads[rank].clone()
        shard = nn.Parameter(flat[rank * padded // world:(rank + 1) * padded // world])
        function(flat, flat_grads, shard, torch.optim.SGD([shard], lr=LR))
        results.append(flat)
    gap = float((results[0] - results[1]).abs().max())
    if gap <= 1e-6:
        return {"elements": elements, "match": True, "what": ""}
    summed = start - LR * grads.sum(0)  # the step with the sum, not the mean, of the ranks' gradients
    what = f"after one SGD step (lr {LR}) the parameters differ from ZeRO-1's by up to {gap:.3g}"
    if torch.allclose(results[1], summed, atol=1e-6):
        what += "; the gradient shard is the sum over the ranks: divide it by the world size"
    elif torch.equal(results[1][:elements], start[:elements]):
        what += "; nothing changed: step the optimizer on the shard, then all-gather it into flat_params"
    return {"elements": elements, "match": False, "what": what}


def zero1_step(flat_params, flat_grads, shard, optimizer):
    """The package's ZeRO-1 step, the reference: reduce-scatter the gradients, average, step this
    rank's shard, all-gather the shards into every rank's parameters."""
    world = dist.get_world_size()
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter_single(grad_shard, flat_grads)
    shard.grad = grad_shard / world
    optimizer.step()
    dist.all_gather_single(flat_params, shard.detach().clone())


def zero1_rank(source: str, name: str, steps: int) -> dict:
    from infra_lab.parallel import runs

    reference = zero1_step
    rank, world = dist.get_rank(), dist.get_world_size()
    counting = CountingDist()
    try:
        step = _build(source, name, counting)
        cases = [_one_case(step, reference, elements, seed) for elements, seed in CASES]
    except Exception as error:  # noqa: BLE001: the reader's bug is the finding
        return {"rank": rank, "error": f"zero1_step raised {type(error).__name__}: {error}"}
    settings = runs.Settings(steps=steps, dtype=TRAIN_DTYPE)
    model = runs.shipped_model(TRAIN_DTYPE)
    parameters = [p for p in model.parameters() if p.requires_grad]
    elements = sum(p.numel() for p in parameters)
    padded = world * -(-elements // world)
    flat, flat_grads = torch.zeros(padded, dtype=TRAIN_DTYPE), torch.zeros(padded, dtype=TRAIN_DTYPE)
    offset = 0
    for p in parameters:
        n = p.numel()
        flat[offset:offset + n] = p.detach().reshape(-1)
        p.data = flat[offset:offset + n].view_as(p)
        p.grad = flat_grads[offset:offset + n].view_as(p)  # backward adds into these
        offset += n
    shard = nn.Parameter(flat[rank * padded // world:(rank + 1) * padded // world])
    optimizer = runs.adamw(settings)([shard])
    share = slice(rank * settings.batch // world, (rank + 1) * settings.batch // world)
    counting.calls.clear()
    losses = []
    try:
        for x, y in runs.batches(settings):
            loss = runs.loss_of(model(x[share]), y[share])
            loss.backward()
            step(flat, flat_grads, shard, optimizer)
            flat_grads.zero_()
            losses.append(loss.item())
    except Exception as error:  # noqa: BLE001
        return {"rank": rank, "error": f"zero1_step raised {type(error).__name__} while training: {error}"}
    states = [v for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    ddp = runs.train_rank("ddp", settings)
    weights = model.numpy_weights()
    gap = max(float(np.max(np.abs(weights[n] - v))) for n, v in ddp["weights"].items()) if rank == 0 else 0.0
    return {"rank": rank, "cases": cases, "losses": losses, "ddp_losses": ddp["losses"], "weight_gap": gap,
            "calls": dict(counting.calls), "optimizer_bytes": sum(t.numel() * t.element_size() for t in states),
            "optimizer_bytes_modelled": 2 * flat.element_size() * (padded // world)}  # AdamW: two moments per element
