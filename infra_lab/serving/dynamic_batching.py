"""Dynamic batching as blog posts on LLM serving write it, kept as a baseline with its defect.

The published loop groups queued requests into a batch of at most `max_batch_size`, taking the
head of the queue while it is no longer than `max_seq_len`, until the batch is full or
`max_wait_s` has passed; then it runs the batch and starts again while the queue is not empty.
A request longer than `max_seq_len` at the head is never taken, so every later request waits
behind it and the outer loop never ends. `published_loop` is that loop, line for line, with one
addition so a notebook can show the defect without hanging: after `max_rounds` empty rounds it
stops and says why. The engine's "dynamic" policy (scheduler.py) refuses such a request when it
is added, by name (Engine.add_request).
"""
from __future__ import annotations

from collections.abc import Callable


def published_loop(queue: list[list[int]], max_batch_size: int, max_seq_len: int, max_wait_s: float,
                   clock: Callable[[], float], max_rounds: int | None = None) -> list[list[list[int]]]:
    """The batches the published loop forms from `queue` (prompts, head first), in order. With
    `max_rounds`, raise RuntimeError after that many rounds in a row that formed no batch (the
    published loop has no such exit: it spins forever)."""
    batches, empty_rounds = [], 0
    while queue:
        batch, started = [], clock()
        while len(batch) < max_batch_size and clock() - started < max_wait_s:
            if queue and len(queue[0]) <= max_seq_len:
                batch.append(queue.pop(0))
        if batch:
            batches.append(batch)
            empty_rounds = 0
            continue
        empty_rounds += 1
        if max_rounds is not None and empty_rounds >= max_rounds:
            raise RuntimeError(f"no batch in {empty_rounds} rounds: the head of the queue has {len(queue[0])} "
                               f"tokens, more than max_seq_len {max_seq_len}, so it is never taken and the "
                               f"{len(queue) - 1} requests behind it never run")
    return batches
