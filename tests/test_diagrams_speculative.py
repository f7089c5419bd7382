"""The speculative decoding diagrams draw what a real run and real distributions say: the timeline's
boxes, read back by position, are each round's drafts, verdicts and target tokens (its verdict lane
spells the run's output), its time axis is the rounds' seconds; the acceptance chart's bars are
min(p, q), max(0, p − q) and max(0, q − p) of the tokens it names, and its α is 1 − TV(p, q).
Texts keep 9 pt, stay on the page and never overlap, and what cannot be drawn is refused by name."""
import re

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from infra_lab.diagrams import speculative
from infra_lab.figures import MAX_WIDTH_IN, MIN_FONT_PT
from infra_lab.model import tokenizer
from infra_lab.model.generate import distribution
from infra_lab.model.transformer import load
from infra_lab.serving.drafters import ModelDrafter, PromptLookupDrafter
from infra_lab.serving.speculative import Round, speculative_generate

PROMPT = "def f(x):\n    return"


@pytest.fixture(scope="module")
def models():
    return load("target"), load("draft")


@pytest.fixture(scope="module")
def model_run(models):
    target, draft = models
    return speculative_generate(target, ModelDrafter(draft), PROMPT, 4, 30)


@pytest.fixture(scope="module")
def lookup_run(models):
    """Prompt lookup proposes nothing where the last tokens never occurred before: rounds with no
    drafts, only the target's forward."""
    run = speculative_generate(models[0], PromptLookupDrafter(256), PROMPT, 4, 30)
    assert any(not r.drafted for r in run.rounds)
    return run


@pytest.fixture(scope="module")
def distributions(models):
    """(p, q) of the target and the drafter at temperature 1 after each prefix of a real text, and α."""
    target, draft = models
    tokens = list(tokenizer.encode(PROMPT + " self._context\n\n\ndef _set(self):"))
    p = np.array([distribution(row, 1.0) for row in target.forward(tokens)])
    q = np.array([distribution(row, 1.0) for row in draft.forward(tokens)])
    return p, q, np.minimum(p, q).sum(axis=1)


def show(token: int) -> str:
    return speculative.printable(tokenizer.decode([token]))


# ---- the timeline -----------------------------------------------------------------------------


def boxes(ax):
    """{kind: [(x0, x1, y0, y1)]} of the drawn boxes, left to right."""
    found = {}
    for collection in ax.collections:
        gid = collection.get_gid() or ""
        if gid.startswith("cells:"):
            spans = [(v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max())
                     for path in collection.get_paths() for v in [path.vertices]]
            found[gid.removeprefix("cells:")] = sorted(spans)
    return found


def expected_boxes(rounds):
    counts = dict.fromkeys(speculative.KINDS, 0)
    for r in rounds:
        counts["draft"] += len(r.drafted)
        counts["verify"] += 1
        counts["accepted"] += min(r.accepted, len(r.emitted))
        counts["cut"] += r.accepted - min(r.accepted, len(r.emitted))
        counts["rejected"] += len(r.drafted) - r.accepted
        counts["target"] += len(r.emitted) == r.accepted + 1
    return {kind: n for kind, n in counts.items() if n}


def texts(figure):
    """Every text a reader sees: title, axis and tick labels, legend entries, the axes' texts."""
    ax = figure.axes[0]
    found = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels(),
             *ax.get_legend().get_texts(), *ax.texts]
    lo, hi = sorted(ax.get_xlim())
    return [t for t in found if t.get_text() and t.get_visible()
            and not (t in ax.get_xticklabels() and not lo - 1e-9 <= t.get_position()[0] <= hi + 1e-9)]


def assert_legible(figure):
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    shown = texts(figure)
    extents = [Text.get_window_extent(t, renderer) for t in shown]  # an annotation's text, not its arrow
    page = figure.bbox
    for text, box in zip(shown, extents):
        assert text.get_fontsize() >= MIN_FONT_PT, text
        assert page.x0 - 0.5 <= box.x0 and box.x1 <= page.x1 + 0.5, text
        assert page.y0 - 0.5 <= box.y0 and box.y1 <= page.y1 + 0.5, text
    clashes = [(shown[i].get_text(), shown[j].get_text()) for i in range(len(shown))
               for j in range(i + 1, len(shown)) if extents[i].overlaps(extents[j])]
    assert not clashes
    assert figure.get_figwidth() <= MAX_WIDTH_IN
    return renderer


