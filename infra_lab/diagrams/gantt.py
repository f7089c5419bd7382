"""Chapter 05's Gantt chart: what each request did in each step of a run, drawn from the engine's
step log.

One row per request, one column per step (or the step's span on the clock). A cell is a prefill
chunk (darker for more tokens, and labelled with them where every chunk's cell is wide enough),
a decode, a slot held without computing (static batching: a finished member waits for its whole
batch), or waiting (after arrival or a preemption, before its next step). Marks on top show a
preemption (a cross: its blocks were freed and it will recompute; a down triangle: swapped out
to the host) and a swap back in. Static batching draws hatched staircases; iteration-level
scheduling fills a freed slot at the next step (Yu et al., "Orca", OSDI 2022), and chunked
prefill spreads a long prompt over steps beside decodes (Agrawal et al., "Sarathi-Serve",
OSDI 2024).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.ticker import FuncFormatter, Locator, MaxNLocator
from matplotlib.transforms import ScaledTranslation

from infra_lab.serving.steplog import KINDS, StepRecord

MAX_REQUESTS, MAX_STEPS = 64, 1000  # beyond these a row or a column is too thin to read
FILLS = ("prefill", "decode", "held", "waiting")  # what a cell is filled with: one per request and step
MARKS = ("preempted", "swapped out", "swapped in")  # drawn on top of the cell
FONT_PT = 9.0
WIDTH_IN, RIGHT_IN, TOP_IN = 6.5, 0.25, 0.4  # RIGHT_IN: room for half the last tick label
PLOT_MAX_IN, ROW_MAX_IN = 5.6, 0.28  # the rows' area, and one row, at most
ROW_FILL = 0.78  # share of a row's height a cell covers
TICK_IN = 0.7  # about one x tick per this much of the axis
LEGEND_BELOW_IN = 0.6  # from the axes' bottom to the legend's top: the x tick labels and the axis label
LABEL_ROW_PT = 11.5  # a row this tall or taller takes a 9-pt label in its cells
HELD_FACE = "0.85"  # under the hatch: a held cell reads gray even where it is too thin to hatch
COLORS = {"decode": "#e69f00", "held": "0.35", "waiting": "#ececec", "preempted": "#d62728",
          "swapped out": "#7b3294", "swapped in": "#7b3294"}
MARKERS = {"preempted": "x", "swapped out": "v", "swapped in": "^"}
PREFILL_SHADES = (0.35, 0.9)  # of the Blues colormap: a 1-token chunk, the log's largest chunk
LEGEND = {"prefill": "prefill (darker: more tokens)", "prefill labelled": "prefill (number: its tokens)",
          "decode": "decode", "held": "holds a slot, idle", "waiting": "waiting",
          "preempted": "preempted (recompute)", "swapped out": "swapped out", "swapped in": "swapped in"}


class Cell(NamedTuple):
    step: int  # the record's index
    kind: str  # one of FILLS or MARKS
    n_tokens: int = 0  # of a prefill chunk or a decode; 0 otherwise


def check(log: list[StepRecord]) -> None:
    """Raise a ValueError naming the first record the chart could not draw unambiguously."""
    if not log:
        raise ValueError("the step log is empty; the chart needs at least one step")
    for before, record in zip(log, log[1:]):
        if record.index <= before.index:
            raise ValueError(f"step indices must increase along the log; step {record.index} follows {before.index}")
    for record in log:
        ids = [w.request_id for w in record.work]
        if len(set(ids)) != len(ids):
            raise ValueError(f"step {record.index} lists request ids {ids}: a request works at most once a step")
        if set(ids) & set(record.held):
            raise ValueError(f"step {record.index}: requests {sorted(set(ids) & set(record.held))} both work "
                             "and hold an idle slot")
        for w in record.work:
            if w.kind not in KINDS or w.n_tokens < 1:
                raise ValueError(f"step {record.index}: request {w.request_id} did {w.kind!r} of {w.n_tokens} "
                                 f"tokens; a work item is one of {KINDS} of at least 1 token")
        if record.end_s < record.start_s:
            raise ValueError(f"step {record.index} ends at {record.end_s} s, before it starts at {record.start_s} s")


def request_rows(log: list[StepRecord], arrivals: dict[int, float] | None = None) -> dict[int, list[Cell]]:
    """{request id: its cells in log order}, for every request the log (or `arrivals`) names, by id.

    Each step gives a request at most one fill: its work, else "held", else "waiting" if it is
    preempted in the step, or if it waits: from its arrival (arrivals[id] < the step's end, before
    the log first names it) or a preemption until it works, holds a slot, is swapped in or
    finishes. Then its marks, in MARKS order. Without `arrivals` a row starts at the request's
    first appearance in the log.
    """
    check(log)
    arrivals = arrivals or {}
    named = set(arrivals)
    for record in log:
        named.update(w.request_id for w in record.work)
        named.update(record.preempted + record.swapped_out + record.swapped_in + record.finished + record.held)
    rows: dict[int, list[Cell]] = {r: [] for r in sorted(named)}
    state: dict[int, str] = {}  # waiting, running or done; absent before it arrives or first appears
    waiting: set[int] = set()
    arriving = sorted(arrivals, key=arrivals.__getitem__)
    arrived = 0
    for record in log:
        while arrived < len(arriving) and arrivals[arriving[arrived]] < record.end_s:
            r = arriving[arrived]
            arrived += 1
            if r not in state:
                state[r] = "waiting"
                waiting.add(r)
        work = {w.request_id: w for w in record.work}
        held, finished, swapped_in = set(record.held), set(record.finished), set(record.swapped_in)
        out = set(record.preempted) | set(record.swapped_out)
        marks = (("preempted", set(record.preempted) - set(record.swapped_out)),
                 ("swapped out", set(record.swapped_out)), ("swapped in", swapped_in))  # in MARKS order
        marked = out | swapped_in
        for r in sorted(waiting | work.keys() | marked | finished | held):
            cells = rows[r]
            if r in work:
                cells.append(Cell(record.index, work[r].kind, work[r].n_tokens))
            elif r in held:
                cells.append(Cell(record.index, "held"))
            elif r in waiting or r in out:
                cells.append(Cell(record.index, "waiting"))
            if r in marked:
                cells.extend(Cell(record.index, kind) for kind, ids in marks if r in ids)
            if r in finished:
                state[r] = "done"
            elif r in out:
                state[r] = "waiting"
            elif r in work or r in held or r in swapped_in:
                state[r] = "running"
            if state.get(r) == "waiting":
                waiting.add(r)
            else:
                waiting.discard(r)
    return rows


@functools.lru_cache(maxsize=1024)
def text_in(text: str, size_pt: float = FONT_PT) -> float:
    """Width of `text` in the default font at `size_pt`, in inches (from its outline's points: a
    hair wide, never narrow)."""
    if not text.strip():
        return 0.0
    x = TextPath((0, 0), text, size=size_pt).vertices[:, 0]
    return float(x.max() - x.min()) / 72


def time_scale(log: list[StepRecord]) -> tuple[float, str]:
    """(factor from seconds, unit) for the time axis: ms for runs up to 5 s, else s."""
    return (1e3, "ms") if log[-1].end_s - log[0].start_s <= 5.0 else (1.0, "s")


def legend_columns(labels: list[str], room_in: float) -> int:
    """The most columns whose entries (filled column by column, as matplotlib does) fit `room_in`."""
    for ncol in range(len(labels), 1, -1):
        sizes = [len(labels) // ncol + (k < len(labels) % ncol) for k in range(ncol)]
        starts = np.cumsum([0] + sizes)
        columns = [labels[a:b] for a, b in zip(starts, starts[1:]) if b > a]
        width = sum(max(text_in(t) for t in c) + 0.42 for c in columns) + 0.1  # handles, pads, spacing
        if width <= room_in:
            return ncol
    return 1


class RowLocator(Locator):
    """Ticks on every stride-th of n rows, the stride chosen when drawn so 9-pt labels keep apart."""

    def __init__(self, n: int):
        self.n = n

    @staticmethod
    def rows(n: int, row_in: float) -> list[int]:
        return list(range(0, n, math.ceil(FONT_PT * 1.25 / (row_in * 72))))

    def __call__(self) -> list[int]:
        axes = self.axis.axes
        return self.rows(self.n, max(axes.bbox.height / axes.figure.dpi / self.n, 1e-3))

    def tick_values(self, vmin, vmax) -> list[int]:
        return self()


class SpacedLocator(MaxNLocator):
    """MaxNLocator's round numbers, about one per TICK_IN of the axis as drawn."""

    def __call__(self):
        axes = self.axis.axes
        self.set_params(nbins=max(2, int(axes.bbox.width / axes.figure.dpi / TICK_IN)))
        return super().__call__()


