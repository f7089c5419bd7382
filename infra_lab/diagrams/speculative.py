"""Chapter 07's speculative decoding diagrams: a real run round by round, and the rule that
accepts a drafted token, drawn as the overlap of two distributions.

`draw_timeline`: each round of a run (one target forward) on a time axis. The drafter takes one
cheap step per drafted token (a small box each, labelled with the token), then the target runs
one forward over all of them (a wide box); under them is the verdict: the drafts the target kept,
the first it rejected and every one after it (struck through), and the token of its own that each
forward adds, a correction after a rejection or a bonus after a full acceptance.

`draw_acceptance`: one position. A token x drafted from q is kept with probability
min(1, p(x) / q(x)), so the kept mass is min(p, q) and a draft is accepted with probability
α = Σ min(p, q) = 1 − TV(p, q). A rejection redraws from the residual max(0, p − q), renormalized:
it puts back the mass q lacked, so every emitted token is distributed as p (Leviathan, Kalman and
Matias, "Fast Inference from Transformers via Speculative Decoding", ICML 2023, Section 2.3;
Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling", 2023,
Algorithm 2).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.textpath import TextPath
from matplotlib.ticker import FixedLocator, MaxNLocator
from matplotlib.transforms import ScaledTranslation

from infra_lab.diagrams.gantt import legend_columns, text_in
from infra_lab.figures import MAX_WIDTH_IN
from infra_lab.model import tokenizer
from infra_lab.serving.speculative import Round

MAX_ROUNDS = 12  # drawn at most; fewer when γ is large (see rounds_that_fit)
FONT_PT, TOKEN_PT, TITLE_PT = 9.0, 9.5, 10.5
MONO = FontProperties(family="monospace", size=TOKEN_PT)
WIDTH_IN = MAX_WIDTH_IN  # the text column: wider figures are scaled down, and so are their fonts
CELL_PAD_IN = 0.012  # white between neighbouring boxes
CELL_MIN_IN = 0.12  # boxes at equal widths are no narrower: a 9.5-pt token with room to spare
LABEL_ROOM_IN = 0.01  # a token is written in its box if the box is this much wider (within its padding)
ESCAPES = {"\n": "⏎", " ": "␣", "\t": "⇥"}  # whitespace a reader must see; other controls become hex

# Okabe and Ito's colour-blind-safe palette: orange is the drafter, blue the target, bluish green
# kept, vermillion rejected (also struck through or hatched, so no reader depends on the hue)
DRAFTER, TARGET, KEPT, REJECTED = "#e69f00", "#0072b2", "#009e73", "#d55e00"

# ---- the timeline ---------------------------------------------------------------------------------

LANES = ("drafter", "target", "verdict")  # top to bottom
KINDS = ("draft", "verify", "accepted", "rejected", "target", "cut")
LANE_OF = {"draft": 0, "verify": 1, "accepted": 2, "rejected": 2, "target": 2, "cut": 2}
FACE = {"draft": "#f8dfae", "verify": "#bcdcf2", "accepted": "#a9ddc9", "rejected": "#fdeee5",
        "target": TARGET, "cut": "#e6e6e6"}
EDGE = {"draft": DRAFTER, "verify": TARGET, "accepted": KEPT, "rejected": REJECTED, "target": TARGET, "cut": "0.6"}
INK = {"draft": "black", "accepted": "black", "rejected": "#a5571f", "target": "white", "cut": "0.4"}
LEGEND = {"draft": "drafter step (labelled with its token)", "verify": "target forward: checks all drafts at once",
          "accepted": "draft accepted", "rejected": "draft rejected (the first, and all after it)",
          "target": "the target's own token: correction or bonus", "cut": "accepted, but cut at a stop token"}
LANE_FILL = 0.74  # share of a lane's height a box covers
VERIFY_SLOTS, ROUND_GAP = 1.5, 0.1  # equal-width rounds: the target box in drafter steps; white after a round
LEFT_IN, RIGHT_IN, LANE_IN = 0.75, 0.2, 0.34  # the lane labels; a lane's height
LEGEND_BELOW_IN = 0.55  # from the axes' bottom to the legend's top: x tick labels and the axis label


def printable(text: str) -> str:
    """`text` with whitespace shown (newline ⏎, space ␣, tab ⇥) and other control characters as
    two hex digits, so every token is a visible mark of its own."""
    return "".join(ESCAPES.get(c, c if c.isprintable() else f"{ord(c):02x}") for c in text)


@functools.lru_cache(maxsize=4096)
def glyphs_in(text: str, size_pt: float = TOKEN_PT) -> float:
    """Width of `text` in the token font (monospace), in inches: its ink, and never less than its
    characters' advance (0.6 em each), so one-character tokens all need the same room."""
    ink = TextPath((0, 0), text, prop=MONO, size=size_pt).vertices[:, 0] if text.strip() else np.zeros(1)
    return max(float(ink.max() - ink.min()), 0.6 * size_pt * len(text)) / 72


