"""The engine's step log: one record per step, from which every latency and throughput figure of
chapter 05 is computed and its Gantt chart is drawn.

A record says which requests computed what in the step (a prefill chunk or one decode token),
which were preempted or swapped while the step was planned, which held a batch slot without
computing (a static batch's finished members), and how long the step took in all and in the
model's forward alone (the rest is scheduling and bookkeeping).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class Work:
    request_id: int
    kind: str  # "prefill": prompt tokens (or a preempted request's recompute); "decode": one token
    n_tokens: int
    drafted: int = 0  # speculative decoding (chapter 07): drafted tokens verified after the n_tokens
    accepted: int = 0  # of those, the ones the target kept


@dataclass(frozen=True)
class StepRecord:
    index: int
    start_s: float  # on the engine's clock (wall or simulated)
    end_s: float
    forward_s: float  # in the model's forward (or the simulator's step-time model)
    work: tuple[Work, ...]
    preempted: tuple[int, ...] = ()  # request ids preempted while this step was planned
    swapped_out: tuple[int, ...] = ()  # of those, the ones whose blocks went to the host pool
    swapped_in: tuple[int, ...] = ()  # requests whose blocks came back from the host pool
    finished: tuple[int, ...] = ()  # finished (stop token or max_tokens) in this step
    held: tuple[int, ...] = ()  # holding a batch slot without computing (static batching)
    waiting: int = 0  # requests waiting after the step was planned (preempted ones included)
    free_blocks: int = 0  # KV blocks free after the step
    draft_s: float = 0.0  # in the drafter (speculative decoding)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def n_tokens(self) -> int:
        return sum(w.n_tokens for w in self.work)

    @property
    def forward_tokens(self) -> int:
        """Tokens the forward ran: the scheduled ones and the drafted ones verified after them."""
        return sum(w.n_tokens + w.drafted for w in self.work)

    @property
    def prefill_tokens(self) -> int:
        return sum(w.n_tokens for w in self.work if w.kind == "prefill")

    @property
    def decode_tokens(self) -> int:
        return sum(w.n_tokens for w in self.work if w.kind == "decode")


def step_sequences(log) -> list[list[tuple[int, int]]]:
    """Each logged step's (context before, new tokens) per request, rebuilt from the log (a
    request's context is what its earlier steps computed; a preemption by recompute starts it
    again from 0, and one by swap keeps it): what the roofline and the simulator's step-time
    model take. Drafted tokens (chapter 07) and prefix-cache hits (chapter 04) are not in it."""
    computed, steps = {}, []
    for record in log:
        for request_id in set(record.preempted) - set(record.swapped_out):
            computed[request_id] = 0
        steps.append([(computed.get(w.request_id, 0), w.n_tokens) for w in record.work])
        for w in record.work:
            computed[w.request_id] = computed.get(w.request_id, 0) + w.n_tokens
    return steps
