"""What each process runs when chapter 10 tries pipeline parallelism: functions for
`infra_lab.processes.run_on_ranks`, which must import them by name in a fresh process.

- `exactness_rank`: the shipped target model cut into one stage per process, trained a few SGD
  steps with each schedule; its loss and its stage's gradients against one process's full batch;
- `bubble_rank`: balanced stages (the same identical transformer blocks on every stage, no
  embedding or head), run with each schedule and micro-batch count, their logs for `idle_share`;
- `measure_bubble`: runs `bubble_rank` and sets the measured idle share beside (p - 1) / (m + p - 1);
- `sleep_rank`: stages that only sleep, for the cost of the messages alone (`pipeline.crossings`).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from infra_lab.model import corpus, weights
from infra_lab.model.config import ModelConfig
from infra_lab.model.torch_model import TorchTransformer, rope_tables
from infra_lab.parallel import pipeline


def training_windows(batch: int, tokens: int, seed: int) -> torch.Tensor:
    """(batch, tokens + 1) int64: random windows of the training bytes, inputs and their targets.
    The parent reads the corpus once and hands the windows to every rank."""
    train_bytes, _ = corpus.load()
    starts = np.random.default_rng(seed).integers(0, len(train_bytes) - tokens - 1, size=batch)
    return torch.from_numpy(np.stack([train_bytes[s:s + tokens + 1] for s in starts]).astype(np.int64))


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    """p <- p - lr * grad, and the gradients cleared (plain SGD; torch.optim would import
    torch._dynamo, seconds in every fresh process)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def stage_model(model: TorchTransformer, layers: range, first: bool, last: bool) -> TorchTransformer:
    """Keep only the stage's weights (in place): its blocks, plus the embedding on the first stage
    and the final norm and LM head on the last."""
    keep = {f"layers.{i}." for i in layers}
    for name in list(model.weights):
        dotted = name.replace("__", ".")
        mine = any(dotted.startswith(prefix) for prefix in keep) or (first and dotted == "embed") or \
            (last and dotted in ("final_norm", "lm_head"))
        if not mine:
            del model.weights[name]
    return model


def model_forward(model: TorchTransformer, layers: range, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                  first: bool, last: bool, losses: list[torch.Tensor]):
    """The stage's forward(micro, x) for `pipeline.execute`. The last stage returns the summed
    cross-entropy of the micro-batch over all the batch's tokens, so the micro-batches' losses add
    up to the batch's mean (and their gradients to its gradient); it appends each to `losses`."""
    micro_tokens = inputs[0].shape[1]
    cos, sin = rope_tables(model.config, torch.arange(micro_tokens))
    total_tokens = sum(t.numel() for t in targets)

    def forward(micro: int, x: torch.Tensor | None) -> torch.Tensor:
        if first:
            x = model.w("embed")[inputs[micro]]  # (b, T, d)
        for i in layers:
            x = model.block(x, i, cos, sin)  # (b, T, d)
        if not last:
            return x
        logits = model.head(x)  # (b, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets[micro].flatten(), reduction="sum") / total_tokens
        losses.append(loss.detach())
        return loss

    return forward


