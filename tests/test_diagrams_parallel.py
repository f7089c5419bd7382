"""Chapter 10's diagrams draw the package's numbers, read back from the picture by gid: the ZeRO
grid's slices and totals are `memory.state_bytes` (and ZeRO's Figure 1), the all-reduce's chunks
are the values a real gloo reduce-scatter and all-gather returned and its byte counts are
`comm.ByteCounter`'s, the pipeline's boxes are a real run's `pipeline.timelines` (and the ideal
schedule's bubble is (p - 1) / (m + p - 1)), and the plan's bars are `plan.memory_per_gpu` and
`plan.time_split` on axes fixed per shape. Texts keep 9 pt, stay on the page and never overlap."""
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from _figures import assert_legible
from infra_lab import hardware
from infra_lab.diagrams import parallel as diagrams
from infra_lab.parallel import memory, plan as cost
from infra_lab.processes import run_on_ranks

WORLD, MICRO = 2, 4  # 2 processes: the machine has 2 cores
PIPELINE_SIZES = {"d": 32, "blocks": 1, "micro_batch": 2, "tokens": 32}
UNITS = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1.0, "s": 1.0, "ms": 1e-3}


def gids(figure, prefix: str) -> dict[tuple[str, ...], object]:
    """{the gid's fields after the prefix: the artist} over every axes' patches, texts and lines."""
    found = {}
    for ax in figure.axes:
        for artist in list(ax.patches) + list(ax.texts) + list(ax.lines):
            gid = artist.get_gid() or ""
            if gid.startswith(prefix + ":"):
                found[tuple(gid.split(":")[1:])] = artist
    return found


def quantity(text: str) -> float:
    """'31.4 GB' -> 3.14e10; '540 ms' -> 0.54."""
    number, unit = re.fullmatch(r"↑? ?([\d.,]+) (\w+)", text.strip()).groups()
    return float(number.replace(",", "")) * UNITS[unit]


def assert_inside(renderer, texts: dict, boxes: dict):
    """Each text drawn inside the box of the same key."""
    for key, text in texts.items():
        inner, outer = text.get_window_extent(renderer), boxes[key].get_window_extent(renderer)
        assert outer.x0 - 0.5 <= inner.x0 and inner.x1 <= outer.x1 + 0.5, (key, text.get_text())
        assert outer.y0 - 0.5 <= inner.y0 and inner.y1 <= outer.y1 + 0.5, (key, text.get_text())


# ---- one real run on 2 gloo processes: an all-reduce in two phases, and a 1F1B pipeline ----------------


def all_reduce_and_pipeline(sizes: dict) -> dict:
    """Rank r's tensor holds 10 r + c in chunk c (one float32 each); a reduce-scatter (rank r
    keeps chunk r summed) and an all-gather through comm.ByteCounter, which calls
    dist.reduce_scatter_single and dist.all_gather_single and counts the bytes; then a 1F1B batch
    of MICRO micro-batches on balanced stages (pipeline_runs.bubble_rank), its log."""
    import torch
    import torch.distributed as dist

    from infra_lab.parallel import pipeline_runs
    from infra_lab.parallel.comm import ByteCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    before = torch.tensor([10.0 * rank + c for c in range(world)])  # (world,): one element per chunk
    shard, after = torch.empty(1), torch.empty(world)
    counter = ByteCounter()
    counter.reduce_scatter(shard, before)
    counter.all_gather(after, shard)
    log = pipeline_runs.bubble_rank(["1f1b"], [MICRO], sizes, 1, 0)["logs"][("1f1b", MICRO)][0]
    return {"before": before.tolist(), "shard": shard.tolist(), "after": after.tolist(),
            "sent": {name: float(n) for name, n in counter.bytes_sent.items()}, "log": log}


@pytest.fixture(scope="module")
def real_run() -> list[dict]:
    return run_on_ranks(all_reduce_and_pipeline, WORLD, PIPELINE_SIZES, timeout_s=60)


# ---- ZeRO's stages ------------------------------------------------------------------------------------


