"""parallel.pipeline: the GPipe and 1F1B schedules against a brute-force simulation of stages
that run their operations in order as soon as their inputs arrive; the bubble formula; and, on 2
gloo processes, the target model cut in two stages giving one process's loss and gradients with
both schedules, the executor's logs, a rough measured bubble, and named errors."""
import re

import pytest
import torch
from _numerics import FP64_RELATIVE
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.parallel import pipeline, pipeline_runs
from infra_lab.processes import run_on_ranks

KINDS = st.sampled_from(pipeline.KINDS)


def simulate(plan, forward_time=1, backward_time=2):
    """{(rank, kind, micro): (start, end)} when every rank runs its operations in order, each as
    soon as the rank is free and its inputs are there; None when the ranks deadlock."""
    stages = len(plan)
    done: dict[tuple, tuple] = {}
    position, free = [0] * stages, [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for rank in range(stages):
            if position[rank] == len(plan[rank]):
                continue
            kind, micro = plan[rank][position[rank]]
            if kind == "F":
                needs = [(rank - 1, "F", micro)] if rank > 0 else []
            else:
                needs = [(rank, "F", micro)] + ([(rank + 1, "B", micro)] if rank < stages - 1 else [])
            if any(need not in done for need in needs):
                continue
            start = max([free[rank]] + [done[need][1] for need in needs])
            free[rank] = start + (forward_time if kind == "F" else backward_time)
            done[(rank, kind, micro)] = (start, free[rank])
            position[rank] += 1
            progressed = True
    return done if all(p == len(ops) for p, ops in zip(position, plan)) else None


@given(kind=KINDS, stages=st.integers(1, 8), micro_batches=st.integers(1, 24), forward_time=st.integers(1, 3),
       backward_time=st.integers(1, 6))
def test_schedules_run_every_operation_once_in_a_legal_order(kind, stages, micro_batches, forward_time,
                                                             backward_time):
    plan = pipeline.schedule(kind, stages, micro_batches)
    assert len(plan) == stages
    every = sorted([("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)])
    for rank, ops in enumerate(plan):
        assert sorted(ops) == every
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(micro_batches))
        expected_peak = micro_batches if kind == "gpipe" else min(stages - rank, micro_batches)
        assert pipeline.peak_in_flight(ops) == expected_peak
    times = simulate(plan, forward_time, backward_time)
    assert times is not None, "the schedule deadlocks"
    for (rank, kind_, micro), (start, _) in times.items():
        if kind_ == "F" and rank > 0:
            assert start >= times[(rank - 1, "F", micro)][1]
        if kind_ == "B" and rank < stages - 1:
            assert start >= times[(rank + 1, "B", micro)][1]
    # balanced stages: the batch takes m + p - 1 slots of one forward and one backward, whatever their ratio
    makespan = max(end for _, end in times.values())
    assert makespan == (micro_batches + stages - 1) * (forward_time + backward_time)
    seconds = {(rank, k, i): forward_time if k == "F" else backward_time
               for rank, ops in enumerate(plan) for k, i in ops}
    assert pipeline.replay(plan, seconds) == makespan
    idle = 1 - stages * micro_batches * (forward_time + backward_time) / (stages * makespan)
    assert idle == pytest.approx(pipeline.bubble_fraction(stages, micro_batches))


def test_1f1b_warms_up_then_alternates():
    assert pipeline.schedule("1f1b", 4, 6)[0] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                                  ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert pipeline.schedule("1f1b", 4, 6)[3][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert pipeline.schedule("1f1b", 4, 2)[0] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # warm-up capped at m
    assert pipeline.schedule("gpipe", 2, 2) == [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]] * 2


def test_replay_follows_unequal_times_and_finds_deadlocks():
    plan = pipeline.schedule("gpipe", 2, 2)
    seconds = {(0, "F", 0): 1, (0, "F", 1): 1, (1, "F", 0): 3, (1, "F", 1): 3, (1, "B", 0): 2, (1, "B", 1): 2,
               (0, "B", 0): 1, (0, "B", 1): 1}
    # rank 1: F0 1-4, F1 4-7, B0 7-9, B1 9-11; rank 0: B0 9-10, B1 11-12
    assert pipeline.replay(plan, seconds) == 12
    with pytest.raises(ValueError, match="deadlocks"):
        pipeline.replay([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]], dict.fromkeys(seconds, 1))


def test_replay_charges_each_message_between_ranks_and_none_within_one():
    plan = pipeline.schedule("gpipe", 2, 1)  # rank 0: F0, B0; rank 1: F0, B0
    seconds = {(0, "F", 0): 1, (1, "F", 0): 1, (1, "B", 0): 2, (0, "B", 0): 2}
    assert pipeline.replay(plan, seconds) == 6
    # F0 on rank 0, the activation, F0 and B0 on rank 1 (its own forward: no message), the
    # gradient, B0 on rank 0
    assert pipeline.replay(plan, seconds, message_s=0.25) == 6.5
    with pytest.raises(ValueError, match="finite time >= 0 s; got message_s=-1"):
        pipeline.replay(plan, seconds, message_s=-1)


@given(kind=KINDS, stages=st.integers(2, 5), micro_batches=st.integers(1, 12),
       message_s=st.floats(0.0, 2.0))
def test_slower_messages_never_shorten_the_replay(kind, stages, micro_batches, message_s):
    plan = pipeline.schedule(kind, stages, micro_batches)
    seconds = {(rank, kind_, micro): 1.0 + (kind_ == "B") for rank, ops in enumerate(plan) for kind_, micro in ops}
    instant = pipeline.replay(plan, seconds)
    assert instant == pytest.approx((micro_batches + stages - 1) * 3)  # the formula's span, equal stages
    slower = pipeline.replay(plan, seconds, message_s)
    # at least one message per stage boundary each way lies on the critical path, at most all
    assert instant + 2 * (stages - 1) * message_s - 1e-9 <= slower
    assert slower <= instant + 2 * (stages - 1) * micro_batches * message_s + 1e-9


def test_crossings_count_only_messages_their_consumer_waited_for():
    event = pipeline.Event
    logs = [pipeline.Log(0, 0.0, [event("F", 0, 0.0, 1.0, 0.0, 1.0), event("F", 1, 1.1, 2.1, 0.0, 1.0),
                                  event("B", 0, 4.5, 5.5, 2.3, 1.0), event("B", 1, 7.7, 8.7, 0.0, 1.0)], 0, 0),
            pipeline.Log(1, 0.0, [event("F", 0, 1.2, 2.2, 1.1, 1.0), event("B", 0, 2.3, 4.3, 0.0, 2.0),
                                  event("F", 1, 4.4, 5.4, 0.0, 1.0), event("B", 1, 5.5, 7.5, 0.0, 2.0)], 0, 0)]
    # rank 1's F0 waited from 0.1, before rank 0's F0 ended at 1.0: a crossing of 0.2 s. Its F1
    # found the activation there (sent at 2.1, taken at 4.4): none. Rank 0's B0 waited from 2.2
    # for the gradient sent at 4.3: 0.2 s; its B1 began at 7.7, long after 7.5, without waiting
    assert pipeline.crossings(logs) == pytest.approx([0.2, 0.2])
    # between two operations besides the wait: 0.1, 0.1, 0.1 (5.5 -> 7.7 counts 2.2, not waited);
    # on rank 1, 0.1 after each operation
    assert pipeline.between(logs) == pytest.approx([0.1, 0.1, 2.2, 0.1, 0.1, 0.1])


@pytest.mark.parametrize("stages, micro_batches, expected", [(1, 5, 0.0), (2, 1, 0.5), (4, 8, 3 / 11), (2, 16, 1 / 17),
                                                             (8, 64, 7 / 71)])
def test_the_bubble_formula(stages, micro_batches, expected):
    assert pipeline.bubble_fraction(stages, micro_batches) == pytest.approx(expected)


@given(n_layers=st.integers(1, 40), stages=st.integers(1, 40))
def test_split_layers_covers_every_layer_once_in_near_equal_parts(n_layers, stages):
    if stages > n_layers:
        with pytest.raises(ValueError, match=f"{n_layers} layers into {stages} stages"):
            pipeline.split_layers(n_layers, stages)
        return
    parts = pipeline.split_layers(n_layers, stages)
    assert [i for part in parts for i in part] == list(range(n_layers))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("call, message", [
    (lambda: pipeline.schedule("zero-bubble", 2, 4), "unknown schedule 'zero-bubble'; choose one of gpipe, 1f1b"),
    (lambda: pipeline.schedule("gpipe", 2, 0), "micro-batch count must be an integer >= 1; got 0"),
    (lambda: pipeline.schedule("1f1b", 0, 4), "stage count must be an integer >= 1; got 0"),
    (lambda: pipeline.schedule("1f1b", 2.0, 4), "stage count must be an integer >= 1; got 2.0"),
    (lambda: pipeline.schedule("1f1b", 2, True), "micro-batch count must be an integer >= 1; got True"),
    (lambda: pipeline.bubble_fraction(2, 0), "micro-batch count must be an integer >= 1; got 0"),
    (lambda: pipeline.split_layers(4, 5), "cannot split 4 layers into 5 stages: .* at most 4 stages"),
    (lambda: pipeline.split_batch(torch.zeros(10, 3), 4), "a batch of 10 cannot be cut into 4 equal micro-batches"),
    (lambda: pipeline.split_batch(torch.zeros(8, 3), -1), "micro-batch count must be an integer >= 1; got -1"),
])
def test_named_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


MICRO, BATCH, TOKENS = 4, 8, 32
DTYPE = torch.float64  # of the exactness run: both sides agree to float64's rounding, on any CPU
ELEMENT = torch.empty((), dtype=DTYPE).element_size()  # bytes of one activation the stages send
BUBBLE_SIZES = {"d": 128, "blocks": 1, "micro_batch": 4, "tokens": 128}


def on_rank(windows):
    """Everything this file checks on 2 processes, in one spawn: exactness, a rough bubble and
    the world-size error."""
    exact = pipeline_runs.exactness_rank(list(pipeline.KINDS), MICRO, windows, 2, 0.5, DTYPE)
    bubble = pipeline_runs.bubble_rank(["1f1b"], [1, 4], BUBBLE_SIZES, 3, 0, min_on_core=0.9, attempts=3)
    try:
        pipeline.execute(pipeline.schedule("gpipe", 3, 2), lambda micro, x: x, (1,))
        mismatch = None
    except ValueError as error:
        mismatch = str(error)
    return exact, bubble, mismatch


@pytest.fixture(scope="module")
def two_ranks():
    windows = pipeline_runs.training_windows(BATCH, TOKENS, seed=0)
    return run_on_ranks(on_rank, 2, windows, timeout_s=120)


@pytest.mark.numerics
def test_two_stages_give_one_process_loss_and_gradients(two_ranks):
    # absolute gaps, float64 both sides: measured 1.5e-16. The loss is about 1 and the gradients
    # up to 0.07 in size, so FP64_RELATIVE absolute is at most 1.5e-9 of either, relatively
    for kind in pipeline.KINDS:
        first, last = (exact[kind] for exact, _, _ in two_ranks)
        assert first["loss_gap"] is None and last["loss_gap"] < FP64_RELATIVE
        assert first["grad_gap"] < FP64_RELATIVE and last["grad_gap"] < FP64_RELATIVE
        assert "embed" in first["parameters"] and "lm_head" not in first["parameters"]
        assert "lm_head" in last["parameters"] and "embed" not in last["parameters"]
        assert {p.split(".")[1] for p in first["parameters"] if p.startswith("layers")} == {"0", "1"}


def test_the_logs_hold_each_operation_once_in_order_on_one_clock(two_ranks):
    activation_bytes = MICRO * (BATCH // MICRO) * TOKENS * 128 * ELEMENT  # m micro-batches of (b, T, d) in DTYPE
    for kind in pipeline.KINDS:
        logs = [exact[kind]["log"] for exact, _, _ in two_ranks]
        plan = pipeline.schedule(kind, 2, MICRO)
        times = {}
        for rank, log in enumerate(logs):
            assert log.rank == rank
            assert [(e.kind, e.micro) for e in log.events] == plan[rank]
            assert all(log.origin <= e.start <= e.end for e in log.events)
            assert all(a.end <= b.start for a, b in zip(log.events, log.events[1:]))  # one at a time
            times |= {(rank, e.kind, e.micro): e for e in log.events}
        for i in range(MICRO):  # perf_counter is one clock for both processes
            assert times[(1, "F", i)].start >= times[(0, "F", i)].end
            assert times[(0, "B", i)].start >= times[(1, "B", i)].end
        assert (logs[0].activation_bytes, logs[0].gradient_bytes) == (activation_bytes, 0)
        assert (logs[1].activation_bytes, logs[1].gradient_bytes) == (0, activation_bytes)
        assert 0 < pipeline.idle_share(logs) < 1
        # the same operation times with instant messages can only finish sooner
        assert pipeline.replayed_idle_share(plan, logs) <= pipeline.idle_share(logs) + 1e-9
        assert len(pipeline.timelines(logs)) == 2


def test_the_measured_bubble_is_roughly_the_formula(two_ranks):
    """Never below the formula, and fewer idle with more micro-batches: a busy machine (another
    test worker) slows one stage more than the other, which only adds idle time, by as much as
    the load likes (0.375 against 0.2 + 0.15 once in a fresh-clone run), so no upper bound holds
    on any machine; benchmarks/parallel.py (pipeline_runs.measure_bubble) holds the strict
    comparison on a quiet one."""
    bubble = [b["logs"] for _, b, _ in two_ranks]
    measured = {}
    for m in (1, 4):
        shares = sorted(pipeline.idle_share([logs[("1f1b", m)][r] for logs in bubble]) for r in range(3))
        measured[m] = shares[1]  # the median of 3
        assert pipeline.bubble_fraction(2, m) - 0.05 <= measured[m]
    assert measured[4] < measured[1]


def test_the_world_size_must_equal_the_stage_count(two_ranks):
    assert all(m == "the world size (2) must equal the stage count (3): one process per stage"
               for _, _, m in two_ranks)


@pytest.mark.slow
def test_stages_that_only_sleep_measure_the_messages_alone():
    """Two stages of 5 and 10 ms sleeps, 4 micro-batches: the logged operations take their sleeps,
    the messages cost something but far less than an operation, and charging every message the
    median crossing brings the replay closer to what was measured without passing far beyond it."""
    rows = pipeline_runs.message_cost([(2, 4, 8)], micro_batches=4, forward_s=0.005, backward_s=0.010,
                                      repeats=2, timeout_s=120)
    row, = rows
    assert row["bytes"] == 2 * 4 * 8 * 4 and row["formula"] == pytest.approx(0.2)
    assert 0 < row["crossing_ms"] < 5 and 0 <= row["between_ms"] < 5 and row["crossings"] >= 1
    assert row["instant"] <= row["with_messages"] <= row["measured"] + 0.05
    # the replay takes each operation's logged time; on a busy machine (the other test worker) a
    # 5 ms sleep overshoots by a millisecond or more, unevenly, which moves the replayed bubble
    # either way: 0.176 against the formula's 0.2 once in `make test`. The neighbour's 0.05 holds.
    assert row["formula"] - 0.05 <= row["instant"]


@pytest.mark.parametrize("arguments, message", [
    (dict(repeats=0), "repeat count must be an integer >= 1; got 0"),
    (dict(micro_batches=0), "micro-batch count must be an integer >= 1; got 0"),
    (dict(kind="zigzag"), "unknown schedule 'zigzag'"),
    (dict(forward_s=-0.01), "sleeps must be positive seconds; got -0.01"),
])
def test_message_cost_refuses_bad_input_before_starting_processes(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pipeline_runs.message_cost([(1, 1, 8)], **arguments)