def check_timeline(ax, rounds, time_axis):
    """The boxes are the rounds': per kind, per round, aligned lane to lane; each written token
    lies inside its box and is that box's token; the verdict lane spells what the rounds emitted."""
    n = len(ax.get_xticklabels()) if not time_axis else None
    drawn = boxes(ax)
    shown = rounds[:speculative.rounds_that_fit(rounds, ax.get_position().width * ax.figure.get_figwidth())]
    if n is not None:
        assert n == len(shown)
    assert {kind: len(spans) for kind, spans in drawn.items()} == expected_boxes(shown)
    lanes = {kind: {round((y0 + y1) / 2) for *_, y0, y1 in spans} for kind, spans in drawn.items()}
    assert lanes == {kind: {speculative.LANE_OF[kind]} for kind in drawn}
    verdicts = sorted(s for kind in ("accepted", "rejected", "cut") for s in drawn.get(kind, []))
    assert [s[:2] for s in verdicts] == [s[:2] for s in drawn.get("draft", [])]  # each drafted token's verdict under it
    verify = {s[:2] for s in drawn["verify"]}
    assert all(s[:2] in verify for s in drawn.get("target", []))  # the target's token under its forward

    # the tokens, read back by position: which box each written token sits in
    cells, _, _, _ = speculative.timeline_cells(shown, time_axis)
    renderer = FigureCanvasAgg(ax.figure).get_renderer()
    labelled = {}
    for text in ax.texts:
        kind = text.get_gid().split(":")[1]
        x, y = text.get_position()
        [cell] = [c for c in cells if c.kind == kind and c.x0 < x < c.x1]
        assert text.get_text() == show(cell.token)
        extent = text.get_window_extent(renderer).transformed(ax.transData.inverted())
        assert cell.x0 <= extent.x0 and extent.x1 <= cell.x1  # inside its own box: clear of its neighbours
        assert round(y) == speculative.LANE_OF[kind]
        labelled[cell] = text.get_text()
    out = [c for c in sorted(cells, key=lambda c: c.x0) if c.kind in ("accepted", "target")]
    if all(c in labelled for c in out):
        assert "".join(labelled[c] for c in out) == "".join(show(t) for r in shown for t in r.emitted)
    return cells, labelled


def test_the_timeline_of_a_real_run_is_its_rounds(model_run):
    rounds = model_run.rounds
    ax = speculative.draw_timeline(rounds, time_axis=False)
    cells, labelled = check_timeline(ax, rounds, time_axis=False)
    assert len(labelled) == sum(c.kind != "verify" for c in cells)  # equal widths hold every token
    shown = rounds[:len(ax.get_xticklabels())]
    title = ax.get_title(loc="left")
    kept, drafted = sum(r.accepted for r in shown), sum(len(r.drafted) for r in shown)
    assert f"{kept} of {drafted} drafts accepted" in title.replace("\n", " ")
    if len(rounds) > len(shown):
        assert f"the first {len(shown)} of {len(rounds)} rounds" in title
    assert [t.get_text() for t in ax.get_yticklabels()] == list(speculative.LANES)
    assert_legible(ax.figure)


def test_on_the_time_axis_a_box_is_as_long_as_its_step(model_run):
    rounds = model_run.rounds
    ax = speculative.draw_timeline(rounds)
    cells, _ = check_timeline(ax, rounds, time_axis=True)
    shown = rounds[:speculative.rounds_that_fit(rounds, ax.get_position().width * ax.figure.get_figwidth())]
    assert ax.get_xlabel().startswith("time in the drafter and the target (ms)")
    starts = np.cumsum([0] + [(r.draft_s + r.verify_s) * 1e3 for r in shown])
    for span, r, start in zip(boxes(ax)["verify"], shown, starts):  # after the round's drafts, inset a hair
        assert (span[0] + span[1]) / 2 == pytest.approx(start + (r.draft_s + r.verify_s / 2) * 1e3)
        assert 0.6 * r.verify_s * 1e3 <= span[1] - span[0] <= r.verify_s * 1e3
    drafts = iter(boxes(ax).get("draft", []))
    for r, start in zip(shown, starts):  # the drafter's time, split evenly among its tokens
        for i in range(len(r.drafted)):
            x0, x1, *_ = next(drafts)
            assert (x0 + x1) / 2 == pytest.approx(start + (i + 0.5) * r.draft_s * 1e3 / len(r.drafted))
    assert ax.get_xlim()[1] == pytest.approx(starts[-1])
    assert_legible(ax.figure)


@pytest.mark.parametrize("time_axis", [True, False])
def test_rounds_without_a_draft_draw_the_target_alone(lookup_run, time_axis):
    ax = speculative.draw_timeline(lookup_run.rounds, time_axis=time_axis)
    check_timeline(ax, lookup_run.rounds, time_axis)
    assert_legible(ax.figure)


