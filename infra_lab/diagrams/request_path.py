"""Chapter 06's sequence diagram: one streamed request's path through the client, the HTTP server
and the engine loop, drawn at the times a real request took (time flows down, in milliseconds).

The client sends its POST; the server checks the body and submits the prompt to the engine loop;
the loop's thread admits it at the next step, computes its prompt, and makes a token per step;
each token crosses back to the server's event loop and leaves as one server-sent event, and the
stream ends with `data: [DONE]`. The gaps between the lanes' times are the overheads of each hop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.figure import Figure

LANES = ("client", "HTTP server", "engine loop")
X = {lane: x for lane, x in zip(LANES, (0.0, 1.0, 2.0))}
PLATE = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"}  # a label over lines stays legible
LABEL_GAP = 0.055  # the least distance between two labels, as a share of the request's time


@dataclass(frozen=True)
class RequestPath:
    """One streamed request's times in seconds, all on one clock (time.perf_counter)."""

    sent_s: float  # the client sent the POST
    submitted_s: float  # the server handed the prompt to the loop (the engine's arrival time)
    admitted_s: float  # the loop's first step with it began
    token_s: tuple[float, ...]  # the engine made each token
    chunk_s: tuple[float, ...]  # the client received each token's event
    done_s: float  # the client read `data: [DONE]`

    def __post_init__(self):
        if not self.token_s or len(self.token_s) != len(self.chunk_s):
            raise ValueError(f"need one client chunk per engine token, at least one; got {len(self.token_s)} tokens "
                             f"and {len(self.chunk_s)} chunks")
        order = [self.sent_s, self.submitted_s, self.admitted_s, self.token_s[0], self.chunk_s[0]]
        if any(b < a for a, b in zip(order, order[1:])) or self.done_s < self.chunk_s[-1]:
            raise ValueError(f"the times must follow the request's path (send, submit, admit, token, chunk, done); "
                             f"got {order + [self.done_s]}")


def messages(path: RequestPath, shown: int = 3) -> list[tuple[str, str, float, float, str]]:
    """The arrows: (from lane, to lane, start s, end s, label), the first `shown` tokens and the last."""
    out = [("client", "HTTP server", path.sent_s, path.submitted_s, "POST /v1/completions"),
           ("HTTP server", "engine loop", path.submitted_s, path.admitted_s, "submit: waits for the next step"),
           ("engine loop", "engine loop", path.admitted_s, path.token_s[0], "prefill: the prompt, token 1")]
    picked = sorted(set(range(min(shown, len(path.token_s)))) | {len(path.token_s) - 1})
    for i in picked:
        out.append(("engine loop", "client", path.token_s[i], path.chunk_s[i], f"token {i + 1}: one event"))
    out.append(("HTTP server", "client", path.chunk_s[-1], path.done_s, "data: [DONE]"))
    return out


def draw(path: RequestPath, shown: int = 3) -> Figure:
    """The sequence diagram of `path` (RequestPath), times in ms after the client's send. Labels
    that would overlap (steps a few ms apart) are moved down until they clear each other, and a
    thin line ties each to its arrow."""
    figure = Figure(figsize=(6.5, 4.6), layout="constrained")
    ax = figure.add_subplot()
    end_ms = 1e3 * (path.done_s - path.sent_s)
    gap_ms = LABEL_GAP * end_ms  # the least vertical distance between two labels
    for lane, x in X.items():
        ax.plot([x, x], [0, end_ms * 1.04], color="0.6", linewidth=1)
        ax.text(x, -0.03 * end_ms, lane, ha="center", va="bottom", fontsize=10, fontweight="bold")
    last_label_ms = -math.inf
    for source, target, start_s, stop_s, label in messages(path, shown):
        y0, y1 = 1e3 * (start_s - path.sent_s), 1e3 * (stop_s - path.sent_s)
        x0, x1 = X[source], X[target]
        if source == target:  # work inside a lane: a bar along it
            ax.plot([x0, x0], [y0, y1], color="#c98a00", linewidth=6, solid_capstyle="butt")
            ax.text(x0 + 0.06, (y0 + y1) / 2, f"{label} ({y1 - y0:.1f} ms)", ha="left", va="center", fontsize=9,
                    bbox=PLATE)
            continue
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "->", "color": "#1f77b4" if x1 > x0 else "#2ca02c"})
        middle = ((x0 + x1) / 2, (y0 + y1) / 2)
        label_ms = max(middle[1], last_label_ms + gap_ms)
        last_label_ms = label_ms
        ax.annotate(f"{label} ({y1 - y0:.1f} ms)", xy=middle, xytext=(middle[0], label_ms), ha="center",
                    va="bottom", fontsize=9, bbox=PLATE,
                    arrowprops={"arrowstyle": "-", "color": "0.7", "linewidth": 0.6} if label_ms > middle[1] else None)
    ax.set_ylim(max(end_ms * 1.06, last_label_ms + gap_ms), -0.08 * end_ms)
    ax.set_xlim(-0.9, 2.9)
    ax.set_xticks([])
    ax.set_ylabel("ms after the client sent the request")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"One streamed request of {len(path.token_s)} tokens, as it happened")
    return figure
