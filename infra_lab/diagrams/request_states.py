"""Chapter 05's request state machine: the states of `RequestState` as boxes, the engine's moves
between them as labelled arrows, drawn from the table TRANSITIONS.

A request waits until the scheduler admits it, runs one step at a time (a prefill chunk or one
decode token) until a stop token or max_tokens finishes it, and may lose its KV blocks to others
when the pool runs out: preempted, it comes back by recomputing its tokens or by swapping its
blocks back in from the host (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023, Section 4.5). An abort ends it from any live state.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.path import Path
from matplotlib.textpath import TextPath

from infra_lab.serving.request import RequestState

TRANSITIONS: tuple[tuple[str, str, str], ...] = (  # (from, to, label); states by RequestState value
    ("waiting", "running", "admitted: batch slot, token budget and blocks free"),
    ("running", "running", "a step: prefill chunk or decode"),
    ("running", "preempted", "pool out of blocks: victim = last admitted"),
    ("preempted", "running", "recompute: re-prefilled; or swap: blocks copied back"),
    ("running", "finished", "stop token or max_tokens"),
    ("waiting", "aborted", "abort(request_id)"),
    ("running", "aborted", "abort(request_id)"),
    ("preempted", "aborted", "abort(request_id)"),
)

WIDTH_IN, HEIGHT_IN = 6.5, 3.8  # the axes' data units are inches, y up
BOX_W, BOX_H = 1.0, 0.5
NAME_PT, LABEL_PT = 10.0, 9.0
AT = {"waiting": (0.7, 2.55), "running": (3.1, 2.55), "finished": (5.7, 2.55),  # box centres
      "preempted": (3.1, 0.95), "aborted": (5.7, 0.95)}
STYLE = {"waiting": ("#ececec", "0.45"), "running": ("#fbe3b0", "#c98a00"), "preempted": ("#f8d4d4", "#d62728"),
         "finished": ("#dcebd5", "#4a8a3a"), "aborted": ("#dddddd", "0.25")}  # (face, edge)


class Route(NamedTuple):
    """How one transition is drawn: the arrow's points (inches; a loop when there are two on one
    box), and its label's anchor, alignment and widest line."""

    points: tuple[tuple[float, float], ...]
    label_at: tuple[float, float]
    ha: str
    va: str
    width_in: float


def edge(state: str, side: str, along: float = 0.0) -> tuple[float, float]:
    """A point on the `side` ("left", "right", "top", "bottom") of a state's box, `along` inches
    from the side's middle (rightwards or upwards)."""
    x, y = AT[state]
    return {"left": (x - BOX_W / 2, y + along), "right": (x + BOX_W / 2, y + along),
            "top": (x + along, y + BOX_H / 2), "bottom": (x + along, y - BOX_H / 2)}[side]


ROUTES: dict[tuple[str, str], Route] = {
    ("waiting", "running"): Route((edge("waiting", "right"), edge("running", "left")), (1.9, 2.62), "center",
                                  "bottom", 1.3),
    ("running", "running"): Route((edge("running", "top", -0.25), edge("running", "top", 0.25)), (3.1, 3.27),
                                  "center", "bottom", 3.0),
    ("running", "preempted"): Route((edge("running", "bottom", 0.2), edge("preempted", "top", 0.2)), (3.4, 1.75),
                                    "left", "center", 1.42),
    ("preempted", "running"): Route((edge("preempted", "top", -0.2), edge("running", "bottom", -0.2)), (2.8, 1.75),
                                    "right", "center", 1.8),
    ("running", "finished"): Route((edge("running", "right", 0.1), edge("finished", "left", 0.1)), (4.4, 2.72),
                                   "center", "bottom", 1.4),
    ("waiting", "aborted"): Route((edge("waiting", "bottom"), (0.7, 0.3), (5.7, 0.3), edge("aborted", "bottom")),
                                  (1.9, 0.35), "center", "bottom", 1.6),
    ("running", "aborted"): Route((edge("running", "right", -0.15), (5.0, 2.4), (5.0, 1.05),
                                   edge("aborted", "left", 0.1)), (5.1, 1.72), "left", "center", 1.3),
    ("preempted", "aborted"): Route((edge("preempted", "right", -0.1), edge("aborted", "left", -0.1)),
                                    (4.25, 0.8), "center", "top", 1.3),
}


@functools.lru_cache(maxsize=256)
def text_in(text: str, size_pt: float = LABEL_PT) -> float:
    """Width of `text` in the default font at `size_pt`, in inches."""
    return TextPath((0, 0), text, size=size_pt).get_extents().width / 72 if text.strip() else 0.0


