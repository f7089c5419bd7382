"""Checks for chapter 10's exercises: the memory a rank holds under each ZeRO stage, a ZeRO-2 step from
a reduce-scatter, column- and row-parallel linear layers, the order of 1F1B's operations, and the
reader's ZeRO-1 step training the real model on two processes beside data parallelism.

The references call the package: `parallel.memory.state_bytes`, `parallel.ring.reduce_scatter`,
`parallel.tensor.shard_columns` and `shard_rows`, `parallel.pipeline.schedule`, and for the last
check `parallel.runs` (batches, the shipped model, AdamW and plain data parallelism), through
`grading.ch10_ranks`, which runs in the two processes. Modules that need torch are imported when
a check runs, so the grader imports without torch. The reader's
ZeRO-1 step runs in fresh processes, which cannot import a notebook: its source goes with the job
and runs there with `torch` and `dist` (torch.distributed, counted) in scope. All its cases run in
one start of two processes, kept for the process.
"""
from __future__ import annotations

import functools
import inspect
import textwrap

import numpy as np

from infra_lab.grading.ch07 import Schedule
from infra_lab.grading.checks import Check, register
from infra_lab.parallel import memory, ring

TRAIN_STEPS = 20  # the last check's training steps on 2 processes (8 windows of 64 bytes each)
# losses (relative) and final weights (absolute) against data parallelism's, both trained in
# float64 (grading.ch10_ranks.TRAIN_DTYPE). They are equal in exact arithmetic: the package's step
# gives a gap of 0.0 (on 2 ranks a sum of two terms has one order), and any float64 rounding stays
# near 1e-13, while a step that passes the gradients through a float32 buffer misses by 8.7e-7 in
# the weights (measured on the shipped model, 20 steps)
MATCH = 1e-10


class WrongMemory(AssertionError):
    """Bytes per rank that differ from ZeRO's accounting."""


class WrongShard(AssertionError):
    """A gradient shard or parameter shard that differs from a reduce-scatter's."""


class WrongSchedule(AssertionError):
    """Operations that differ from 1F1B's order."""


class WrongTraining(AssertionError):
    """A ZeRO-1 step that trains differently from data parallelism."""


# ---- exercise 1: memory per rank -------------------------------------------------------------------

def memory_per_rank(params, world, stage, mixed):
    """Reference: bytes of parameters, gradients and optimizer states on one rank."""
    return memory.state_bytes(params, world, stage, memory.MIXED if mixed else memory.FP32)


def drive_memory(function, params, world, stage, mixed):
    answer = function(params, world, stage, mixed)
    expected = memory_per_rank(params, world, stage, mixed)
    if not isinstance(answer, dict) or set(answer) != set(expected):
        raise WrongMemory(f"return a dict with the keys {sorted(expected)}; got "
                          + (f"keys {sorted(answer)}" if isinstance(answer, dict) else type(answer).__name__))
    for kind in memory.KINDS[:3]:
        if answer[kind] != expected[kind]:
            precision = memory.MIXED if mixed else memory.FP32
            per = {"parameters": precision.parameter_bytes, "gradients": precision.gradient_bytes,
                   "optimizer states": precision.optimizer_bytes}[kind]
            sharded = {"parameters": 3, "gradients": 2, "optimizer states": 1}[kind]
            hint = (f"stage {stage} {'shards' if stage >= sharded else 'keeps whole'} the {kind}"
                    f" ({per} bytes per parameter{', padded to a multiple of the world: ceil(params / world)' if stage >= sharded else ''})")
            raise WrongMemory(f"{kind}: got {answer[kind]!r}, expected {expected[kind]} bytes; {hint}")
    return expected


def _memory_case(kind, rng):
    world = int(rng.choice([1, 2, 3, 4, 8, 64]))
    params = int(rng.integers(1, 10**6)) if kind == "uneven" else int(rng.integers(1, 10**5)) * world
    return params, world, int(rng.integers(0, 4)), bool(rng.integers(0, 2))


# ---- exercise 2: a ZeRO-2 step from a reduce-scatter ----------------------------------------------

def zero2_step(grads, param_shard, rank, lr):
    """Reference: this rank's averaged gradient shard (what a reduce-scatter of every rank's gradient
    gives it, over the world) and its parameter shard after an SGD step."""
    world = grads.shape[0]
    grad_shard = ring.reduce_scatter(grads)[0][rank] / world
    return grad_shard, param_shard - lr * grad_shard