class Cell(NamedTuple):
    kind: str  # one of KINDS
    x0: float  # data units: the time axis's unit, or rounds
    x1: float
    round: int  # index into the rounds drawn
    token: int | None  # None for the target's forward


def check_rounds(rounds: Sequence[Round], time_axis: bool) -> None:
    """Raise a ValueError naming the first round the timeline cannot draw as given."""
    if len(rounds) == 0:
        raise ValueError("no rounds to draw; pass SpeculativeGeneration.rounds of a run that decoded at least "
                         "one token after the prompt")
    for k, r in enumerate(rounds):
        n, kept, out = len(r.drafted), r.accepted, len(r.emitted)
        if not 0 <= kept <= n:
            raise ValueError(f"round {k}: accepted = {kept} of {n} drafted tokens; it must be in [0, {n}]")
        if not 1 <= out <= kept + 1 or tuple(r.emitted[:min(out, kept)]) != tuple(r.drafted[:min(out, kept)]):
            raise ValueError(f"round {k}: emitted {r.emitted} must be the {kept} accepted drafts "
                             f"{tuple(r.drafted[:kept])} then the target's own token, possibly cut short (at "
                             f"least one token)")
        for name in ("draft_s", "verify_s"):
            if not (math.isfinite(getattr(r, name)) and getattr(r, name) >= 0):
                raise ValueError(f"round {k}: {name} = {getattr(r, name)}; a duration is finite and >= 0 seconds")
    if time_axis and sum(r.draft_s + r.verify_s for r in rounds) <= 0:
        raise ValueError("the rounds took 0 s in all; the time axis needs durations (or pass time_axis=False)")


def timeline_cells(rounds: Sequence[Round], time_axis: bool) -> tuple[list[Cell], list[float], float, float]:
    """The boxes of `rounds` in data units, where each round starts, the axis's end, and the scale
    from seconds: with `time_axis` ms (runs up to 5 s) or s, rounds back to back (the bookkeeping
    between forwards is left out); else round k fills [k, k + 1 - ROUND_GAP], right-aligned, so
    every target box sits at the same place in its round.

    A round's drafter time is split evenly among its drafted tokens (a Round keeps the total
    only). Under each drafted token is its verdict; under the target's forward, its own token."""
    total_s = sum(r.draft_s + r.verify_s for r in rounds)
    scale = (1e3 if total_s <= 5 else 1.0) if time_axis else 1.0
    most = max(len(r.drafted) for r in rounds)
    cells, starts, end = [], [], 0.0
    for k, r in enumerate(rounds):
        if time_axis:
            step, verify, start = (r.draft_s * scale / len(r.drafted) if r.drafted else 0.0), r.verify_s * scale, end
        else:
            step = (1 - ROUND_GAP) / (most + VERIFY_SLOTS)
            verify, start = step * VERIFY_SLOTS, k + (most - len(r.drafted)) * step
        starts.append(start if time_axis else k - ROUND_GAP / 2)
        for i, token in enumerate(r.drafted):
            x0, x1 = start + i * step, start + (i + 1) * step
            verdict = "rejected" if i >= r.accepted else "accepted" if i < len(r.emitted) else "cut"
            cells += [Cell("draft", x0, x1, k, int(token)), Cell(verdict, x0, x1, k, int(token))]
        x0 = start + len(r.drafted) * step
        cells.append(Cell("verify", x0, x0 + verify, k, None))
        if len(r.emitted) == r.accepted + 1:
            cells.append(Cell("target", x0, x0 + verify, k, int(r.emitted[-1])))
        end = x0 + verify
    return cells, starts, (max(end, 1e-12) if time_axis else len(rounds) - ROUND_GAP / 2), scale