def check_zero(figure, params: int, world: int, precision):
    states = {s: memory.state_bytes(params, world, s, precision) for s in memory.STAGES}
    totals = {int(stage): (int(n), text.get_text()) for (stage, n), text in gids(figure, "total").items()}
    assert totals == {s: (sum(states[s].values()), totals[s][1]) for s in memory.STAGES}
    for stage, (n, text) in totals.items():
        assert quantity(text) == pytest.approx(n, rel=5e-3)  # three significant digits
    ranks = diagrams.shown_ranks(world)
    assert [key[0] for key in gids(figure, "rank")] == [str(r) if r is not None else "more" for r in ranks]
    assert (world > diagrams.MAX_RANKS) == (None in ranks) and len(ranks) <= diagrams.MAX_RANKS
    segments, held = gids(figure, "segment"), gids(figure, "held")
    drawn = [r for r in ranks if r is not None]
    assert len(segments) == len(held) == 4 * 3 * len(drawn)
    per_element = {"parameters": precision.parameter_bytes, "gradients": precision.gradient_bytes,
                   "optimizer states": precision.optimizer_bytes}
    for stage in memory.STAGES:
        for rank in drawn:
            cells = [segments[(str(stage), str(rank), kind)] for kind in diagrams.STATE_KINDS]
            widths = np.array([c.get_width() for c in cells])
            full = np.array([states[0][kind] for kind in diagrams.STATE_KINDS], float)
            assert widths / widths.sum() == pytest.approx(full / full.sum())  # 2 : 2 : 12 in mixed precision
            for kind, cell in zip(diagrams.STATE_KINDS, cells):
                box = held[(str(stage), str(rank), kind)]
                elements = states[stage][kind] // per_element[kind]  # what the rank keeps of this kind
                if elements >= params:
                    span = (0.0, 1.0)
                else:  # its shard of the flat buffer, without the padding past the model's end
                    span = (min(rank * elements, params) / params, min((rank + 1) * elements, params) / params)
                assert (box.get_x() - cell.get_x()) / cell.get_width() == pytest.approx(span[0], abs=1e-12)
                assert box.get_width() / cell.get_width() == pytest.approx(span[1] - span[0], abs=1e-12)


def test_zero_figure_1_is_drawn_from_the_memory_model():
    """7.5B parameters on 64 ranks: 120, 31.4, 16.6 and 1.88 GB per rank (the paper: 120, 31.4,
    16.6, 1.9), ranks 0, 1, 2, ..., 63 drawn."""
    figure = diagrams.draw_zero_stages(7_500_000_000, 64)
    check_zero(figure, 7_500_000_000, 64, memory.MIXED)
    texts = {int(stage): text.get_text() for (stage, _), text in gids(figure, "total").items()}
    assert texts == {0: "120 GB", 1: "31.4 GB", 2: "16.6 GB", 3: "1.88 GB"}
    for stage, gb in memory.zero_figure_1().items():
        assert quantity(texts[stage]) / 1e9 == pytest.approx(gb, rel=5e-3)
    assert_legible(figure)


@settings(max_examples=8, deadline=None)
@given(params=st.integers(1, 10 ** 12), world=st.integers(1, 200), fp32=st.booleans())
def test_every_slice_is_the_ranks_share_of_state_bytes(params, world, fp32):
    precision = memory.FP32 if fp32 else memory.MIXED
    figure = diagrams.draw_zero_stages(params, world, precision)
    check_zero(figure, params, world, precision)
    assert_legible(figure)


# ---- all-reduce ---------------------------------------------------------------------------------------


def chunks(figure) -> dict[tuple[str, int, int], bool]:
    return {(phase, int(r), int(c)): state == "held" for phase, r, c, state in gids(figure, "chunk")}


@pytest.mark.parametrize("world", range(2, diagrams.MAX_WORLD + 1))
def test_the_all_reduce_holds_every_chunk_then_one_then_every_sum(world):
    figure = diagrams.draw_all_reduce(world)
    held = chunks(figure)
    assert len(held) == 3 * world * world
    for r in range(world):
        for c in range(world):
            assert held[("before", r, c)] and held[("after all-gather", r, c)]
            assert held[("after reduce-scatter", r, c)] == (r == c)  # rank r reduces chunk r
    values = {(phase, int(r), int(c)): t.get_text() for (phase, r, c), t in gids(figure, "value").items()}
    letter = [chr(ord("A") + c) for c in range(world)]
    assert values == {**{("before", r, c): f"{letter[c]}{r}" for r in range(world) for c in range(world)},
                      **{("after reduce-scatter", r, r): f"Σ{letter[r]}" for r in range(world)},
                      **{("after all-gather", r, c): f"Σ{letter[c]}" for r in range(world) for c in range(world)}}
    share = f"{world - 1}/{world} of the tensor"
    assert all(share in t.get_text() for t in gids(figure, "sends").values()) and len(gids(figure, "sends")) == 2
    renderer, _ = assert_legible(figure)
    assert_inside(renderer, gids(figure, "value"), {key[:3]: box for key, box in gids(figure, "chunk").items()})