def exactness_rank(kinds: list[str], micro_batches: int, windows: torch.Tensor, steps: int, lr: float,
                   dtype: torch.dtype = torch.float32) -> dict:
    """On this rank, for each schedule: `steps` SGD steps of the target model cut into one stage
    per process, on `windows` (B, T + 1) (`training_windows`) in `micro_batches` micro-batches,
    beside the same steps on the whole model and batch in this process. Per schedule: the largest
    differences over the steps of the loss (last stage; None elsewhere) and of the stage's
    gradients, the stage's parameter names, and the last step's log. Both runs compute, and the
    stages send, in `dtype`."""
    rank, stages = dist.get_rank(), dist.get_world_size()
    saved, config, _ = weights.load(weights.path_for("target"))
    layers = pipeline.split_layers(config.n_layers, stages)[rank]
    first, last = rank == 0, rank == stages - 1
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
    batch, tokens = x.shape
    inputs, targets = pipeline.split_batch(x, micro_batches), pipeline.split_batch(y, micro_batches)
    plans = {kind: pipeline.schedule(kind, stages, micro_batches) for kind in kinds}
    reference = TorchTransformer(config, saved).to(dtype)
    expected = []  # per step: (loss, {name: gradient})
    for _ in range(steps):
        loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        loss.backward()
        expected.append((loss.item(), {n: p.grad.clone() for n, p in reference.weights.items()}))
        sgd_step(reference, lr)
    results = {}
    for kind in kinds:
        model = stage_model(TorchTransformer(config, saved).to(dtype), layers, first, last)
        loss_gap, grad_gap = (0.0 if last else None), 0.0
        for step in range(steps):
            losses: list[torch.Tensor] = []
            forward = model_forward(model, layers, inputs, targets, first, last, losses)
            log = pipeline.execute(plans[kind], forward, (batch // micro_batches, tokens, config.d_model), dtype=dtype)
            if last:
                loss_gap = max(loss_gap, abs(float(sum(losses)) - expected[step][0]))
            grad_gap = max([grad_gap] + [float((p.grad - expected[step][1][n]).abs().max())
                                         for n, p in model.weights.items()])
            sgd_step(model, lr)
        results[kind] = {"loss_gap": loss_gap, "grad_gap": grad_gap, "log": log,
                         "parameters": [n.replace("__", ".") for n in model.weights]}
    return results


def balanced_forward(model: TorchTransformer, first: bool, last: bool, shape: tuple[int, int, int], seed: int):
    """A balanced stage's forward(micro, x): the model's blocks on (b, T, d). The first stage's
    input is a leaf that needs its gradient, so its backward does the same work as the others'; the
    last stage's loss, the mean square of its output, costs next to nothing."""
    cos, sin = rope_tables(model.config, torch.arange(shape[1]))
    start = torch.randn(shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)  # (b, T, d)

    def forward(micro: int, x: torch.Tensor | None) -> torch.Tensor:
        x = start if first else x
        for i in range(model.config.n_layers):
            x = model.block(x, i, cos, sin)  # (b, T, d)
        return x.square().mean() if last else x

    return forward


class _Sleep(torch.autograd.Function):
    """x -> x, sleeping `forward_s` on the way forward and `backward_s` on the way back: a stage
    that takes a known time and leaves the cores free."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


def sleeping_forward(first: bool, last: bool, shape: tuple[int, ...], forward_s: float, backward_s: float):
    """A stage's forward(micro, x) that only sleeps, forward_s one way and backward_s back: the
    stages are equal to the microsecond, and no stage competes for a core, so what the bubble
    shows beyond the formula is the messages' cost and the scheduling around them."""
    start = torch.zeros(shape, requires_grad=True)

    def forward(micro: int, x: torch.Tensor | None) -> torch.Tensor:
        y = _Sleep.apply(start if first else x, forward_s, backward_s)
        return y.sum() * 0.0 if last else y

    return forward


def sleep_rank(kinds: list[str], micro_counts: list[int], shape: tuple[int, ...], forward_s: float,
               backward_s: float, repeats: int) -> dict:
    """This rank's logs with stages that only sleep (`sleeping_forward`): {(kind, m): [Log per
    repeat]}, after one untimed run of each schedule."""
    rank, stages = dist.get_rank(), dist.get_world_size()
    forward = sleeping_forward(rank == 0, rank == stages - 1, shape, forward_s, backward_s)
    for kind in kinds:
        pipeline.execute(pipeline.schedule(kind, stages, 1), forward, shape)
    return {(kind, m): [pipeline.execute(pipeline.schedule(kind, stages, m), forward, shape)
                        for _ in range(repeats)] for kind in kinds for m in micro_counts}


def on_core_share(log: pipeline.Log) -> float:
    """The share of a rank's compute time its thread was on a core: CPU seconds over wall seconds.
    Well below 1 means the OS gave the core to something else (another program) mid-operation."""
    return sum(e.cpu for e in log.events) / sum(e.end - e.start for e in log.events)


def bubble_rank(kinds: list[str], micro_counts: list[int], sizes: dict, repeats: int, seed: int,
                min_on_core: float = 0.0, attempts: int = 1, prefetch: bool = True) -> dict:
    """This rank's logs with balanced stages: every rank runs sizes["blocks"] identical blocks
    (width sizes["d"]) on micro-batches of (sizes["micro_batch"], sizes["tokens"], d).
    The largest batch of each schedule runs first, untimed (a warm-up: memory and caches); then
    each repeat runs every (kind, m) in turn, so a slow moment of the machine spreads over all.
    A run counts when every rank's thread was on its core for at least `min_on_core` of its
    compute time (`on_core_share`); otherwise it is discarded and run again, up to `attempts`
    times in all (the last attempt counts whatever its share). `prefetch` goes to
    `pipeline.execute`. Returns {"logs": {(kind, m): [Log per repeat]}, "discarded": {(kind, m):
    runs discarded}}."""
    rank, stages = dist.get_rank(), dist.get_world_size()
    d = sizes["d"]
    config = ModelConfig("balanced-stage", n_layers=sizes["blocks"], d_model=d, n_heads=4, n_kv_heads=2, d_ff=4 * d)
    model = TorchTransformer(config, seed=seed)  # the same weights on every rank
    shape = (sizes["micro_batch"], sizes["tokens"], d)
    forward = balanced_forward(model, rank == 0, rank == stages - 1, shape, seed)

    def run(kind: str, m: int) -> pipeline.Log:
        model.zero_grad(set_to_none=True)
        return pipeline.execute(pipeline.schedule(kind, stages, m), forward, shape, prefetch=prefetch)

    for kind in kinds:
        run(kind, max(micro_counts))
    runs = [(kind, m) for kind in kinds for m in micro_counts]
    logs: dict[tuple[str, int], list[pipeline.Log]] = {key: [] for key in runs}
    discarded = dict.fromkeys(runs, 0)
    for _ in range(repeats):
        for key in runs:
            for attempt in range(attempts):
                log = run(*key)
                share = torch.tensor([on_core_share(log)])
                dist.all_reduce(share, op=dist.ReduceOp.MIN)  # every rank takes the same decision
                if share.item() >= min_on_core or attempt == attempts - 1:
                    break
                discarded[key] += 1
            logs[key].append(log)
    return {"logs": logs, "discarded": discarded}


def stage_imbalance(logs: list[pipeline.Log]) -> float:
    """(most - least) / least compute seconds over the ranks of one run: 0 for balanced stages."""
    busy = [sum(e.end - e.start for e in log.events) for log in logs]
    return (max(busy) - min(busy)) / min(busy)


def measure_bubble(stages: int = 2, micro_counts=(1, 2, 4, 8, 16), kinds=pipeline.KINDS, sizes: dict | None = None,
                   repeats: int = 5, seed: int = 0, min_on_core: float = 0.95, attempts: int = 5,
                   prefetch: bool = True, timeout_s: float = 600) -> list[dict]:
    """Run `bubble_rank` on `stages` processes. Per schedule and micro-batch count, medians over
    the repeats unless said: the formula's bubble; the measured idle share (and its range); the
    idle share replayed from the logged operation times with instant messages (the rest is
    communication); the stages' imbalance; the forward and backward seconds of one micro-batch on
    one stage; the runs discarded, and the least on-core share of a counted run."""
    from infra_lab.processes import run_on_ranks

    sizes = sizes or {"d": 128, "blocks": 2, "micro_batch": 8, "tokens": 128}
    per_rank = run_on_ranks(bubble_rank, stages, list(kinds), list(micro_counts), sizes, repeats, seed, min_on_core,
                            attempts, prefetch, timeout_s=timeout_s)
    rows = []
    for kind in kinds:
        for m in micro_counts:
            plan = pipeline.schedule(kind, stages, m)
            runs = [[result["logs"][(kind, m)][r] for result in per_rank] for r in range(repeats)]
            shares = [pipeline.idle_share(logs) for logs in runs]
            events = [e for logs in runs for log in logs for e in log.events]
            rows.append({"kind": kind, "micro_batches": m, "formula": pipeline.bubble_fraction(stages, m),
                         "measured": statistics.median(shares), "low": min(shares), "high": max(shares),
                         "replayed": statistics.median(pipeline.replayed_idle_share(plan, logs) for logs in runs),
                         "imbalance": statistics.median(stage_imbalance(logs) for logs in runs),
                         "forward_s": statistics.median(e.end - e.start for e in events if e.kind == "F"),
                         "backward_s": statistics.median(e.end - e.start for e in events if e.kind == "B"),
                         "discarded": per_rank[0]["discarded"][(kind, m)],
                         "on_core": min(on_core_share(log) for logs in runs for log in logs)})
    return rows


def message_cost(shapes: list[tuple[int, ...]], micro_batches: int = 16, kind: str = "1f1b",
                 forward_s: float = 0.02, backward_s: float = 0.04, repeats: int = 3,
                 timeout_s: float = 300) -> list[dict]:
    """A 2-stage pipeline whose stages only sleep (`sleep_rank`), once per activation shape: what
    the messages alone add to the bubble. Per shape, medians over the repeats: the formula's
    bubble; the measured idle share; the idle share replayed from the logged operations with
    instant messages, and with messages that take the median measured crossing
    (`pipeline.crossings`); that crossing, in ms, and how many a run waited on; the time a rank
    spends between two of its operations besides waiting (`pipeline.between`), in ms; the bytes
    of one activation."""
    from infra_lab.processes import run_on_ranks

    plan = pipeline.schedule(kind, 2, micro_batches)  # refuses a bad kind or count by name
    pipeline._check_count(repeats, "repeat count")
    if not (forward_s > 0 and backward_s > 0):
        raise ValueError(f"a stage's sleeps must be positive seconds; got {forward_s!r} and {backward_s!r}")
    rows = []
    for shape in shapes:
        per_rank = run_on_ranks(sleep_rank, 2, [kind], [micro_batches], tuple(shape), forward_s, backward_s,
                                repeats, timeout_s=timeout_s)
        runs = [[result[(kind, micro_batches)][r] for result in per_rank] for r in range(repeats)]
        crossing_s = statistics.median(x for logs in runs for x in pipeline.crossings(logs))
        rows.append({"shape": tuple(shape), "bytes": 4 * int(np.prod(shape)),
                     "formula": pipeline.bubble_fraction(2, micro_batches),
                     "measured": statistics.median(pipeline.idle_share(logs) for logs in runs),
                     "instant": statistics.median(pipeline.replayed_idle_share(plan, logs) for logs in runs),
                     "with_messages": statistics.median(pipeline.replayed_idle_share(plan, logs, crossing_s)
                                                        for logs in runs),
                     "crossing_ms": 1e3 * crossing_s,
                     "crossings": statistics.median(len(pipeline.crossings(logs)) for logs in runs),
                     "between_ms": 1e3 * statistics.median(x for logs in runs for x in pipeline.between(logs))})
    return rows

