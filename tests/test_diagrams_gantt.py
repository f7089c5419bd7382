"""The Gantt chart draws what the step log says: its cells and marks, read back from the drawn
collections by position, equal `request_rows`, which equals a per-request walk of the log; labels
never overlap and stay on the page, and what it cannot draw legibly is refused by name."""

import matplotlib
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.text import Text

from infra_lab.diagrams import gantt
from infra_lab.figures import MIN_FONT_PT
from infra_lab.serving.steplog import StepRecord, Work

ROLES = ("prefill", "decode", "held", "preempted", "swapped out", "swapped in", "decode swapped in")


@st.composite
def logs(draw, max_requests=10, max_steps=24):
    """A random schedule: each step a random subset of requests, each with a role; some finish."""
    n_requests = draw(st.integers(1, max_requests))
    index, clock, records = draw(st.integers(0, 50)), draw(st.sampled_from([0.0, 3.25, 1e4])), []
    for _ in range(draw(st.integers(1, max_steps))):
        picked = draw(st.lists(st.integers(0, n_requests - 1), unique=True, max_size=n_requests))
        roles = {r: draw(st.sampled_from(ROLES)) for r in picked}
        work = tuple(Work(r, "prefill" if role == "prefill" else "decode",
                          draw(st.integers(1, 300)) if role == "prefill" else 1)
                     for r, role in roles.items() if role in ("prefill", "decode", "decode swapped in"))
        of = lambda *names: tuple(r for r, role in roles.items() if role in names)  # noqa: E731
        finished = tuple(w.request_id for w in work if draw(st.booleans()) and draw(st.booleans()))
        start = clock + draw(st.sampled_from([0.0, 0.0005, 0.3]))
        end = start + draw(st.sampled_from([0.004, 0.02, 0.9]))  # a step takes time: no zero-width cells
        records.append(StepRecord(index, start, end, (end - start) / 2, work,
                                  preempted=of("preempted", "swapped out"), swapped_out=of("swapped out"),
                                  swapped_in=of("swapped in", "decode swapped in"), finished=finished,
                                  held=of("held")))
        index, clock = index + draw(st.integers(1, 3)), end
    arrivals = draw(st.one_of(st.none(), st.dictionaries(
        st.integers(0, n_requests + 2), st.floats(records[0].start_s - 1, clock + 1), max_size=n_requests)))
    return records, arrivals


def walk(log, arrivals):
    """request_rows by a second route: each request on its own, step by step."""
    arrivals = arrivals or {}
    named = set(arrivals)
    for record in log:
        named |= {w.request_id for w in record.work} | set(record.preempted + record.swapped_out
                                                           + record.swapped_in + record.finished + record.held)
    rows = {}
    for r in sorted(named):
        cells, seen, waits = [], False, False
        for record in log:
            if not seen and r in arrivals and arrivals[r] < record.end_s:
                seen, waits = True, True
            work = [w for w in record.work if w.request_id == r]
            out = r in record.preempted or r in record.swapped_out
            if work:
                cells.append((record.index, work[0].kind, work[0].n_tokens))
            elif r in record.held:
                cells.append((record.index, "held", 0))
            elif waits or out:
                cells.append((record.index, "waiting", 0))
            if r in record.preempted and r not in record.swapped_out:
                cells.append((record.index, "preempted", 0))
            if r in record.swapped_out:
                cells.append((record.index, "swapped out", 0))
            if r in record.swapped_in:
                cells.append((record.index, "swapped in", 0))
            mentioned = bool(work) or out or r in record.held + record.swapped_in + record.finished
            seen = seen or mentioned
            if r in record.finished:
                waits = False
            elif out:
                waits = True
            elif mentioned:
                waits = False
        rows[r] = cells
    return rows


def cell_boxes(collection):
    """(x0, x1, y0, y1) of each cell, from the drawn paths (a compound path holds several)."""
    for path in collection.get_paths():
        for polygon in path.to_polygons(closed_only=False):
            yield polygon[:, 0].min(), polygon[:, 0].max(), polygon[:, 1].min(), polygon[:, 1].max()