def test_given_inputs_the_sums_are_written_in():
    inputs = [[1.5, 2.0, -3.0], [4.0, 0.25, 6.0], [7.0, 8.0, 9.0]]
    figure = diagrams.draw_all_reduce(3, inputs)
    values = {(phase, int(r), int(c)): float(t.get_text()) for (phase, r, c), t in gids(figure, "value").items()}
    sums = np.sum(inputs, axis=0)
    assert {k: v for k, v in values.items() if k[0] == "before"} == {("before", r, c): inputs[r][c]
                                                                      for r in range(3) for c in range(3)}
    assert {k: v for k, v in values.items() if k[0] == "after reduce-scatter"} == {
        ("after reduce-scatter", r, r): sums[r] for r in range(3)}
    assert {k: v for k, v in values.items() if k[0] == "after all-gather"} == {
        ("after all-gather", r, c): sums[c] for r in range(3) for c in range(3)}


@pytest.mark.slow
def test_the_all_reduce_draws_a_real_gloo_run(real_run):
    world = WORLD
    assert [r["before"] for r in real_run] == [[10.0 * r + c for c in range(world)] for r in range(world)]
    sums = [sum(10.0 * r + c for r in range(world)) for c in range(world)]
    assert [r["shard"] for r in real_run] == [[s] for s in sums]
    assert all(r["after"] == sums for r in real_run)
    measured = {phase: [r[key] for r in real_run] for phase, key in zip(diagrams.PHASES, ("before", "shard", "after"))}
    tensor_bytes = 4 * world  # float32, one element per chunk
    figure = diagrams.draw_all_reduce(world, measured, tensor_bytes=tensor_bytes)
    values = {(phase, int(r), int(c)): float(t.get_text()) for (phase, r, c), t in gids(figure, "value").items()}
    for r in range(world):
        for c in range(world):
            assert values[("before", r, c)] == real_run[r]["before"][c]
            assert values[("after all-gather", r, c)] == real_run[r]["after"][c]
        assert values[("after reduce-scatter", r, r)] == real_run[r]["shard"][0]
    assert len(values) == 2 * world * world + world
    sends = {step: t.get_text() for (step,), t in gids(figure, "sends").items()}
    for step, name in (("reduce-scatter", "reduce_scatter"), ("all-gather", "all_gather")):
        counted = {r["sent"][name] for r in real_run}
        assert counted == {(world - 1) / world * tensor_bytes}  # the ring's count, on every rank
        assert quantity(sends[step].split(" = ")[1]) == counted.pop()
    renderer, _ = assert_legible(figure)
    assert_inside(renderer, gids(figure, "value"), {key[:3]: box for key, box in gids(figure, "chunk").items()})


# ---- pipeline -----------------------------------------------------------------------------------------


def boxes(figure) -> dict[tuple[int, str, int], tuple[float, float]]:
    return {(int(r), op, int(m)): (box.get_x(), box.get_x() + box.get_width())
            for (r, op, m), box in gids(figure, "op").items()}


def title_shares(figure) -> tuple[float, float]:
    title = figure.axes[0].get_title(loc="left")
    measured, formula = re.search(r"idle ([\d.]+)% .* = ([\d.]+)%$", title).groups()
    return float(measured) / 100, float(formula) / 100