def labelled(prefills: list, row_pt: float, in_per_x: float) -> bool:
    """Whether every prefill cell (x0, x1, row, n_tokens, step) takes its token count as a 9-pt label;
    the chart labels all of them or none, so that a number always means the same thing."""
    return bool(prefills) and row_pt >= LABEL_ROW_PT and all(
        (x1 - x0) * in_per_x >= text_in(str(n)) + 0.04 for x0, x1, _, n, _ in prefills)


def draw(log: list[StepRecord], request_ids: list[int] | None = None, ax: Axes | None = None,
         title: str | None = None, time_axis: bool = False,
         arrivals: dict[int, float] | None = None) -> Figure:
    """The chart of `log` for `request_ids` (default: every request it names), top to bottom.

    x is the step index, or with `time_axis` each step's start_s..end_s (ms for runs up to 5 s,
    else s). `title=""` draws none; `arrivals` ({id: arrival_s}) adds waiting cells before a
    request's first step. Draws into `ax` when given, else into a new 6.5-inch figure sized to the rows.
    Raises ValueError for more than MAX_REQUESTS rows or MAX_STEPS steps. A given `ax` needs
    LEGEND_BELOW_IN plus the legend's rows of room below it.
    """
    rows = request_rows(log, arrivals)
    ids = list(rows) if request_ids is None else [int(r) for r in request_ids]
    if not rows:
        raise ValueError(f"the log's {len(log)} steps name no request, and no arrivals are given: nothing to draw")
    unknown = [r for r in ids if r not in rows]
    if unknown or not ids or len(set(ids)) != len(ids):
        known = f"{list(rows)[:8]}{' ...' if len(rows) > 8 else ''}"
        raise ValueError(f"requests {unknown} are not in the log or arrivals, which name {known}" if unknown else
                         f"request_ids {ids} must name at least one request, each once")
    if len(ids) > MAX_REQUESTS or len(log) > MAX_STEPS:
        raise ValueError(f"the Gantt chart draws at most {MAX_REQUESTS} requests and {MAX_STEPS} steps legibly; "
                         f"got {len(ids)} requests and {len(log)} steps: pass fewer request_ids or a slice of "
                         "the log")
    if time_axis:
        for before, record in zip(log, log[1:]):
            if record.start_s < before.end_s:
                raise ValueError(f"step {record.index} starts at {record.start_s} s, before step {before.index} "
                                 f"ends at {before.end_s} s; the time axis needs steps one after another")

    made = ax is None
    if made:  # a figure sized to the rows: left for the row labels, below for the legend
        row_in = min(ROW_MAX_IN, PLOT_MAX_IN / len(ids))
        left_in = max(text_in(str(ids[k])) for k in RowLocator.rows(len(ids), row_in)) + 0.5
        present = [k for k in FILLS + MARKS if any(c.kind == k for r in ids for c in rows[r])]
        ncol = legend_columns([LEGEND[k] for k in present], WIDTH_IN - 0.2)
        bottom_in = LEGEND_BELOW_IN + 0.21 * math.ceil(len(present) / ncol) + 0.1
        height = TOP_IN + row_in * len(ids) + bottom_in
        figure = Figure(figsize=(WIDTH_IN, height))
        ax = figure.add_axes((left_in / WIDTH_IN, bottom_in / height, (WIDTH_IN - left_in - RIGHT_IN) / WIDTH_IN,
                              row_in * len(ids) / height))
    figure = ax.figure
    box = ax.get_position()
    plot_w = box.width * figure.get_figwidth()
    row_in = box.height * figure.get_figheight() / len(ids)

    scale, unit = time_scale(log) if time_axis else (1.0, "")
    if time_axis:  # from the first step's start: a wall clock's absolute reading means nothing here
        t0 = log[0].start_s
        spans = {r.index: ((r.start_s - t0) * scale, (r.end_s - t0) * scale) for r in log}
        x_lo, x_hi = 0.0, max((log[-1].end_s - t0) * scale, 1e-6)
    else:
        gap = 0.06 if plot_w / (log[-1].index - log[0].index + 1) >= 0.05 else 0.0  # white between columns
        spans = {r.index: (r.index - 0.5 + gap, r.index + 0.5 - gap) for r in log}
        x_lo, x_hi = log[0].index - 0.5, log[-1].index + 0.5
    in_per_x = plot_w / max(x_hi - x_lo, 1e-12)

    largest = max((c.n_tokens for r in ids for c in rows[r] if c.kind == "prefill"), default=1)
    blues = colormaps["Blues"]

    def shade(n_tokens):  # an int or an array of them
        low, high = PREFILL_SHADES
        return low + (high - low) * (n_tokens - 1) / max(largest - 1, 1)

    cells: dict[str, list] = {k: [] for k in FILLS}  # kind -> [(x0, x1, row, n_tokens, step)]
    marks: dict[str, list] = {k: [] for k in MARKS}  # kind -> [(x, row)]
    for row, r in enumerate(ids):
        for c in rows[r]:
            x0, x1 = spans[c.step]
            if c.kind in cells:
                cells[c.kind].append((x0, x1, row, c.n_tokens, c.step))
            else:
                marks[c.kind].append(((x0 + x1) / 2, row))

    handles = []
    for kind, found in cells.items():
        if not found:
            continue
        x0, x1, y, n, _ = (np.array(v, dtype=float) for v in zip(*found))
        low, high = y - ROW_FILL / 2, y + ROW_FILL / 2
        corners = np.stack([np.stack([x0, low]), np.stack([x1, low]), np.stack([x1, high]),
                            np.stack([x0, high])]).transpose(2, 0, 1)  # (cells, 4, xy)
        if kind == "held":  # one compound path: Agg hatches it once, not once per cell
            closed = np.concatenate([corners, corners[:, :1]], axis=1).reshape(-1, 2)
            codes = np.tile([Path.MOVETO] + [Path.LINETO] * 3 + [Path.CLOSEPOLY], len(found))
            style = {"facecolor": HELD_FACE, "edgecolor": COLORS["held"], "hatch": "////"}
            ax.add_collection(PathCollection([Path(closed, codes)], facecolors=HELD_FACE, edgecolors=COLORS["held"],
                                             hatch="////", linewidths=0, gid=f"cells:{kind}"), autolim=False)
        else:
            face = blues(shade(n)) if kind == "prefill" else COLORS[kind]
            ax.add_collection(PolyCollection(corners, facecolors=face, linewidths=0, gid=f"cells:{kind}"),
                              autolim=False)
            style = {"facecolor": blues(np.mean(PREFILL_SHADES)) if kind == "prefill" else face,
                     "edgecolor": "0.7" if kind == "waiting" else "none", "linewidth": 0.5}
        handles.append(Patch(label=LEGEND[kind], **style))

    row_pt = row_in * 72
    if labelled(cells["prefill"], row_pt, in_per_x):
        handles[0].set_label(LEGEND["prefill labelled"])
        for x0, x1, row, n, step in cells["prefill"]:
            ax.text((x0 + x1) / 2, row, str(n), ha="center", va="center", fontsize=FONT_PT,
                    color="white" if shade(n) > 0.6 else "black", gid=f"tokens:{ids[row]}:{step}")

    size = max(3.0, min(row_pt * ROW_FILL * 0.9, 8.0))
    for kind, found in marks.items():
        if not found:
            continue
        x, y = np.array(found, dtype=float).T
        ax.scatter(x, y, s=size ** 2, marker=MARKERS[kind], c=COLORS[kind], linewidths=1.6 if kind == "preempted"
                   else 0.5, edgecolors="white" if kind != "preempted" else None, zorder=3, gid=f"marks:{kind}")
        handles.append(Line2D([], [], marker=MARKERS[kind], color=COLORS[kind], linestyle="none", markersize=7,
                              markeredgewidth=1.6 if kind == "preempted" else 0.5, label=LEGEND[kind]))

    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(len(ids) - 0.5, -0.5)
    ax.yaxis.set_major_locator(RowLocator(len(ids)))  # both decide when drawn, at the axes' final size
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: str(ids[round(y)]) if 0 <= round(y) < len(ids) else ""))
    ax.xaxis.set_major_locator(SpacedLocator(integer=not time_axis))
    ax.xaxis.get_major_formatter().set_useOffset(False)
    ax.tick_params(labelsize=FONT_PT, length=3)
    since = "" if log[0].start_s == 0 else f" from step {log[0].index}'s start"
    ax.set_xlabel(f"time ({unit}){since}" if time_axis else "step", fontsize=10)
    ax.set_ylabel("request", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.spines["left"].set_position(("outward", 3))  # off the first column, which may be a hair wide
    room_in = WIDTH_IN - 0.2 if made else plot_w + 0.5  # a given axes may have neighbours: little overhang
    ncol = legend_columns([h.get_label() for h in handles], room_in)
    below = ScaledTranslation(0, -LEGEND_BELOW_IN, figure.dpi_scale_trans)  # under tick and axis labels
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=ax.transAxes + below,
              ncol=ncol, fontsize=FONT_PT, frameon=False, handlelength=1.5, columnspacing=1.0,
              handletextpad=0.5, borderaxespad=0)
    default = f"What {len(ids)} requests did in each of {len(log)} steps"
    ax.set_title(default if title is None else title, fontsize=10.5, loc="left")  # "" for none
    return figure