def read_back(figure, log):
    """{request id: sorted [(step, kind)]} and {(request id, step): (n_tokens label or None, colour)}
    of the prefill cells, all found by position: rows by the y tick labels, steps by x."""
    ax = figure.axes[0]
    row_of = {round(y): int(label.get_text()) for y, label in zip(ax.get_yticks(), ax.get_yticklabels())}
    xlabel = ax.get_xlabel()
    scale = 1e3 if xlabel.startswith("time (ms)") else 1.0
    t0 = log[0].start_s

    def step_at(x0, x1):
        if not xlabel.startswith("time"):
            assert x1 - x0 <= 1
            return round((x0 + x1) / 2)
        [index] = [r.index for r in log if abs((r.start_s - t0) * scale - x0) < 1e-6 * max(1, abs(x0))
                   and abs((r.end_s - t0) * scale - x1) < 1e-6 * max(1, abs(x1))]
        return index

    def step_centred_at(x):
        if not xlabel.startswith("time"):
            return round(x)
        [index] = [r.index for r in log if abs((r.start_s + r.end_s - 2 * t0) * scale / 2 - x) < 1e-6 * max(1, abs(x))]
        return index

    drawn, prefills = {}, {}
    for artist in ax.collections:
        gid = artist.get_gid() or ""
        kind = gid.split(":", 1)[1]
        if gid.startswith("cells:"):
            assert isinstance(artist, (PolyCollection, PathCollection))
            colours = artist.get_facecolors()
            for k, (x0, x1, y0, y1) in enumerate(cell_boxes(artist)):
                assert y1 - y0 == pytest.approx(gantt.ROW_FILL)
                key = (row_of[round((y0 + y1) / 2)], step_at(x0, x1))
                drawn.setdefault(key[0], []).append((key[1], kind))
                if kind == "prefill":
                    prefills[key] = [None, matplotlib.colors.to_hex(colours[k])]
            if kind == "held":
                assert artist.get_hatch() == "////"
        elif gid.startswith("marks:"):
            for x, y in artist.get_offsets():
                drawn.setdefault(row_of[round(y)], []).append((step_centred_at(x), kind))
    for text in ax.texts:  # a token count sits in the middle of its prefill cell
        assert (text.get_gid() or "").startswith("tokens:")
        x, y = text.get_position()
        prefills[row_of[round(y)], step_centred_at(x)][0] = int(text.get_text())
    return {r: sorted(cells) for r, cells in drawn.items()}, prefills


def texts(figure):
    """Every text a reader sees: title, tick and axis labels, legend entries and cell labels."""
    ax = figure.axes[0]
    title = ax.get_title(loc="left")
    [title] = figure.findobj(lambda artist: isinstance(artist, Text) and artist.get_text() == title)
    found = [title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels(),
             *ax.get_legend().get_texts(), *ax.texts]
    lo, hi = ax.get_xlim()
    found = [t for t in found if t.get_text() and t.get_visible()
             and not (t in ax.get_xticklabels() and not lo - 1e-9 <= t.get_position()[0] <= hi + 1e-9)]
    return found