@pytest.mark.slow
def test_the_pipeline_draws_a_real_runs_log(real_run):
    from infra_lab.parallel import pipeline

    logs = [r["log"] for r in real_run]
    figure = diagrams.draw_pipeline(logs, title="1F1B, measured")
    lines = pipeline.timelines(logs)
    expected = {(rank, op, micro): (start * 1e3, end * 1e3) for rank, ops in enumerate(lines)
                for op, micro, start, end in ops}
    drawn = boxes(figure)
    assert drawn.keys() == expected.keys()
    assert all(drawn[key] == pytest.approx(span) for key, span in expected.items())
    measured, formula = title_shares(figure)
    assert measured == pytest.approx(pipeline.idle_share(logs), abs=5e-4)
    assert diagrams.idle_share(lines) == pytest.approx(pipeline.idle_share(logs))
    assert formula == pytest.approx(pipeline.bubble_fraction(WORLD, MICRO), abs=5e-4)
    idle = gids(figure, "idle")  # hatched from the first operation's start to the last one's end
    first, last = min(s for ops in lines for _, _, s, _ in ops), max(e for ops in lines for *_, e in ops)
    for rank in range(WORLD):
        band = idle[(str(rank),)]
        assert band.get_hatch() == diagrams.IDLE_HATCH
        assert (band.get_x(), band.get_x() + band.get_width()) == pytest.approx((first * 1e3, last * 1e3))
    assert figure.axes[0].get_xlabel().startswith("time (ms)")
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == [f"stage {r}" for r in range(WORLD)]
    again = diagrams.draw_pipeline(lines, title="1F1B, measured")  # the timelines draw the same picture
    assert boxes(again) == boxes(figure) and title_shares(again) == title_shares(figure)
    renderer, _ = assert_legible(figure)
    assert_inside(renderer, gids(figure, "micro"), gids(figure, "op"))


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["gpipe", "1f1b"]), stages=st.integers(1, 8), micro_batches=st.integers(1, 32))
def test_the_ideal_schedule_is_the_schedule_in_slots_and_its_bubble_the_formula(kind, stages, micro_batches):
    from infra_lab.parallel import pipeline

    figure = diagrams.draw_schedule(kind, stages, micro_batches)
    drawn = boxes(figure)
    plan = pipeline.schedule(kind, stages, micro_batches)
    for rank, ops in enumerate(plan):  # each rank's boxes, left to right, are its operations in order
        mine = sorted((span, (op, micro)) for (r, op, micro), span in drawn.items() if r == rank)
        assert [op for _, op in mine] == ops
        assert all(end - start == (1 if op == "F" else 2) for (start, end), (op, _) in mine)
    for (rank, op, micro), (start, _) in drawn.items():  # each starts once its input has arrived
        if op == "F" and rank > 0:
            assert start >= drawn[(rank - 1, "F", micro)][1]
        if op == "B" and rank < stages - 1:
            assert start >= drawn[(rank + 1, "B", micro)][1]
    assert max(end for _, end in drawn.values()) == 3 * (micro_batches + stages - 1)
    measured, formula = title_shares(figure)
    expected = pipeline.bubble_fraction(stages, micro_batches)
    rounding = 5e-4 + 1e-12  # the title prints 3 decimals
    assert measured == pytest.approx(expected, abs=rounding) and formula == pytest.approx(expected, abs=rounding)
    renderer, _ = assert_legible(figure)
    labels = gids(figure, "micro")
    assert all(t.get_text() == micro for (_, _, micro), t in labels.items())
    assert_inside(renderer, labels, gids(figure, "op"))


# ---- the plan explorer --------------------------------------------------------------------------------


def plans():
    return st.builds(cost.Plan, shape=st.sampled_from(list(cost.SHAPES.values())), stage=st.sampled_from(memory.STAGES),
                     tensor=st.sampled_from([1, 2, 4, 8]), pipeline=st.sampled_from([1, 2, 4, 8]),
                     micro_batch=st.sampled_from([1, 2, 4, 8, 16, 32]), recompute=st.booleans(),
                     gpu=st.sampled_from(cost.GPUS))


def valid(plan) -> bool:
    try:
        cost.memory_per_gpu(plan)  # checks the plan, and the width against the tensor-parallel size
    except ValueError:
        return False
    return True


def check_plan(figure, plan):
    memory_ax, time_ax = figure.axes
    held, seconds = cost.memory_per_gpu(plan), cost.time_split(plan)
    bars = {kind: (float(value), box) for (kind, value), box in gids(figure, "memory").items()}
    assert {k: v for k, (v, _) in bars.items()} == held
    top, at = diagrams.MEMORY_AXIS_BYTES, 0.0
    for kind in memory.KINDS:  # stacked bottom up, to scale, clipped at the axis
        value, box = bars[kind]
        assert box.get_y() * 1e9 == pytest.approx(min(at, top))
        assert box.get_height() * 1e9 == pytest.approx(min(value, max(top - at, 0)), abs=1e-3)
        at += value
    capacity = hardware.get(plan.gpu).memory_bytes
    [(line_bytes,)] = gids(figure, "capacity")
    assert float(line_bytes) == capacity and gids(figure, "capacity")[(line_bytes,)].get_ydata()[0] * 1e9 == capacity
    assert bool(gids(figure, "does-not-fit")) == (sum(held.values()) > capacity)
    assert bool(gids(figure, "memory-clipped")) == (sum(held.values()) > top)
    assert quantity(memory_ax.get_title().split(": ")[1]) == pytest.approx(sum(held.values()), rel=5e-3)
    times = {kind: float(value) for (kind, value), _ in gids(figure, "time").items()}
    assert times == seconds
    step = sum(seconds.values())
    shown_step, share = re.fullmatch(r"step (.+), (\d+)% compute", time_ax.get_title()).groups()
    assert quantity(shown_step) == pytest.approx(step, rel=5e-3)
    assert int(share) == round(100 * seconds["compute"] / step)
    legend = [t.get_text() for t in time_ax.get_legend().get_texts()]
    assert [entry.split(":")[0] for entry in legend] == list(diagrams.TIME_KINDS)[::-1]
    for entry in legend:
        kind, value = entry.split(": ")
        assert quantity(value) == pytest.approx(seconds[kind], rel=5e-3, abs=1e-9)


