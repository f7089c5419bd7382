"""Pipeline parallelism: the model's layers cut into p stages, one per process, and the batch cut
into m micro-batches that flow through the stages, activations forward and gradients back.

GPipe (Huang et al. 2019, "GPipe: efficient training of giant neural networks using pipeline
parallelism") runs every micro-batch's forward, then every backward, so a stage holds m
micro-batches' activations. 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Efficient large-scale
language model training on GPU clusters using Megatron-LM", section 2.2), starts backwards as soon
as it can: p - rank - 1 warm-up forwards, then one forward and one backward in turn, then the
remaining backwards, so a stage holds at most p - rank. Both flush at the end of the batch, so both
give exactly the gradients of one process, and both leave every stage idle for the same share of
the time, the bubble (p - 1) / (m + p - 1), when the stages are balanced.

`schedule` says what each rank does, in order; `execute` does it on torch.distributed (point to
point sends, gloo or NCCL) and logs when each operation ran, so `idle_share` can measure the bubble
and `replayed_idle_share` can tell how much of it the messages cost and how much the operations'
own times (stages that are not quite equal) do.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from infra_lab.parallel.comm import ByteCounter

KINDS = ("gpipe", "1f1b")
Op = tuple[str, int]  # ("F", micro) or ("B", micro)


def _check_count(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the {what} must be an integer >= 1; got {value!r}")


def schedule(kind: str, stages: int, micro_batches: int) -> list[list[Op]]:
    """Each rank's operations in order: ("F", i) runs micro-batch i forward, ("B", i) backward."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(KINDS)}")
    _check_count(stages, "stage count")
    _check_count(micro_batches, "micro-batch count")
    m = micro_batches
    if kind == "gpipe":
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(stages)]
    ranks = []
    for rank in range(stages):
        warmup = min(stages - rank - 1, m)  # forwards in flight before the first backward can arrive
        ops: list[Op] = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            ops += [("F", warmup + i), ("B", i)]
        ops += [("B", i) for i in range(m - warmup, m)]  # cool-down
        ranks.append(ops)
    return ranks


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The share of time a stage idles with balanced stages: (p - 1) / (m + p - 1). The batch takes
    m + p - 1 slots of one forward and one backward; each stage works in m of them."""
    _check_count(stages, "stage count")
    _check_count(micro_batches, "micro-batch count")
    return (stages - 1) / (micro_batches + stages - 1)


def peak_in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose activations a rank holds at once: forwarded, not yet backward."""
    held = peak = 0
    for kind, _ in ops:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def split_layers(n_layers: int, stages: int) -> list[range]:
    """Contiguous layers per stage. When `stages` does not divide `n_layers`, the first stages take
    one layer more (unbalanced, allowed); every stage needs at least one layer."""
    _check_count(n_layers, "layer count")
    _check_count(stages, "stage count")
    if stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages: every stage needs a layer, "
                         f"so at most {n_layers} stages")
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def split_batch(batch: torch.Tensor, micro_batches: int) -> list[torch.Tensor]:
    """(B, ...) -> m micro-batches of (B / m, ...): equal sizes, so every activation has one shape."""
    _check_count(micro_batches, "micro-batch count")
    if batch.shape[0] % micro_batches:
        raise ValueError(f"a batch of {batch.shape[0]} cannot be cut into {micro_batches} equal micro-batches: "
                         f"the micro-batch count must divide the batch size")
    return list(batch.split(batch.shape[0] // micro_batches))


class Event(NamedTuple):
    kind: str  # "F" or "B"
    micro: int
    start: float  # s, time.perf_counter() (CLOCK_MONOTONIC: one clock for every process on a machine)
    end: float
    waited: float  # s spent waiting for this operation's input to arrive (the receive), before `start`
    cpu: float  # s of CPU time this thread used from start to end: below end - start when the OS ran something else


class Log(NamedTuple):
    rank: int
    origin: float  # s, when this rank left the barrier before its first operation
    events: list[Event]  # in the order run
    activation_bytes: int  # sent to the next stage
    gradient_bytes: int  # sent to the previous stage


def activation_tag(micro: int) -> int:
    return 2 * micro


def gradient_tag(micro: int) -> int:
    return 2 * micro + 1


def execute(plan: list[list[Op]], forward: Callable[[int, torch.Tensor | None], torch.Tensor],
            activation_shape: tuple[int, ...], group=None, prefetch: bool = True,
            dtype: torch.dtype = torch.float32) -> Log:
    """Run this rank's operations of `plan` (a `schedule`, one process per stage).

    forward(micro, x) is the stage: x, the previous stage's activation (None on the first stage,
    which reads its own inputs) -> the activation for the next stage, or on the last stage the
    micro-batch's loss (a scalar, scaled so the micro-batches' losses add up to the batch's). Every
    activation, and so every gradient sent back, has `activation_shape` and `dtype`. Parameters'
    gradients accumulate over the micro-batches, as on one process. Sends are asynchronous (isend) and
    waited for at the end. With `prefetch`, the receive of the next operation's input is posted
    before this operation runs, so the message moves while it computes (Megatron-LM's schedules
    likewise post a send and the next receive together); without, each receive starts when it is
    needed, and the transfer waits for both processes to be scheduled."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if len(plan) != world:
        raise ValueError(f"the world size ({world}) must equal the stage count ({len(plan)}): one process per stage")
    ops = plan[rank]
    first, last = rank == 0, rank == world - 1
    activations, gradients = ByteCounter(group), ByteCounter(group)
    inputs: dict[int, torch.Tensor | None] = {}  # micro -> the activation received (needs its gradient)
    outputs: dict[int, torch.Tensor] = {}  # micro -> what forward returned (backward starts there)
    receiving: dict[int, tuple[object, torch.Tensor]] = {}  # op index -> (Work, buffer) of its posted receive
    sending: list[tuple[object, torch.Tensor]] = []  # (Work, tensor): the tensor must live until sent

    def post_receive(index: int) -> None:
        if index >= len(ops) or index in receiving:
            return
        kind, micro = ops[index]
        if (kind == "F" and not first) or (kind == "B" and not last):
            source, tag = (rank - 1, activation_tag(micro)) if kind == "F" else (rank + 1, gradient_tag(micro))
            buffer = torch.empty(activation_shape, dtype=dtype)
            receiving[index] = (dist.irecv(buffer, source, group=group, tag=tag), buffer)

    events: list[Event] = []
    dist.barrier(group)
    origin = time.perf_counter()
    for index, (kind, micro) in enumerate(ops):
        post_receive(index)
        if prefetch:
            post_receive(index + 1)
        waited, received = 0.0, None
        if index in receiving:
            work, received = receiving.pop(index)
            began = time.perf_counter()
            work.wait()
            waited = time.perf_counter() - began
        if kind == "F":
            x = received.requires_grad_() if received is not None else None  # (b, T, d), or None on stage 0
            start, cpu = time.perf_counter(), time.thread_time()
            y = forward(micro, x)
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            inputs[micro], outputs[micro] = x, y
            if not last:
                sent = y.detach()
                sending.append((activations.send(sent, rank + 1, tag=activation_tag(micro)), sent))
        else:
            y, x = outputs.pop(micro), inputs.pop(micro)  # on the last stage y is the loss: its gradient is 1
            start, cpu = time.perf_counter(), time.thread_time()
            torch.autograd.backward(y, received)
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            if not first:
                sending.append((gradients.send(x.grad, rank - 1, tag=gradient_tag(micro)), x.grad))
        events.append(Event(kind, micro, start, end, waited, cpu))
    for work, _ in sending:
        work.wait()
    return Log(rank, origin, events, int(activations.total_bytes()), int(gradients.total_bytes()))


def span(logs: list[Log]) -> float:
    """s from the earliest start of an operation to the latest end, over all ranks."""
    return max(e.end for log in logs for e in log.events) - min(e.start for log in logs for e in log.events)


def idle_share(logs: list[Log]) -> float:
    """The measured bubble: 1 - (compute time summed over ranks) / (p * span)."""
    busy = sum(e.end - e.start for log in logs for e in log.events)
    return 1.0 - busy / (len(logs) * span(logs))


def replay(plan: list[list[Op]], seconds: dict[tuple[int, str, int], float], message_s: float = 0.0) -> float:
    """The span of `plan` on ideal processes: each runs its operations in order, each as soon as its
    input is there, a message from another rank takes `message_s` (none by default), and operation
    (rank, kind, micro) takes seconds[...]."""
    if not 0.0 <= message_s < float("inf"):
        raise ValueError(f"a message takes a finite time >= 0 s; got message_s={message_s!r}")
    ends: dict[tuple[int, str, int], float] = {}
    free, position = [0.0] * len(plan), [0] * len(plan)
    while len(ends) < sum(map(len, plan)):
        before = len(ends)
        for rank, ops in enumerate(plan):
            while position[rank] < len(ops):
                kind, micro = ops[position[rank]]
                source = (rank - 1, "F", micro) if kind == "F" else (rank + 1, "B", micro)
                needs = [source] if 0 <= source[0] < len(plan) else []
                needs += [(rank, "F", micro)] if kind == "B" else []  # its own forward's activations
                if any(need not in ends for need in needs):
                    break  # its input comes later
                arrive = [ends[need] + (message_s if need[0] != rank else 0.0) for need in needs]
                free[rank] = max([free[rank]] + arrive) + seconds[(rank, kind, micro)]
                ends[(rank, kind, micro)] = free[rank]
                position[rank] += 1
        if len(ends) == before:
            stuck = {rank: ops[position[rank]] for rank, ops in enumerate(plan) if position[rank] < len(ops)}
            raise ValueError(f"the plan deadlocks: every rank waits for another ({stuck})")
    return max(ends.values())


def replayed_idle_share(plan: list[list[Op]], logs: list[Log], message_s: float = 0.0) -> float:
    """The idle share the logged operations' own times would give with messages that take
    `message_s` each (instant by default): with none, what is left of `idle_share` once
    communication is taken out, whose gap to `bubble_fraction` comes from the operations' times
    alone (stages unequal, or slowed by the machine)."""
    seconds = {(log.rank, e.kind, e.micro): e.end - e.start for log in logs for e in log.events}
    return 1.0 - sum(seconds.values()) / (len(plan) * replay(plan, seconds, message_s))


def crossings(logs: list[Log]) -> list[float]:
    """s from a message's producer finishing to its consumer starting, for every operation whose
    rank was already waiting for that input when the producer finished (so the message, not the
    consumer's own work, set when it began): an activation from rank r - 1's forward, a gradient
    from rank r + 1's backward. What the send, the receive and the Python around them cost on
    the critical path, one crossing at a time."""
    ends = {(log.rank, e.kind, e.micro): e.end for log in logs for e in log.events}
    found = []
    for log in logs:
        for e in log.events:
            source = (log.rank - 1, "F", e.micro) if e.kind == "F" else (log.rank + 1, "B", e.micro)
            if source in ends and e.start - e.waited <= ends[source]:
                found.append(e.start - ends[source])
    return found


def between(logs: list[Log]) -> list[float]:
    """s each rank spends between two of its operations besides waiting for an input: sending the
    last result, posting receives, the bookkeeping of `execute`. Busy to the process, idle to the
    stage's compute, so part of the measured bubble."""
    return [b.start - a.end - b.waited for log in logs for a, b in zip(log.events, log.events[1:])]


def timelines(logs: list[Log]) -> list[list[tuple[str, int, float, float]]]:
    """Per rank, (kind, micro, start, end) in seconds from the earliest rank's origin: to draw."""
    zero = min(log.origin for log in logs)
    return [[(e.kind, e.micro, e.start - zero, e.end - zero) for e in log.events] for log in logs]
