"""What training holds in memory per rank: parameters, gradients, optimizer states and activations,
under data parallelism, ZeRO's three stages, tensor and pipeline parallelism and recomputation.

Training states (Rajbhandari et al., "ZeRO", SC 2020, section 3.1): mixed-precision Adam keeps
2 bytes of fp16 parameters and 2 of fp16 gradients per parameter, and K = 12 bytes of optimizer
state (fp32 master parameters, momentum and variance); plain fp32 keeps 4 + 4 and Adam's 8. With
N data-parallel ranks, stage 1 shards the optimizer states, stage 2 the gradients too, stage 3
the parameters too (section 5, Figure 1). A shard holds ceil(Psi / N) elements: a flat buffer
padded to a multiple of N, as `parallel.zero` lays it out, so the count is exact for any Psi.
Tensor parallelism over t ranks and pipeline parallelism over p stages each hold 1/(t p) of the
parameters here (the embedding and norms are treated as split too: an approximation).

Activations (Korthikanti et al., "Reducing activation recomputation in large transformer models",
2022, section 4, 16-bit activations, GPT blocks with a 4h MLP): per layer, for sequence s, micro-
batch b, width h and a heads, s b h (34 + 5 a s / h) bytes; with tensor parallelism over t,
s b h (10 + 24 / t + 5 a s / (h t)); with full recomputation only each block's input is kept,
2 s b h. A pipeline's first stage holds the activations of its L / p layers for every micro-batch
in flight: m under GPipe, p under 1F1B (Narayanan et al. 2021, section 2.2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

STAGES = (0, 1, 2, 3)  # 0: plain data parallelism (every rank holds everything)
KINDS = ("parameters", "gradients", "optimizer states", "activations")


@dataclass(frozen=True)
class Precision:
    name: str
    parameter_bytes: int  # per parameter
    gradient_bytes: int
    optimizer_bytes: int  # ZeRO's K
    activation_bytes: int  # per activation element (Korthikanti's counts assume 2)


MIXED = Precision("mixed fp16/fp32 Adam", 2, 2, 12, 2)
FP32 = Precision("fp32 Adam", 4, 4, 8, 4)
PRECISIONS = {"mixed": MIXED, "fp32": FP32}


def _whole(value, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be a whole number >= {least}; got {value!r}")
    return value


def check_stage(stage) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose one of {', '.join(map(str, STAGES))} "
                         f"(0: plain data parallelism)")
    return stage


def shard_elements(units, world: int) -> int:
    """Elements of one rank's shard: each unit (a layer's flat buffer, or one int for the whole
    model) padded to a multiple of `world` and split in `world` equal parts."""
    _whole(world, "the world size")
    sizes = [units] if isinstance(units, int) else list(units)
    return sum(math.ceil(_whole(size, "a unit's element count", 0) / world) for size in sizes)


def total(units) -> int:
    return units if isinstance(units, int) else sum(units)


def state_bytes(params, world: int, stage: int, precision: Precision = MIXED, tensor: int = 1,
                pipeline: int = 1) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states one rank holds: `params` in the model
    (an int, or the element counts of the units that are sharded one by one), `world` data-
    parallel ranks, a ZeRO `stage`, and the model split over `tensor` x `pipeline`."""
    check_stage(stage)
    split = _whole(tensor, "the tensor-parallel size") * _whole(pipeline, "the pipeline size")
    if isinstance(params, int):
        local = math.ceil(_whole(params, "the parameter count") / split)
        shard = shard_elements(local, world)
    elif split == 1:
        local, shard = total(params), shard_elements(params, world)
    else:
        raise ValueError("give the parameter count as one int when the model is split by tensor or pipeline")
    return {"parameters": (shard if stage >= 3 else local) * precision.parameter_bytes,
            "gradients": (shard if stage >= 2 else local) * precision.gradient_bytes,
            "optimizer states": (shard if stage >= 1 else local) * precision.optimizer_bytes}


def activation_bytes_per_layer(sequence: int, micro_batch: int, hidden: int, heads: int, tensor: int = 1,
                               recompute: bool = False, precision: Precision = MIXED) -> float:
    """Korthikanti et al.'s activations of one transformer layer, scaled from their 2 bytes per
    element to the precision's."""
    sbh = _whole(sequence, "the sequence length") * _whole(micro_batch, "the micro-batch") * _whole(hidden, "the width")
    scale = precision.activation_bytes / 2
    if recompute:
        return 2 * sbh * scale
    if heads % tensor or hidden % tensor:
        raise ValueError(f"a tensor-parallel size of {tensor} must divide the heads ({heads}) and the width ({hidden})")
    per_element = 34 if tensor == 1 else 10 + 24 / tensor
    return sbh * (per_element + 5 * heads * sequence / (hidden * tensor)) * scale


def in_flight(schedule: str, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations the first stage holds at once."""
    _whole(micro_batches, "the micro-batch count")
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(stages, micro_batches)
    raise ValueError(f"unknown schedule {schedule!r}; choose gpipe or 1f1b")


def per_rank(params: int, layers: int, hidden: int, heads: int, sequence: int, micro_batch: int, world: int = 1,
             stage: int = 0, tensor: int = 1, pipeline: int = 1, micro_batches: int = 1, schedule: str = "1f1b",
             recompute: bool = False, precision: Precision = MIXED) -> dict[str, float]:
    """Every kind of memory on the busiest rank (the pipeline's first stage), in bytes."""
    if layers % _whole(pipeline, "the pipeline size"):
        raise ValueError(f"{pipeline} pipeline stages cannot share {layers} layers evenly; "
                         f"the stage count must divide the layers")
    states = state_bytes(params, world, stage, precision, tensor, pipeline)
    per_layer = activation_bytes_per_layer(sequence, micro_batch, hidden, heads, tensor, recompute, precision)
    return states | {"activations": per_layer * layers / pipeline * in_flight(schedule, pipeline, micro_batches)}


def zero_figure_1(params: int = 7_500_000_000, world: int = 64) -> dict[int, float]:
    """ZeRO's Figure 1 from `state_bytes`: GB per device for each stage of mixed-precision Adam."""
    return {stage: sum(state_bytes(params, world, stage, MIXED).values()) / 1e9 for stage in STAGES}


def communication_volume(params, world: int, stage: int) -> int:
    """Elements each rank moves per step, ZeRO's section 7: 2 Psi for data parallelism and stages
    1 and 2 (an all-reduce, or a reduce-scatter and an all-gather), 3 Psi for stage 3 (the
    parameters gathered in forward and again in backward, and the gradients reduce-scattered).
    The stages move the units padded to a multiple of `world` (fewer than `world` elements more
    per unit); each rank sends (N - 1) / N of this volume (parallel.comm)."""
    padded = world * shard_elements(params, world)
    return {0: 2 * total(params), 1: 2 * padded, 2: 2 * padded, 3: 3 * padded}[check_stage(stage)]