def rounds_that_fit(rounds: Sequence[Round], plot_w: float) -> int:
    """How many of the first rounds to draw: at most MAX_ROUNDS, and no more than leave each box
    CELL_MIN_IN wide at equal widths (γ = 4: 8 rounds on a 7-inch figure)."""
    slots = max(len(r.drafted) for r in rounds[:MAX_ROUNDS]) + VERIFY_SLOTS
    return max(1, min(len(rounds), MAX_ROUNDS, int((1 - ROUND_GAP) * plot_w / (slots * CELL_MIN_IN))))


def fit(text: str, width_in: float, size_pt: float = TITLE_PT) -> str:
    """`text` broken into lines at most `width_in` wide, where a word would overflow."""
    lines = [""]
    for word in text.split(" "):
        if lines[-1] and text_in(f"{lines[-1]} {word}", size_pt) > width_in:
            lines.append(word)
        else:
            lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return "\n".join(lines)


def timeline_title(rounds: Sequence[Round], shown: int, width_in: float) -> str:
    """What the rounds drawn add up to, and which rounds they are when some are left out (on a
    line of its own when one line would be wider than `width_in`)."""
    drawn = rounds[:shown]
    kept, drafted = sum(r.accepted for r in drawn), sum(len(r.drafted) for r in drawn)
    title = (f"Draft, then verify: {sum(len(r.emitted) for r in drawn)} tokens from {shown} target "
             f"forward{'s' if shown != 1 else ''}, {kept} of {drafted} drafts accepted")
    if len(rounds) > shown:
        which = f"(the first {shown} of {len(rounds)} rounds)"
        title += f"\n{which}" if text_in(f"{title} {which}", TITLE_PT) > width_in else f" {which}"
    return title