def test_cut_drafts_long_runs_and_a_given_axes():
    """A stop token cuts a round short: its accepted drafts after the stop are drawn as cut, and
    it has no target token. Past what fits, the first rounds are drawn and the title says so."""
    stop = Round(drafted=(97, 10, 98, 99), accepted=3, emitted=(97, 10), draft_s=0.004, verify_s=0.003)
    rounds = [Round((104, 105), 1, (104, 33), 0.002, 0.003), Round((), 0, (32,), 0.0, 0.003), stop]
    ax = speculative.draw_timeline(rounds, tokens_to_text=lambda ts: tokenizer.decode(ts).upper())
    assert {k: len(v) for k, v in boxes(ax).items()} == {"draft": 6, "verify": 3, "accepted": 3, "rejected": 2,
                                                         "target": 2, "cut": 1}
    assert {t.get_text() for t in ax.texts} >= {"H", "I", "!", "␣", "A", "⏎"}
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == speculative.LEGEND["cut"]
    assert_legible(ax.figure)

    many = rounds * 10
    ax = speculative.draw_timeline(many, time_axis=False)
    n = len(ax.get_xticklabels())
    assert n == speculative.rounds_that_fit(many, ax.get_position().width * ax.figure.get_figwidth()) < len(many)
    assert f"(the first {n} of {len(many)} rounds)" in ax.get_title(loc="left")
    assert_legible(ax.figure)

    figure = Figure(figsize=(6.5, 3.5))
    given = figure.add_axes((0.15, 0.45, 0.8, 0.4))
    assert speculative.draw_timeline(rounds, ax=given, title="Three rounds") is given
    assert given.get_title(loc="left") == "Three rounds" and figure.axes == [given]
    assert speculative.draw_timeline(rounds, title="").get_title(loc="left") == ""


def test_a_timeline_it_cannot_draw_is_refused_by_name():
    good = Round((1, 2), 1, (1, 5), 0.001, 0.002)
    with pytest.raises(ValueError, match="no rounds to draw"):
        speculative.draw_timeline([])
    with pytest.raises(ValueError, match=r"round 1: accepted = 3 of 2 drafted tokens; it must be in \[0, 2\]"):
        speculative.draw_timeline([good, Round((1, 2), 3, (1, 2, 3, 4), 0.001, 0.002)])
    with pytest.raises(ValueError, match=r"round 0: emitted \(9, 5\) must be the 1 accepted drafts \(1,\)"):
        speculative.draw_timeline([Round((1, 2), 1, (9, 5), 0.001, 0.002)])
    with pytest.raises(ValueError, match=r"round 0: emitted \(\) must be"):
        speculative.draw_timeline([Round((1, 2), 1, (), 0.001, 0.002)])
    with pytest.raises(ValueError, match="round 0: verify_s = -0.002; a duration is finite and >= 0 seconds"):
        speculative.draw_timeline([Round((1, 2), 1, (1, 5), 0.001, -0.002)])
    with pytest.raises(ValueError, match="took 0 s in all"):
        speculative.draw_timeline([Round((1,), 1, (1, 5), 0.0, 0.0)])
    speculative.draw_timeline([Round((1,), 1, (1, 5), 0.0, 0.0)], time_axis=False)  # fine at equal widths


def test_printable_shows_whitespace_and_control_bytes():
    assert [speculative.printable(tokenizer.decode([t])) for t in (10, 32, 9, 7, 36, 200)] == \
        ["⏎", "␣", "⇥", "07", "$", "\ufffd"]


# ---- the acceptance rule ----------------------------------------------------------------------


def bars(ax):
    """{part: {token: (bottom, height)}} and the token under each x tick, by position."""
    ticks = {round(x): label.get_text() for x, label in zip(ax.get_xticks(), ax.get_xticklabels())}
    parts, at = {}, {}
    for patch in ax.patches:
        part, token = patch.get_gid().split(":")
        token = int(token)
        x = round(patch.get_x() + patch.get_width() / 2)
        at[token] = ticks[x]
        parts.setdefault(part, {})[token] = (patch.get_y(), patch.get_height())
    return parts, at