def wrap(label: str, width_in: float, size_pt: float = LABEL_PT) -> str:
    """`label` in lines at most `width_in` wide: a line ends after each "; ", and else where the
    next word would not fit (a single longer word keeps its own line)."""
    lines: list[str] = []
    for clause in label.replace("; ", ";\n").split("\n"):
        lines.append("")
        for word in clause.split(" "):
            if lines[-1] and text_in(f"{lines[-1]} {word}", size_pt) > width_in:
                lines.append(word)
            else:
                lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return "\n".join(lines)


def check(transitions, highlight) -> None:
    states = {s.value for s in RequestState}
    pairs = [(a, b) for a, b, _ in transitions]
    for a, b, label in transitions:
        if a not in states or b not in states:
            raise ValueError(f"transition {a!r} -> {b!r} names a state outside RequestState: {sorted(states)}")
        if (a, b) not in ROUTES:
            raise ValueError(f"no route is laid out for {a} -> {b}; ROUTES has {sorted(ROUTES)}")
        if pairs.count((a, b)) > 1:
            raise ValueError(f"{a} -> {b} appears {pairs.count((a, b))} times; join its labels into one")
    for state, count in (highlight or {}).items():
        if getattr(state, "value", state) not in states or int(count) != count or count < 0:
            raise ValueError(f"highlight maps states of RequestState {sorted(states)} to counts >= 0; "
                             f"got {state!r}: {count!r}")


def draw(highlight: dict[RequestState | str, int] | None = None, title: str | None = None,
         transitions: tuple[tuple[str, str, str], ...] = TRANSITIONS) -> Figure:
    """The state machine: a box per RequestState and an arrow per transition, labelled with it.

    `highlight` writes a count under a state's name (how many requests of a run ended there,
    say). Raises ValueError for a state outside RequestState, a count that is not a whole number
    >= 0, or a transition with no route in ROUTES.
    """
    check(transitions, highlight)
    counts = {getattr(state, "value", state): int(count) for state, count in (highlight or {}).items()}
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_IN)
    ax.set_ylim(0, HEIGHT_IN)
    ax.axis("off")
    ax.text(0.12, HEIGHT_IN - 0.12, title or "A request's states in the engine, and what moves it",
            fontsize=10.5, ha="left", va="top", gid="title")

    for state in RequestState:
        x, y = AT[state.value]
        face, edge_color = STYLE[state.value]
        terminal = state in (RequestState.FINISHED, RequestState.ABORTED)
        ax.add_patch(FancyBboxPatch((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H,
                                    boxstyle="round,pad=0,rounding_size=0.08", facecolor=face, edgecolor=edge_color,
                                    linewidth=2.0 if terminal else 1.2, gid=f"state:{state.value}", zorder=2))
        counted = state.value in counts
        ax.text(x, y + (0.09 if counted else 0), state.value, fontsize=NAME_PT, ha="center", va="center",
                weight="bold", gid=f"name:{state.value}", zorder=3)
        if counted:
            n = counts[state.value]
            ax.text(x, y - 0.12, f"{n} request{'s' if n != 1 else ''}", fontsize=LABEL_PT, ha="center",
                    va="center", color="0.2", gid=f"count:{state.value}", zorder=3)

    x, y = AT["waiting"]
    ax.plot([x], [y + 0.75], marker="o", markersize=7, color="0.2", gid="start")
    ax.add_patch(FancyArrowPatch((x, y + 0.72), edge("waiting", "top"), arrowstyle="-|>", mutation_scale=10,
                                 shrinkA=0, shrinkB=1, color="0.2", linewidth=1.0, gid="arrow:start"))
    ax.text(x + 0.12, y + 0.75, "arrives", fontsize=LABEL_PT, ha="left", va="center", color="0.2",
            gid="label:start")

    for source, target, label in transitions:
        route = ROUTES[source, target]
        if source == target:  # a loop over the box's top
            path = Path([route.points[0], (route.points[0][0], route.points[0][1] + 0.55),
                         (route.points[1][0], route.points[1][1] + 0.55), route.points[1]],
                        [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4])
        else:
            path = Path(route.points)
        ax.add_patch(FancyArrowPatch(path=path, arrowstyle="-|>", mutation_scale=11, color=STYLE[target][1],
                                     linewidth=1.3, gid=f"arrow:{source}->{target}", zorder=1))
        ax.text(*route.label_at, wrap(label, route.width_in), fontsize=LABEL_PT, ha=route.ha, va=route.va,
                linespacing=1.15, gid=f"label:{source}->{target}")
    return figure