def draw_timeline(rounds: Sequence[Round], ax: Axes | None = None,
                  tokens_to_text: Callable[[list[int]], str] | None = None, title: str | None = None,
                  time_axis: bool = True) -> Axes:
    """Draft, verify and accept, round by round, for the first rounds of a run (see rounds_that_fit).

    Lanes, top to bottom: the drafter's steps (a box per drafted token), the target's forward,
    and the verdict (accepted, rejected and struck through, the target's own token, and drafts
    accepted but cut at a stop token). x is the time spent in the drafter and the target (rounds
    back to back; ms for runs up to 5 s; the first forward of each shape carries its warm-up, so
    warm the models up before the run you draw), or with `time_axis=False` an equal slot per
    round. A token is written in its box, by `tokens_to_text` (default: the byte tokenizer's
    decode; whitespace shown as ⏎ ␣ ⇥), where the box is wide enough for it: on a real time axis
    a cheap drafter (prompt lookup) takes slivers too thin for one. Rounds past those that fit
    are left out, and the default title says so; `title=""` draws none. Draws into `ax` when
    given (it needs LEGEND_BELOW_IN plus the legend's rows of room below), else into a new 7-inch
    figure.
    """
    check_rounds(rounds, time_axis)
    decode = tokens_to_text or tokenizer.decode
    made = ax is None
    plot_w = WIDTH_IN - LEFT_IN - RIGHT_IN if made else ax.get_position().width * ax.figure.get_figwidth()
    shown = list(rounds[:rounds_that_fit(rounds, plot_w)])
    cells, starts, x_hi, scale = timeline_cells(shown, time_axis)
    x_lo = 0.0 if time_axis else -ROUND_GAP / 2
    present = [k for k in KINDS if any(c.kind == k for c in cells)]
    title_w = WIDTH_IN - 0.2 if made else plot_w  # from the figure's left edge, or the given axes'
    title = timeline_title(rounds, len(shown), title_w) if title is None else fit(title, title_w)
    if made:
        ncol = legend_columns([LEGEND[k] for k in present], WIDTH_IN - 0.2)
        bottom_in = LEGEND_BELOW_IN + 0.2 * math.ceil(len(present) / ncol) + 0.08
        top_in = 0.12 + 0.2 * (title.count("\n") + 1) if title else 0.12
        height = top_in + LANE_IN * len(LANES) + bottom_in
        figure = Figure(figsize=(WIDTH_IN, height))
        ax = figure.add_axes((LEFT_IN / WIDTH_IN, bottom_in / height, plot_w / WIDTH_IN, LANE_IN * len(LANES) / height))
    figure = ax.figure
    in_per_x = plot_w / (x_hi - x_lo)
    pad = CELL_PAD_IN / in_per_x

    def inset(c: Cell) -> tuple[float, float]:
        p = min(pad, 0.2 * (c.x1 - c.x0))
        return c.x0 + p, c.x1 - p

    label_of = {t: printable(decode([t])) for t in {c.token for c in cells if c.token is not None}}
    handles = []
    for kind in present:
        found = [c for c in cells if c.kind == kind]
        y = LANE_OF[kind]
        lo, hi = y - LANE_FILL / 2, y + LANE_FILL / 2
        polygons = [[(x0, lo), (x1, lo), (x1, hi), (x0, hi)] for x0, x1 in map(inset, found)]
        style = {"facecolor": FACE[kind], "edgecolor": EDGE[kind], "linewidth": 0.8}
        ax.add_collection(PolyCollection(polygons, **{f"{k}s": v for k, v in style.items()}, gid=f"cells:{kind}"),
                          autolim=False)
        handle = Patch(**style)
        if kind == "rejected":  # struck through: it reads as crossed out without its colour
            handle = (handle, Line2D([], [], color=REJECTED, linewidth=1.3))
        handles.append((handle, LEGEND[kind]))
        for c in found if kind != "verify" else ():  # a token where its box holds it
            if (c.x1 - c.x0) * in_per_x - 2 * CELL_PAD_IN >= glyphs_in(label_of[c.token]) + LABEL_ROOM_IN:
                ax.text((c.x0 + c.x1) / 2, y, label_of[c.token], ha="center", va="center", fontproperties=MONO,
                        color=INK[kind], parse_math=False, weight="bold" if kind == "target" else "normal",
                        gid=f"token:{kind}:{c.round}", zorder=3)
    struck = [c for c in cells if c.kind == "rejected"]
    if struck:
        ax.add_collection(LineCollection([[(x0, 2), (x1, 2)] for x0, x1 in map(inset, struck)], colors=REJECTED,
                                         linewidths=1.3, zorder=4, gid="strike"), autolim=False)
    for k in range(1, len(shown)):  # where each round starts: faint, behind the boxes
        ax.axvline(starts[k], color="0.85", linewidth=0.6, zorder=0, gid=f"round:{k}")

    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.tick_params(labelsize=FONT_PT, length=3)
    ax.tick_params(axis="y", length=0)
    if time_axis:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=max(2, int(plot_w / 0.7))))
        ax.set_xlabel(f"time in the drafter and the target ({'ms' if scale == 1e3 else 's'}), rounds back to back",
                      fontsize=FONT_PT + 1)
    else:
        ax.set_xticks([k + (1 - ROUND_GAP) / 2 for k in range(len(shown))], [str(k + 1) for k in range(len(shown))])
        ax.set_xlabel("round: one target forward each", fontsize=FONT_PT + 1)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ncol = legend_columns([label for _, label in handles], WIDTH_IN - 0.2 if made else plot_w + 0.5)
    below = ScaledTranslation(0, -LEGEND_BELOW_IN, figure.dpi_scale_trans)
    ax.legend([h for h, _ in handles], [label for _, label in handles], loc="upper center", bbox_to_anchor=(0.5, 0),
              bbox_transform=ax.transAxes + below, ncol=ncol, fontsize=FONT_PT, frameon=False, handlelength=1.5,
              columnspacing=1.0, handletextpad=0.5, borderaxespad=0)
    ax.set_title(title, fontsize=TITLE_PT, loc="left", x=-(LEFT_IN - 0.1) / plot_w if made else 0)
    return ax