@settings(max_examples=12, deadline=None)
@given(plan=plans())
def test_the_plan_is_drawn_from_the_cost_model_and_stays_legible(plan):
    assume(valid(plan))
    figure = diagrams.draw_plan(plan)
    check_plan(figure, plan)
    _, svg_bytes = assert_legible(figure)
    assert svg_bytes < 40_000  # the static explorer keeps up to 64 frames in 2 MB


def test_the_axes_stay_fixed_per_shape_as_the_settings_change():
    shape = cost.SHAPES["GPT-3 175B"]
    settings_ = [dict(stage=0), dict(stage=3, micro_batch=8), dict(tensor=8, pipeline=8, micro_batch=1),
                 dict(tensor=4, pipeline=2, recompute=True, gpu="H200")]
    limits = set()
    for setting in settings_:
        plan = cost.Plan(shape, **setting)
        figure = diagrams.draw_plan(plan)
        check_plan(figure, plan)
        limits.add((figure.axes[0].get_ylim(), figure.axes[1].get_ylim()))
    assert len(limits) == 1
    small = diagrams.draw_plan(cost.Plan(cost.SHAPES["GPT-3 XL 1.3B"], stage=2))
    assert small.axes[0].get_ylim() == limits.pop()[0]  # memory: one axis for every shape
    assert gids(diagrams.draw_plan(cost.Plan(shape, stage=0)), "does-not-fit")  # 175B x 16 bytes on one GPU


# ---- what cannot be drawn -----------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: diagrams.draw_zero_stages(7.5e9, 64), r"one int >= 1 \(7_500_000_000, not 7.5e9\); got 7500000000.0"),
    (lambda: diagrams.draw_zero_stages(100, 0), "world size must be an integer >= 1; got 0"),
    (lambda: diagrams.draw_all_reduce(9), "on 2 to 8 ranks; got 9"),
    (lambda: diagrams.draw_all_reduce(2, [[1, 2, 3], [4, 5, 6]]), r"each of the 2 ranks 2 chunk values; got shape"),
    (lambda: diagrams.draw_all_reduce(2, {"before": [[1, 2], [3, 4]]}), "need the phases"),
    (lambda: diagrams.draw_all_reduce(2, {"before": [[1, 2], [3, 4]], "after reduce-scatter": [4, 6, 1],
                                          "after all-gather": [[4, 6], [4, 6]]}), "one summed chunk per rank"),
    (lambda: diagrams.draw_pipeline([]), "draw 1 to 16 stages"),
    (lambda: diagrams.draw_pipeline([[("X", 0, 0.0, 1.0)]]), r"rank 0: \('X', 0, 0.0, 1.0\) is not an operation"),
    (lambda: diagrams.draw_schedule("1f1b", 17, 4), "at most 16 stages; got 17"),
    (lambda: diagrams.draw_schedule("zero-bubble", 2, 4), "unknown schedule 'zero-bubble'"),
    (lambda: diagrams.draw_plan(cost.Plan(cost.SHAPES["GPT-3 6.7B"], tensor=3)), "must divide the 64 GPUs"),
])
def test_what_cannot_be_drawn_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_plan_that_cannot_run_says_why_instead_of_raising():
    figure = diagrams.draw_plan_or_why(cost.Plan(cost.SHAPES["GPT-3 XL 1.3B"], batch=64, micro_batch=3))
    (text,) = figure.texts
    assert "cannot run: a batch of 64 sequences does not split into 64 data-parallel ranks" in " ".join(text.get_text().split())
    assert_legible(figure)
