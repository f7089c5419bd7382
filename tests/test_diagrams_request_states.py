"""The request state diagram is drawn from its table: every RequestState has a box, every row of
TRANSITIONS an arrow that leaves its source's box and ends on its target's, labelled with the
row's text beside it; no two texts overlap, no label lies on an arrow, and counts appear where
asked."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.path import Path

from infra_lab.diagrams import request_states
from infra_lab.figures import MIN_FONT_PT, MAX_WIDTH_IN
from infra_lab.serving.request import RequestState

STATES = [s.value for s in RequestState]


def drawn(figure):
    """{state: its box}, {(from, to): the arrow's path in data units}, {gid: text} of the figure."""
    ax = figure.axes[0]
    boxes = {p.get_gid().removeprefix("state:"): p for p in ax.patches
             if isinstance(p, FancyBboxPatch) and (p.get_gid() or "").startswith("state:")}
    arrows = {tuple(p.get_gid().removeprefix("arrow:").split("->")): p.get_path() for p in ax.patches
              if isinstance(p, FancyArrowPatch) and (p.get_gid() or "").startswith("arrow:")
              and p.get_gid() != "arrow:start"}
    texts = {t.get_gid(): t for t in ax.texts}
    return boxes, arrows, texts


def inside(point, box, slack=0.03):
    x, y = point
    return (box.get_x() - slack <= x <= box.get_x() + box.get_width() + slack
            and box.get_y() - slack <= y <= box.get_y() + box.get_height() + slack)


def box_of(point, boxes):
    found = [state for state, box in boxes.items() if inside(point, box)]
    assert len(found) == 1, (point, found)
    return found[0]


def gap(path, extent):
    """Inches from the text box `extent` to the nearest point of `path` (curves flattened, sampled)."""
    best = np.inf
    for line in path.to_polygons(closed_only=False):
        for a, b in zip(line, line[1:]):
            for t in np.linspace(0, 1, 50):
                x, y = a + t * (b - a)
                dx = max(extent.x0 - x, 0, x - extent.x1)
                dy = max(extent.y0 - y, 0, y - extent.y1)
                best = min(best, np.hypot(dx, dy))
    return best


def check_picture(figure, transitions, counts=None):
    boxes, arrows, texts = drawn(figure)
    assert sorted(boxes) == sorted(STATES)
    for state, box in boxes.items():  # the name sits in its box
        assert texts[f"name:{state}"].get_text() == state
        assert inside(texts[f"name:{state}"].get_position(), box, slack=0)
    assert set(arrows) == {(a, b) for a, b, _ in transitions}
    for source, target, label in transitions:
        shaft = arrows[source, target].to_polygons(closed_only=False)[0]  # the shaft; the head follows
        assert box_of(shaft[0], boxes) == source  # read back: where the arrow starts and ends
        assert box_of(shaft[-1], boxes) == target
        text = texts[f"label:{source}->{target}"]
        assert text.get_text().replace("\n", " ") == label
        extent = text.get_window_extent().transformed(figure.axes[0].transData.inverted())
        gaps = {pair: gap(path, extent) for pair, path in arrows.items()}
        assert gaps[source, target] < 0.2  # beside its own arrow (inches), and nearer it than any other
        assert min(gaps, key=gaps.get) == (source, target), gaps
    for state in STATES:
        count = texts.get(f"count:{state}")
        if counts is None or state not in counts:
            assert count is None
        else:
            n = counts[state]
            assert count.get_text() == f"{n} request{'s' if n != 1 else ''}"
            assert inside(count.get_position(), boxes[state], slack=0)


def check_legible(figure):
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = figure.axes[0]
    texts = [t for t in ax.texts if t.get_text()]
    extents = [t.get_window_extent(renderer) for t in texts]
    for text, extent in zip(texts, extents):
        assert text.get_fontsize() >= MIN_FONT_PT
        assert figure.bbox.x0 <= extent.x0 and extent.x1 <= figure.bbox.x1, text.get_gid()
        assert figure.bbox.y0 <= extent.y0 and extent.y1 <= figure.bbox.y1, text.get_gid()
    clashes = [(a.get_gid(), b.get_gid()) for i, (a, ea) in enumerate(zip(texts, extents))
               for b, eb in zip(texts[i + 1:], extents[i + 1:]) if ea.overlaps(eb)]
    assert not clashes
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    for text, extent in zip(texts, extents):
        gid = text.get_gid()
        if gid.startswith("label:") or gid == "title":  # labels sit clear of every arrow and box
            for arrow in arrows:  # each polyline on its own: a CLOSEPOLY's dummy vertex is no point
                for line in arrow.get_path().transformed(ax.transData).to_polygons(closed_only=False):
                    assert not Path(line).intersects_bbox(extent, filled=False), (gid, arrow.get_gid())
            for box in boxes:
                assert not box.get_window_extent(renderer).overlaps(extent), (gid, box.get_gid())
    assert figure.get_figwidth() <= MAX_WIDTH_IN


def test_every_state_has_a_box_and_every_transition_an_arrow():
    assert {a for a, _, _ in request_states.TRANSITIONS} | {b for _, b, _ in request_states.TRANSITIONS} \
        == set(STATES)
    figure = request_states.draw()
    check_picture(figure, request_states.TRANSITIONS)
    check_legible(figure)
    assert drawn(figure)[2]["title"].get_text()


def test_the_table_says_what_the_engine_does():
    table = {(a, b): label for a, b, label in request_states.TRANSITIONS}
    assert ("running", "running") in table  # a step at a time
    for live in ("waiting", "running", "preempted"):
        assert table[live, "aborted"] == "abort(request_id)"
    for terminal in ("finished", "aborted"):  # nothing leaves an end state
        assert not [a for a, b in table if a == terminal]
    assert not [a for a, b in table if b == "waiting"]  # preempted requests wait as "preempted"


@settings(max_examples=25, deadline=None)
@given(counts=st.dictionaries(st.sampled_from(STATES), st.integers(0, 100_000)),
       as_enum=st.booleans(), keep=st.lists(st.booleans(), min_size=len(request_states.TRANSITIONS),
                                           max_size=len(request_states.TRANSITIONS)))
def test_counts_and_any_subset_of_the_table_are_drawn_as_given(counts, as_enum, keep):
    transitions = tuple(t for t, k in zip(request_states.TRANSITIONS, keep) if k)
    highlight = {RequestState(s) if as_enum else s: n for s, n in counts.items()}
    figure = request_states.draw(highlight=highlight, transitions=transitions, title="A run's end states")
    check_picture(figure, transitions, counts)
    check_legible(figure)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="got 'done': 3"):
        request_states.draw(highlight={"done": 3})
    with pytest.raises(ValueError, match="counts >= 0; got 'finished': -1"):
        request_states.draw(highlight={"finished": -1})
    with pytest.raises(ValueError, match="'running' -> 'swapped' names a state outside RequestState"):
        request_states.draw(transitions=(("running", "swapped", "x"),))
    with pytest.raises(ValueError, match="no route is laid out for finished -> waiting"):
        request_states.draw(transitions=(("finished", "waiting", "x"),))
    with pytest.raises(ValueError, match="running -> finished appears 2 times"):
        request_states.draw(transitions=(("running", "finished", "a"), ("running", "finished", "b")))