# ---- the acceptance rule --------------------------------------------------------------------------

PARTS = ("accepted", "residual", "excess")  # stacked: min(p, q), then max(0, p - q) or max(0, q - p)
PART_STYLE = {"accepted": {"facecolor": "#7fcdb0", "edgecolor": KEPT},
              "residual": {"facecolor": "#9fd0f0", "edgecolor": TARGET},
              "excess": {"facecolor": "white", "edgecolor": REJECTED, "hatch": "////"}}
PART_LEGEND = {"accepted": "min(p, q): kept if drafted (sums to α)",
               "residual": "max(0, p − q): a rejection redraws from it",
               "excess": "max(0, q − p): the drafter's excess, rejected"}
BAR_W = 0.72
A_LEFT_IN, A_RIGHT_IN, A_ABOVE_IN, A_PLOT_IN = 0.75, 0.2, 0.85, 2.2
TICK_PT = 11.0  # the tokens under the bars: single characters, a size up to read at a glance
BAND_IN = 0.62  # headroom above the tallest bar, for the drafted token's note and its arrow


def check_distributions(p, q, drafted, top, labels) -> tuple[np.ndarray, np.ndarray, int]:
    """p and q as float arrays and drafted as an int, or a ValueError naming what is wrong."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.ndim != 1 or p.shape != q.shape or p.size == 0:
        raise ValueError(f"p and q must be 1-D probability vectors of one shape (vocab,); got {p.shape} and {q.shape}")
    for name, v in (("p", p), ("q", q)):
        if not np.all(np.isfinite(v)) or v.min() < 0:
            bad = int(np.flatnonzero(~np.isfinite(v) | (v < 0))[0])
            raise ValueError(f"{name}[{bad}] = {v[bad]}; probabilities must be finite and >= 0")
        if abs(v.sum() - 1) > 1e-6:
            raise ValueError(f"{name} sums to {v.sum():.9g}; a distribution sums to 1 (within 1e-6)")
    if isinstance(drafted, bool) or not isinstance(drafted, (int, np.integer)) or not 0 <= drafted < p.size:
        raise ValueError(f"drafted = {drafted!r}; it must be a token id in [0, {p.size})")
    if q[drafted] <= 0:
        raise ValueError(f"q[{drafted}] = 0: the drafter cannot have drawn token {drafted} from q")
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or top < 1:
        raise ValueError(f"top = {top!r}; it must be an integer >= 1 (how many tokens to show)")
    if labels is not None and len(labels) != p.size:
        raise ValueError(f"labels has {len(labels)} entries; it needs one per token of the vocabulary, {p.size}")
    return p, q, int(drafted)


def shown_tokens(p: np.ndarray, q: np.ndarray, drafted: int, top: int) -> tuple[np.ndarray, bool]:
    """The `top` tokens most likely under p or q (by max(p, q), ties by id), most likely first,
    and whether the drafted token was not among them and so took the last place."""
    order = np.lexsort((np.arange(p.size), -np.maximum(p, q)))[:top]
    added = drafted not in order
    if added:
        order[-1] = drafted
    return order, added


def draw_acceptance(p, q, drafted: int, ax: Axes | None = None, top: int = 12,
                    labels: Sequence[str] | None = None, title: str | None = None) -> Axes:
    """The acceptance rule at one position: target p and drafter q (vocab,), and the token drafted.

    For the `top` tokens most likely under p or q (see shown_tokens), one stacked bar each:
    min(p, q) at the bottom (the mass kept), then max(0, p − q) (the residual a rejection redraws
    from, renormalized) or max(0, q − p) (the drafter's excess, rejected), with p and q marked as
    lines. Over the axes: α = Σ min(p, q) = 1 − TV(p, q), from the full vectors; the drafted token
    is marked with min(1, p/q), its chance of being kept. Tick labels are the tokens' bytes (shown
    as in draw_timeline) or `labels[token]`. `title=""` draws none. Draws into `ax` when given
    (it needs A_ABOVE_IN of room above for the α lines and the title, and the legend's below),
    else into a new 7-inch figure. Raises ValueError for vectors that are not distributions of one
    shape, a drafted token outside them or of q-probability 0, or a `top` below 1.
    """
    p, q, drafted = check_distributions(p, q, drafted, top, labels)
    tokens, added = shown_tokens(p, q, drafted, int(top))
    names = [printable(labels[t] if labels is not None else tokenizer.decode([t])) for t in tokens]
    alpha, n = float(np.minimum(p, q).sum()), len(tokens)
    made = ax is None
    plot_w = WIDTH_IN - A_LEFT_IN - A_RIGHT_IN if made else ax.get_position().width * ax.figure.get_figwidth()
    widest = max(glyphs_in(s, TICK_PT) for s in names)
    tall = widest > 0.85 * plot_w / n  # labels too wide to sit side by side stand on end
    below_in = (widest + 0.36 if tall else 0.62)  # from the axes' bottom to the legend's top: ticks, axis label
    handles = [Patch(label=PART_LEGEND[k], **PART_STYLE[k]) for k in PARTS] + [
        Line2D([], [], color=TARGET, linewidth=2, label="p: the target"),
        Line2D([], [], color=DRAFTER, linewidth=2, linestyle=(0, (2, 1)), label="q: the drafter")]
    ncol = legend_columns([h.get_label() for h in handles], WIDTH_IN - 0.2 if made else plot_w + 0.5)
    if made:
        bottom_in = below_in + 0.2 * math.ceil(len(handles) / ncol) + 0.08
        height = A_ABOVE_IN + A_PLOT_IN + bottom_in
        figure = Figure(figsize=(WIDTH_IN, height))
        ax = figure.add_axes((A_LEFT_IN / WIDTH_IN, bottom_in / height, plot_w / WIDTH_IN, A_PLOT_IN / height))
    figure = ax.figure
    plot_h = ax.get_position().height * figure.get_figheight()
    left_in = A_LEFT_IN - 0.1 if made else 0.0  # text above the axes starts here, left of the axes

    x = np.arange(n, dtype=float)
    low = np.minimum(p, q)[tokens]
    parts = {"accepted": (np.zeros(n), low), "residual": (low, np.maximum(p - q, 0)[tokens]),
             "excess": (low, np.maximum(q - p, 0)[tokens])}
    for kind in PARTS:
        bottom, height = parts[kind]
        bars = ax.bar(x, height, BAR_W, bottom=bottom, linewidth=0.8, zorder=2, **PART_STYLE[kind])
        for bar, t in zip(bars, tokens):
            bar.set_gid(f"{kind}:{t}")
    for name, v, color, dash in (("p", p, TARGET, "solid"), ("q", q, DRAFTER, (0, (2, 1)))):
        levels = [[(k - BAR_W / 2, v[t]), (k + BAR_W / 2, v[t])] for k, t in enumerate(tokens)]
        ax.add_collection(LineCollection(levels, colors=color, linewidths=2, linestyles=dash, zorder=3,
                                         gid=f"level:{name}"))

    peak = float(np.maximum(p, q)[tokens].max())
    y_hi = peak * plot_h / (plot_h - BAND_IN)  # the band above the tallest bar holds the drafted token's note
    x_lo, x_hi = -0.6, n - 0.4
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(0, y_hi)
    at = int(np.flatnonzero(tokens == drafted)[0])
    kept = min(1.0, p[drafted] / q[drafted])
    note = (f"drafted ‘{names[at]}’: p = {p[drafted]:.3g}, q = {q[drafted]:.3g}\n"
            f"kept with probability min(1, p/q) = {kept:.3f}")
    note_w = max(text_in(line) for line in note.split("\n")) + 0.1
    in_per_x = plot_w / (x_hi - x_lo)
    bar_in = (at - x_lo) * in_per_x
    centre_in = min(max(bar_in, note_w / 2), plot_w - note_w / 2)  # over its bar, inside the axes
    ax.annotate(note, xy=(at, max(p[drafted], q[drafted])), xytext=(x_lo + centre_in / in_per_x, y_hi),
                ha="center", va="top", fontsize=FONT_PT, parse_math=False, gid="drafted",
                arrowprops={"arrowstyle": "-|>", "color": "0.25", "linewidth": 1.0, "shrinkA": 2, "shrinkB": 2,
                            "relpos": ((bar_in - centre_in) / note_w + 0.5, 0)})

    ax.set_xticks(x, names)
    for k, label in enumerate(ax.get_xticklabels()):
        label.set_fontproperties(MONO)
        label.set_fontsize(TICK_PT)
        label.set_parse_math(False)
        label.set_rotation(90 if tall else 0)
        label.set_weight("bold" if k == at else "normal")
    ax.tick_params(labelsize=FONT_PT, length=3)
    most = f"the {n - 1} tokens most likely under p or q, and the drafted one" if added else \
        f"the {n} tokens most likely under p or q"
    ax.set_xlabel(most, fontsize=FONT_PT + 1)
    ax.set_ylabel("probability", fontsize=FONT_PT + 1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.yaxis.set_major_locator(FixedLocator([y for y in MaxNLocator(nbins=5).tick_values(0, peak)
                                             if y <= peak * 1.001]))  # no tick in the band
    lines = (f"α = Σ min(p, q) = 1 − TV(p, q) = {alpha:.3f} over all {p.size} tokens (the {n} shown hold "
             f"{p[tokens].sum():.0%} of p, {q[tokens].sum():.0%} of q)",
             "A rejection redraws from max(0, p − q) / (1 − α), so every token comes out distributed as p")
    statement = "\n".join(fit(line, left_in + plot_w, FONT_PT) for line in lines)
    ax.text(0, 1, statement, ha="left", va="bottom", fontsize=FONT_PT, parse_math=False,
                         linespacing=1.3, gid="alpha",
                         transform=ax.transAxes + ScaledTranslation(-left_in, 0.08, figure.dpi_scale_trans))
    below = ScaledTranslation(0, -below_in, figure.dpi_scale_trans)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=ax.transAxes + below,
              ncol=ncol, fontsize=FONT_PT, frameon=False, handlelength=1.6, columnspacing=1.0, handletextpad=0.5,
              borderaxespad=0)
    title = "Accepting a draft: the target p, the drafter q, and their overlap" if title is None else title
    ax.set_title(fit(title, left_in + plot_w), fontsize=TITLE_PT, loc="left", x=-left_in / plot_w,
                 pad=0.08 * 72 + (statement.count("\n") + 1) * FONT_PT * 1.3 * 1.2 + 6)  # over the α lines
    return ax
