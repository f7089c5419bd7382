"""Chapter 10's checks: plausible wrong answers fail and say why, and the last
check runs the reader's ZeRO-1 step on two processes training the real model: the package's own
passes, a step that sums instead of averaging and one that uses an all-reduce fail by name."""
import numpy as np
import pytest
import torch  # noqa: F401 - the ZeRO-1 steps below run from their source, with torch and dist
import torch.distributed as dist  # noqa: F401

from infra_lab.grading import ch10, ch10_ranks, checks
from infra_lab.processes import run_on_ranks

NAMES = ["memory_per_rank", "zero2_step", "parallel_linear", "one_f_one_b"]


def run(name, candidate):
    return checks._run(checks._lookup(f"ch10.{name}"), candidate)


def fails(name, wrong, says):
    result = run(name, wrong)
    assert result.passed < result.total
    assert result.line.startswith(f"FAIL ch10.{name} ") and says in result.first_failure, result.first_failure
    return result


def test_memory_mistakes_are_named():
    def gradients_sharded_at_stage_one(params, world, stage, mixed):
        held = ch10.memory_per_rank(params, world, stage, mixed)
        if stage == 1:
            held["gradients"] = -(-params // world) * (2 if mixed else 4)
        return held

    def no_padding(params, world, stage, mixed):
        held = ch10.memory_per_rank(params, world, stage, mixed)
        per = {"parameters": 3, "gradients": 2, "optimizer states": 1}
        size = {"parameters": 2, "gradients": 2, "optimizer states": 12} if mixed else \
            {"parameters": 4, "gradients": 4, "optimizer states": 8}
        return {k: (params // world * size[k] if stage >= per[k] else v) for k, v in held.items()}

    fails("memory_per_rank", gradients_sharded_at_stage_one, "stage 1 keeps whole the gradients")
    fails("memory_per_rank", no_padding, "ceil(params / world)")


def test_zero2_mistakes_are_named():
    def summed(grads, param_shard, rank, lr):
        grad, _ = ch10.zero2_step(grads, param_shard, rank, lr)
        grad = grad * grads.shape[0]
        return grad, param_shard - lr * grad

    def unpadded(grads, param_shard, rank, lr):
        world, n = grads.shape
        size = n // world
        grad = grads[:, rank * size:(rank + 1) * size].sum(0) / world
        return grad, param_shard[:size] - lr * grad

    fails("zero2_step", summed, "divide by the world size")
    fails("zero2_step", unpadded, "padded with zeros")


def test_linear_and_schedule_mistakes_are_named():
    def rows_first(x, w_in, w_out, rank, world):
        hidden = np.maximum(x @ w_in, 0)
        width = w_in.shape[1] // world
        return hidden[:, rank * width:(rank + 1) * width], hidden @ w_out / world

    def no_warmup(stages, micro_batches, rank):
        return [op for i in range(micro_batches) for op in (("F", i), ("B", i))]

    fails("parallel_linear", rows_first, "your hidden shard times the matching rows of W_out")
    fails("one_f_one_b", no_warmup, "forwards before its first backward")


def zero1_summed(flat_params, flat_grads, shard, optimizer):
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter_single(grad_shard, flat_grads)
    shard.grad = grad_shard
    optimizer.step()
    dist.all_gather_single(flat_params, shard.detach().clone())


def zero1_float32(flat_params, flat_grads, shard, optimizer):
    grad_shard = torch.empty(shard.shape, dtype=torch.float32)  # right in exact arithmetic, rounded to fp32
    dist.reduce_scatter_single(grad_shard, flat_grads.float())
    shard.grad = (grad_shard / dist.get_world_size()).to(shard.dtype)
    optimizer.step()
    dist.all_gather_single(flat_params, shard.detach().clone())


def zero1_all_reduce(flat_params, flat_grads, shard, optimizer):
    world, rank = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(flat_grads)
    shard.grad = flat_grads[rank * shard.numel():(rank + 1) * shard.numel()] / world
    optimizer.step()
    dist.all_gather_single(flat_params, shard.detach().clone())


def trained_in_turn(jobs: list[tuple[str, str, int]]) -> list[dict]:
    """On each of the two ranks: ch10._trained's work (ch10_ranks.zero1_rank) for every (source,
    name, steps) in turn, in one start of the processes (each start imports the model anew)."""
    return [ch10_ranks.zero1_rank(source, name, steps) for source, name, steps in jobs]


@pytest.mark.slow
def test_the_zero1_check_trains_the_real_model_and_names_mistakes(monkeypatch):
    """The package's step trains the check's TRAIN_STEPS; each mistake shows within 2 steps
    (a sum is twice the mean; a float32 buffer is 1e-8 off in the first loss; all_reduce is
    counted), so the mistakes train 2, which spares 4 s of training each. All four train in one
    start of two processes, and the check judges each mistake from its training there."""
    assert run("zero1_step", ch10.zero1_step).passed == 24  # the reference short-cuts: now run its source
    source = ch10.source_of(ch10_ranks.zero1_step).replace("def zero1_step", "def package_zero1_step")
    mistakes = (zero1_summed, zero1_float32, zero1_all_reduce)
    jobs = [(source, "package_zero1_step", ch10.TRAIN_STEPS)] + [(ch10.source_of(f), f.__name__, 2) for f in mistakes]
    by_rank = run_on_ranks(trained_in_turn, 2, jobs, timeout_s=300)
    trained = {job[:2]: [results[i] for results in by_rank] for i, job in enumerate(jobs)}
    ranks = trained[(source, "package_zero1_step")]
    assert not ranks[0].get("error") and all(case["match"] for r in ranks for case in r["cases"])
    losses = np.mean([r["losses"] for r in ranks], axis=0)
    ddp = np.mean([r["ddp_losses"] for r in ranks], axis=0)
    assert np.max(np.abs(losses - ddp) / ddp) < ch10.MATCH and ranks[0]["weight_gap"] < ch10.MATCH
    assert ranks[0]["optimizer_bytes"] == ranks[0]["optimizer_bytes_modelled"]
    monkeypatch.setattr(ch10, "TRAIN_STEPS", 2)
    monkeypatch.setattr(ch10, "_trained", lambda source, name: trained[(source, name)])
    fails("zero1_step", zero1_summed, "the sum over the ranks: divide it by the world size")
    fails("zero1_step", zero1_float32, "trains in float64: does a buffer on the way have another dtype")
    result = fails("zero1_step", zero1_all_reduce, "calls all_reduce")
    assert result.passed == 23  # its steps are right; its traffic is not ZeRO-1's