def assert_legible(figure):
    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # places the axis labels under the tick labels
    renderer = canvas.get_renderer()
    shown = texts(figure)
    boxes = [t.get_window_extent(renderer) for t in shown]
    page = figure.bbox
    for text, box in zip(shown, boxes):
        assert text.get_fontsize() >= MIN_FONT_PT, text
        assert page.x0 - 0.5 <= box.x0 and box.x1 <= page.x1 + 0.5, text
        assert page.y0 - 0.5 <= box.y0 and box.y1 <= page.y1 + 0.5, text
    clashes = [(shown[i].get_text(), shown[j].get_text()) for i in range(len(boxes))
               for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
    assert not clashes
    assert figure.get_figwidth() <= 7.0


@settings(max_examples=40, deadline=None)
@given(case=logs())
def test_request_rows_is_a_per_request_walk_of_the_log(case):
    log, arrivals = case
    rows = gantt.request_rows(log, arrivals)
    assert {r: [tuple(c) for c in cells] for r, cells in rows.items()} == walk(log, arrivals)
    for cells in rows.values():  # at most one fill per request and step, and fills come first
        fills = [c.step for c in cells if c.kind in gantt.FILLS]
        assert len(fills) == len(set(fills))


@settings(max_examples=30, deadline=None)
@given(case=logs(), time_axis=st.booleans(), data=st.data())
def test_the_picture_is_the_log(case, time_axis, data):
    log, arrivals = case
    rows = gantt.request_rows(log, arrivals)
    if not rows:
        with pytest.raises(ValueError, match="name no request"):
            gantt.draw(log, arrivals=arrivals)
        return
    ids = data.draw(st.one_of(st.none(), st.permutations(list(rows)).flatmap(
        lambda p: st.integers(1, len(p)).map(lambda k: p[:k]))))
    figure = gantt.draw(log, request_ids=ids, time_axis=time_axis, arrivals=arrivals)
    drawn, prefills = read_back(figure, log)
    shown = list(rows) if ids is None else ids
    expected = {r: sorted((c.step, c.kind) for c in rows[r]) for r in shown if rows[r]}
    assert drawn == expected
    ax = figure.axes[0]
    assert [int(t.get_text()) for t in ax.get_yticklabels()] == shown  # top to bottom, in the order asked
    assert ax.get_xlabel().startswith("time" if time_axis else "step")

    tokens = {(r, c.step): c.n_tokens for r in shown for c in rows[r] if c.kind == "prefill"}
    assert set(prefills) == set(tokens)
    labels = [label for label, _ in prefills.values()]
    assert labels == [None] * len(labels) or all(label == tokens[key] for key, (label, _) in prefills.items())
    darkness = {key: 1 - np.mean(matplotlib.colors.to_rgb(colour)) for key, (_, colour) in prefills.items()}
    for a in tokens:  # darker for more tokens
        for b in tokens:
            if tokens[a] < tokens[b]:
                assert darkness[a] <= darkness[b] + 1e-9
            if tokens[a] == tokens[b]:
                assert prefills[a][1] == prefills[b][1]

    kinds = {c.kind for r in shown for c in rows[r]}
    if labels and labels[0] is not None:
        kinds = kinds - {"prefill"} | {"prefill labelled"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        gantt.LEGEND[k] for k in ("prefill", "prefill labelled", *gantt.FILLS[1:], *gantt.MARKS) if k in kinds]
    assert_legible(figure)


def static_batching():
    """Two batches of four: each member holds its slot, idle, until the batch's longest finishes."""
    outputs, log, step = [3, 5, 8, 4, 2, 6, 6, 3], [], 0
    for batch in ([0, 1, 2, 3], [4, 5, 6, 7]):
        longest = max(outputs[r] for r in batch)
        for k in range(longest):
            work = tuple(Work(r, "prefill" if k == 0 else "decode", 20 + 10 * r if k == 0 else 1)
                         for r in batch if k < outputs[r])
            log.append(StepRecord(step, step * 0.01, step * 0.01 + 0.009, 0.008, work,
                                  finished=tuple(r for r in batch if k == outputs[r] - 1),
                                  held=tuple(r for r in batch if k >= outputs[r])))
            step += 1
    return log


def test_static_batching_draws_held_slots_and_labelled_prefills():
    log = static_batching()
    figure = gantt.draw(log, title="Static batching")
    drawn, prefills = read_back(figure, log)
    assert [s for s, kind in drawn[0] if kind == "held"] == [3, 4, 5, 6, 7]  # request 0 done after 3 steps
    assert drawn[2] == [(0, "prefill")] + [(s, "decode") for s in range(1, 8)]
    assert {key: label for key, (label, _) in prefills.items()} == {(r, 0 if r < 4 else 8): 20 + 10 * r
                                                                    for r in range(8)}
    assert figure.axes[0].get_title(loc="left") == "Static batching"
    assert_legible(figure)


def test_waiting_runs_from_arrival_or_preemption_to_the_next_step():
    log = [StepRecord(0, 0.0, 1.0, 0.5, (Work(0, "prefill", 8),)),
           StepRecord(1, 1.0, 2.0, 0.5, (Work(0, "decode", 1),)),
           StepRecord(2, 2.0, 3.0, 0.5, (Work(1, "prefill", 4),), preempted=(0,)),
           StepRecord(3, 3.0, 4.0, 0.5, (Work(1, "decode", 1),)),
           StepRecord(4, 4.0, 5.0, 0.5, (Work(0, "prefill", 9),), swapped_out=(1,), preempted=(1,)),
           StepRecord(5, 5.0, 6.0, 0.5, (Work(0, "decode", 1), Work(1, "decode", 1)), swapped_in=(1,),
                      finished=(0, 1))]
    rows = gantt.request_rows(log, arrivals={1: 0.5, 2: 3.5})
    assert [(c.step, c.kind) for c in rows[0]] == [(0, "prefill"), (1, "decode"), (2, "waiting"),
                                                  (2, "preempted"), (3, "waiting"), (4, "prefill"), (5, "decode")]
    assert [(c.step, c.kind) for c in rows[1]] == [(0, "waiting"), (1, "waiting"), (2, "prefill"), (3, "decode"),
                                                  (4, "waiting"), (4, "swapped out"), (5, "decode"),
                                                  (5, "swapped in")]
    assert [(c.step, c.kind) for c in rows[2]] == [(s, "waiting") for s in (3, 4, 5)]  # never admitted
    assert [(c.step, c.kind) for c in gantt.request_rows(log)[1]][:1] == [(2, "prefill")]  # no arrivals given


def random_log(n_requests, n_steps, seed=0):
    rng = np.random.default_rng(seed)
    log = []
    for k in range(n_steps):
        ids = [int(r) for r in rng.permutation(n_requests)[:rng.integers(4, n_requests)]]
        work = tuple(Work(r, "prefill" if rng.random() < 0.2 else "decode", int(rng.integers(1, 256)))
                     for r in ids[:-3])
        log.append(StepRecord(k, k * 0.02, k * 0.02 + 0.015, 0.01, work, preempted=tuple(ids[-3:-1]),
                              swapped_out=tuple(ids[-3:-2]), swapped_in=tuple(ids[-1:]), held=()))
    return log


@pytest.mark.parametrize("time_axis", [False, True])
def test_the_largest_chart_is_legible(time_axis):
    """(Its speed, about 0.5 s on an idle core, is not asserted: a timed unit test fails on a busy
    machine and measures nothing.)"""
    log = random_log(gantt.MAX_REQUESTS, gantt.MAX_STEPS)
    figure = gantt.draw(log, time_axis=time_axis)
    FigureCanvasAgg(figure).draw()
    assert len(figure.axes[0].get_yticklabels()) == gantt.MAX_REQUESTS // 2  # thinned to stay 9 pt apart
    assert_legible(figure)


def test_it_draws_into_a_given_axes():
    figure = Figure(figsize=(6.5, 4))
    ax = figure.add_axes((0.1, 0.3, 0.85, 0.6))
    assert gantt.draw(static_batching(), ax=ax) is figure
    assert figure.axes == [ax] and {c.get_gid() for c in ax.collections} == {"cells:prefill", "cells:decode",
                                                                            "cells:held"}


def test_in_a_constrained_layout_the_row_labels_thin_to_the_final_size():
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    grid = figure.add_gridspec(2, 2, width_ratios=[2.2, 1])
    ax = figure.add_subplot(grid[:, 0])
    gantt.draw(random_log(32, 60), ax=ax, title="")
    figure.add_subplot(grid[0, 1]).set_xlabel("TTFT (s)")
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    labels = [t for t in ax.get_yticklabels() if t.get_text()]
    assert 4 <= len(labels) < 32 and labels[0].get_text() == "0"
    boxes = [t.get_window_extent(canvas.get_renderer()) for t in labels]
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    assert ax.get_title(loc="left") == ""


def test_what_it_cannot_draw_is_refused_by_name():
    work = (Work(0, "decode", 1),)
    with pytest.raises(ValueError, match="at most 64 requests and 1000 steps legibly; got 65 requests"):
        gantt.draw(random_log(65, 10))
    with pytest.raises(ValueError, match="got 8 requests and 1001 steps"):
        gantt.draw(random_log(8, 1001))
    with pytest.raises(ValueError, match="the step log is empty"):
        gantt.draw([])
    with pytest.raises(ValueError, match=r"requests \[7\] are not in the log or arrivals, which name \[0\]"):
        gantt.draw([StepRecord(0, 0, 1, 1, work)], request_ids=[0, 7])
    with pytest.raises(ValueError, match=r"request_ids \[0, 0\] must name at least one request, each once"):
        gantt.draw([StepRecord(0, 0, 1, 1, work)], request_ids=[0, 0])
    with pytest.raises(ValueError, match="name no request"):
        gantt.draw([StepRecord(0, 0, 1, 1, ())])
    with pytest.raises(ValueError, match="step indices must increase along the log; step 3 follows 3"):
        gantt.request_rows([StepRecord(3, 0, 1, 1, work), StepRecord(3, 1, 2, 1, work)])
    with pytest.raises(ValueError, match="a request works at most once a step"):
        gantt.request_rows([StepRecord(0, 0, 1, 1, work * 2)])
    with pytest.raises(ValueError, match=r"requests \[0\] both work and hold an idle slot"):
        gantt.request_rows([StepRecord(0, 0, 1, 1, work, held=(0,))])
    with pytest.raises(ValueError, match="did 'verify' of 1 tokens"):
        gantt.request_rows([StepRecord(0, 0, 1, 1, (Work(0, "verify", 1),))])
    overlapping = [StepRecord(0, 0.0, 1.0, 1, work), StepRecord(1, 0.5, 2.0, 1, work)]
    gantt.draw(overlapping)  # fine by step index
    with pytest.raises(ValueError, match="step 1 starts at 0.5 s, before step 0 ends at 1.0 s"):
        gantt.draw(overlapping, time_axis=True)