def drive_zero2(function, grads, param_shard, rank, lr):
    answer = function(grads.copy(), param_shard.copy(), rank, lr)
    expected = zero2_step(grads, param_shard, rank, lr)
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise WrongShard(f"return (grad_shard, new_param_shard); got {type(answer).__name__}")
    world, n = grads.shape
    for name, got, want in zip(("grad_shard", "new_param_shard"), answer, expected):
        got = np.asarray(got, dtype=float)
        if got.shape != want.shape:
            raise WrongShard(f"{name} has shape {got.shape}, expected {want.shape}: rank {rank} of {world} owns "
                             f"ceil({n} / {world}) = {want.shape[0]} elements (the buffer is padded with zeros)")
        if not np.allclose(got, want, rtol=1e-6, atol=1e-9):
            summed = ring.reduce_scatter(grads)[0][rank]
            hint = ("it is the sum over ranks: divide by the world size" if np.allclose(got, summed)
                    and name == "grad_shard" else f"rank {rank} owns elements {rank} * S to ({rank} + 1) * S "
                    "of every rank's gradient, summed over the ranks and divided by the world size")
            raise WrongShard(f"{name} differs (largest gap {np.max(np.abs(got - want)):.3g}); {hint}")
    return expected


def _zero2_case(kind, rng):
    world = int(rng.choice([2, 3, 4, 8]))
    n = int(rng.integers(1, 60)) if kind == "uneven" else world * int(rng.integers(1, 12))
    size = -(-n // world)
    rank = int(rng.integers(0, world))
    return (rng.standard_normal((world, n)), rng.standard_normal(size), rank, float(rng.choice([0.1, 0.01])))


# ---- exercise 3: column- and row-parallel linear layers -------------------------------------------

def parallel_linear(x, w_in, w_out, rank, world):
    """Reference: rank `rank`'s column-parallel hidden slice relu(x @ W_in[:, cols]) and its
    row-parallel partial output hidden @ W_out[rows, :], which the ranks' all-reduce adds up."""
    from infra_lab.parallel import tensor  # torch's: imported when a check runs

    hidden = np.maximum(x @ tensor.shard_columns(w_in, rank, world), 0)
    return hidden, hidden @ tensor.shard_rows(w_out, rank, world)


def drive_linear(function, x, w_in, w_out, world):
    partials, whole = [], np.maximum(x @ w_in, 0) @ w_out
    for rank in range(world):
        answer = function(x.copy(), w_in.copy(), w_out.copy(), rank, world)
        hidden, partial = parallel_linear(x, w_in, w_out, rank, world)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise WrongShard(f"return (hidden_shard, partial_output); got {type(answer).__name__}")
        got_hidden, got_partial = (np.asarray(a, dtype=float) for a in answer)
        if got_hidden.shape != hidden.shape or not np.allclose(got_hidden, hidden, rtol=1e-6, atol=1e-9):
            raise WrongShard(f"rank {rank} of {world}: hidden shard {got_hidden.shape}, expected {hidden.shape}: "
                             f"columns {rank} * {w_in.shape[1] // world} onward of W_in, then the ReLU")
        if got_partial.shape != partial.shape or not np.allclose(got_partial, partial, rtol=1e-6, atol=1e-9):
            raise WrongShard(f"rank {rank} of {world}: partial output {got_partial.shape}, expected {partial.shape}: "
                             f"your hidden shard times the matching rows of W_out, not yet summed over ranks")
        partials.append(got_partial)
    if not np.allclose(sum(partials), whole, rtol=1e-6, atol=1e-8):
        raise WrongShard("the ranks' partial outputs do not add up to the one-process MLP")
    return "every rank's shards, and their sum is the MLP"


def _linear_case(kind, rng):
    world = int(rng.choice([1, 2, 4, 8]))
    d, hidden = int(rng.integers(1, 9)), world * int(rng.integers(1, 6))
    return (rng.standard_normal((int(rng.integers(1, 6)), d)), rng.standard_normal((d, hidden)),
            rng.standard_normal((hidden, int(rng.integers(1, 9)))), world)


# ---- exercise 4: 1F1B's order ----------------------------------------------------------------------

def one_f_one_b(stages, micro_batches, rank):
    """Reference: rank `rank`'s operations under 1F1B, as ("F", i) and ("B", i)."""
    from infra_lab.parallel import pipeline  # torch's: imported when a check runs

    return pipeline.schedule("1f1b", stages, micro_batches)[rank]


def drive_schedule(function, stages, micro_batches, rank):
    answer = function(stages, micro_batches, rank)
    expected = one_f_one_b(stages, micro_batches, rank)
    got = [tuple(op) if isinstance(op, (tuple, list)) else op for op in answer] if isinstance(answer, list) else answer
    if got != expected:
        warmup = min(stages - rank - 1, micro_batches)
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise WrongSchedule(f"stage {rank} of {stages}, {micro_batches} micro-batches: operation {first} is "
                            f"{got[first] if first < len(got) else 'missing'}, expected "
                            f"{expected[first] if first < len(expected) else 'nothing'}; this stage runs {warmup} "
                            "forwards before its first backward (p - rank - 1, at most m), then alternates")
    return expected


def _schedule_case(kind, rng):
    stages = int(rng.integers(1, 9))
    return stages, int(rng.integers(1, 17)), int(rng.integers(0, stages))


# ---- exercise 5: the reader's ZeRO-1 trains the real model ---------------------------------------

def zero1_step(flat_params, flat_grads, shard, optimizer):
    """Reference ZeRO-1 step (run inside a process group): reduce-scatter the gradients, average,
    step this rank's shard, all-gather the shards into every rank's parameters."""
    from infra_lab.grading import ch10_ranks

    return ch10_ranks.zero1_step(flat_params, flat_grads, shard, optimizer)


def source_of(function) -> str:
    try:
        return textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError) as error:
        raise WrongTraining(f"the check needs zero1_step's source to run it in new processes: {error}") from None


