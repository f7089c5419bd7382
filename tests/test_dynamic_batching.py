"""The published dynamic-batching loop: it batches what fits, and a request longer than
max_seq_len at the head of the queue stalls it forever (shown with its round limit); the engine's
dynamic policy refuses that request by name instead."""
import itertools

import pytest

from infra_lab.serving.dynamic_batching import published_loop


def ticking(step_s: float = 0.001):
    """A clock that moves `step_s` on every reading, so the loop's wait limit passes."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def test_batches_fill_up_to_the_batch_size_in_queue_order():
    queue = [[1] * n for n in (3, 5, 2, 4, 1)]
    batches = published_loop(list(queue), max_batch_size=2, max_seq_len=8, max_wait_s=0.01, clock=ticking())
    assert batches == [queue[0:2], queue[2:4], queue[4:5]]


def test_a_request_longer_than_the_limit_stalls_every_request_behind_it():
    queue = [[1] * 3, [1] * 50, [1] * 2, [1] * 4]
    with pytest.raises(RuntimeError, match="head of the queue has 50 tokens, more than max_seq_len 8, so it is "
                                           "never taken and the 2 requests behind it never run"):
        published_loop(queue, max_batch_size=4, max_seq_len=8, max_wait_s=0.01, clock=ticking(), max_rounds=100)
    assert [len(r) for r in queue] == [50, 2, 4]  # only the first got out