def check_acceptance(ax, p, q, drafted, top=12, labels=None):
    parts, at = bars(ax)
    tokens = sorted(at)
    by_max = np.lexsort((np.arange(p.size), -np.maximum(p, q)))
    expected = set(by_max[:top].tolist())
    if drafted not in expected:
        expected = set(by_max[:top - 1].tolist()) | {drafted}
    assert set(tokens) == expected
    for t in tokens:
        assert at[t] == (speculative.printable(labels[t]) if labels else show(t))
        assert parts["accepted"][t] == pytest.approx((0, min(p[t], q[t])))
        assert parts["residual"][t] == pytest.approx((min(p[t], q[t]), max(0, p[t] - q[t])))
        assert parts["excess"][t] == pytest.approx((min(p[t], q[t]), max(0, q[t] - p[t])))
    texts = {t.get_gid(): t for t in ax.texts}
    [alpha] = re.findall(r"α = Σ min\(p, q\) = 1 − TV\(p, q\) = ([0-9.]+)", texts["alpha"].get_text())
    assert alpha == f"{1 - 0.5 * np.abs(p - q).sum():.3f}"
    note = texts["drafted"]
    assert f"min(1, p/q) = {min(1, p[drafted] / q[drafted]):.3f}" in note.get_text()
    assert round(note.xy[0]) == [round(x) for x, label in zip(ax.get_xticks(), ax.get_xticklabels())
                                 if label.get_weight() == "bold"][0]  # its arrow points at the bold token
    assert at[drafted] in note.get_text()

    renderer = assert_legible(ax.figure)
    note_box = Text.get_window_extent(note, renderer)
    for patch in ax.patches:  # the note sits above every bar, and the α lines above the axes
        assert not patch.get_window_extent(renderer).overlaps(note_box), patch.get_gid()
    assert texts["alpha"].get_window_extent(renderer).y0 >= ax.get_window_extent(renderer).y1
    assert ax.title.get_window_extent(renderer).y0 >= texts["alpha"].get_window_extent(renderer).y1


@pytest.mark.parametrize("which", ["least alike", "median"])
def test_the_acceptance_chart_of_real_distributions(distributions, which):
    p, q, alphas = distributions
    k = int(np.argsort(alphas)[0 if which == "least alike" else len(alphas) // 2])
    for drafted in (int(q[k].argmax()), int(np.argsort(-q[k])[5])):
        ax = speculative.draw_acceptance(p[k], q[k], drafted)
        check_acceptance(ax, p[k], q[k], drafted)


def test_an_unlikely_draft_takes_the_last_place_and_labels_may_be_given(distributions):
    p, q, _ = distributions
    drafted = int(np.argsort(-q[3])[40])
    labels = [f"tok{t}" for t in range(256)]
    ax = speculative.draw_acceptance(p[3], q[3], drafted, top=8, labels=labels, title="Position 3")
    check_acceptance(ax, p[3], q[3], drafted, top=8, labels=labels)
    assert ax.get_xlabel() == "the 7 tokens most likely under p or q, and the drafted one"
    assert ax.get_title(loc="left") == "Position 3"

    wide = [f"token number {t}" for t in range(256)]  # too wide side by side: they stand on end
    ax = speculative.draw_acceptance(p[3], q[3], drafted, labels=wide)
    assert {label.get_rotation() for label in ax.get_xticklabels()} == {90}
    check_acceptance(ax, p[3], q[3], drafted, labels=wide)

    figure = Figure(figsize=(6.5, 5.5))  # room above for the title and α's lines, wrapped to the axes
    given = figure.add_axes((0.12, 0.28, 0.83, 0.45))
    assert speculative.draw_acceptance(p[3], q[3], drafted, ax=given) is given and figure.axes == [given]
    check_acceptance(given, p[3], q[3], drafted)


def test_bad_distributions_are_refused_by_name():
    p, q = np.full(4, 0.25), np.array([0.5, 0.5, 0.0, 0.0])
    cases = [((p, q[:3], 0), r"one shape \(vocab,\); got \(4,\) and \(3,\)"),
             ((p[None], q[None], 0), r"got \(1, 4\) and \(1, 4\)"),
             ((np.array([0.5, 0.75, -0.25, 0]), q, 0), r"p\[2\] = -0.25; probabilities must be finite and >= 0"),
             ((p, np.array([0.5, 0.5, np.nan, 0]), 0), r"q\[2\] = nan"),
             ((p * 1.01, q, 0), r"p sums to 1.01; a distribution sums to 1 \(within 1e-6\)"),
             ((p, q, 4), r"drafted = 4; it must be a token id in \[0, 4\)"),
             ((p, q, -1), r"drafted = -1"),
             ((p, q, 1.0), r"drafted = 1.0"),
             ((p, q, 2), r"q\[2\] = 0: the drafter cannot have drawn token 2 from q")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            speculative.draw_acceptance(*args)
    with pytest.raises(ValueError, match="top = 0; it must be an integer >= 1"):
        speculative.draw_acceptance(p, q, 0, top=0)
    with pytest.raises(ValueError, match="labels has 3 entries; it needs one per token of the vocabulary, 4"):
        speculative.draw_acceptance(p, q, 0, labels=["a", "b", "c"])
    assert isinstance(speculative.draw_acceptance(p, q, 1).texts[0], Text)  # a tiny vocabulary draws