@functools.cache
def _trained(source: str, name: str) -> dict:
    from infra_lab.grading import ch10_ranks
    from infra_lab.processes import run_on_ranks

    return run_on_ranks(ch10_ranks.zero1_rank, 2, source, name, TRAIN_STEPS, timeout_s=300)


def drive_zero1(function, kind):
    ranks = _trained(source_of(function), function.__name__)
    first = ranks[0]
    if first.get("error"):
        raise WrongTraining(first["error"])
    if first["calls"].get("all_reduce"):
        raise WrongTraining("zero1_step calls all_reduce: ZeRO-1 needs only a reduce-scatter (each rank gets the "
                            "gradient sum of its shard) and an all-gather (every rank gets every updated shard)")
    losses = np.mean([r["losses"] for r in ranks], axis=0)
    ddp = np.mean([r["ddp_losses"] for r in ranks], axis=0)
    loss_gap = float(np.max(np.abs(losses - ddp) / np.abs(ddp)))
    if not loss_gap <= MATCH or not first["weight_gap"] <= MATCH:
        hint = ("; are the gradients averaged over the ranks?" if first["weight_gap"] > 1e-4 else
                "; the check trains in float64: does a buffer on the way have another dtype? "
                "torch.empty_like(shard) keeps the shard's")
        raise WrongTraining(f"after {TRAIN_STEPS} steps on 2 processes your ZeRO-1 differs from data parallelism: "
                            f"losses by {loss_gap:.2e} (relative), weights by {first['weight_gap']:.2e}{hint}")
    if first["optimizer_bytes"] != first["optimizer_bytes_modelled"]:
        raise WrongTraining(f"the optimizer holds {first['optimizer_bytes']} bytes of state on rank 0; ZeRO-1 "
                            f"keeps {first['optimizer_bytes_modelled']}: step the shard only")
    return _TRAINED


def drive_zero1_case(function, kind):
    """A step case ("step i"): the reader's step against the package's on the i-th random flat
    buffer, on both ranks. The training case: the real model trained by the reader's step."""
    from infra_lab.grading import ch10_ranks

    if function is zero1_step:  # the reference: tests/test_ch10_checks.py runs the package's own through here
        return _TRAINED if kind == "train" else ("case", ch10_ranks.CASES[int(kind.split()[1])])
    if kind == "train":
        return drive_zero1(function, kind)
    ranks = _trained(source_of(function), function.__name__)
    if ranks[0].get("error"):
        raise WrongTraining(ranks[0]["error"])
    index = int(kind.split()[1])
    for rank in ranks:
        got = rank["cases"][index]
        if not got["match"]:
            raise WrongTraining(f"rank {rank['rank']}, a flat buffer of {got['elements']} elements: {got['what']}")
    return "case", ch10_ranks.CASES[index]


_TRAINED = ("trained", f"{TRAIN_STEPS} steps on 2 processes as data parallelism does", "optimizer states sharded")

register(Check("ch10.memory_per_rank", memory_per_rank, Schedule(["even", "uneven"] * 12, _memory_case),
               drive=drive_memory))
register(Check("ch10.zero2_step", zero2_step, Schedule(["even", "uneven"] * 12, _zero2_case), drive=drive_zero2))
register(Check("ch10.parallel_linear", parallel_linear, Schedule(["plain"] * 24, _linear_case), drive=drive_linear))
register(Check("ch10.one_f_one_b", one_f_one_b, Schedule(["plain"] * 24, _schedule_case), drive=drive_schedule))
register(Check("ch10.zero1_step", zero1_step, Schedule([f"step {i}" for i in range(23)] + ["train"],
                                                       lambda kind, rng: (kind,)), drive=drive_zero1_case))
