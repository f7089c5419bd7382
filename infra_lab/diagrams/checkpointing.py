"""Chapter 10's picture of activation checkpointing (Chen et al. 2016, "Training deep nets with
sublinear memory cost"): the tensor bytes alive after every operation of one forward and backward
pass, with and without checkpointing, from `parallel.checkpointing.live_bytes_trace`.

Without checkpointing the curve climbs through the forward pass (every block's activations are
kept) and falls as backward frees them; with it the forward pass keeps only the blocks' inputs, and
backward climbs again block by block as it recomputes each one, for more operations in all. Every
line and mark carries a gid naming what it stands for, so the tests read the picture back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from matplotlib.figure import Figure

if TYPE_CHECKING:  # the traces come from torch runs; drawing them needs no torch
    from infra_lab.parallel.checkpointing import Trace

WIDTH_IN, HEIGHT_IN = 6.5, 3.4
FONT_PT = 9
COLORS = {False: "#4c72b0", True: "#dd8452"}
NAMES = {False: "every activation kept", True: "each block checkpointed"}


def _check(traces: dict[bool, Trace]) -> None:
    if set(traces) != {False, True}:
        raise ValueError(f"give the traces without and with checkpointing, keyed False and True; got keys "
                         f"{sorted(traces)}")
    for checkpoint, trace in traces.items():
        if not trace.live_bytes or not 0 < trace.backward_from < len(trace.live_bytes):
            raise ValueError(f"the trace with checkpoint={checkpoint} needs operations on both sides of its "
                             f"backward_from; got {len(trace.live_bytes)} operations and backward_from "
                             f"{trace.backward_from}")


def draw_live_bytes(traces: dict[bool, Trace], title: str | None = None) -> Figure:
    """Live tensor MB against the operation's index, one line per trace; a dotted line where each
    backward pass begins, and a mark at each peak and at the end of each forward pass."""
    _check(traces)
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN))
    ax = figure.add_axes((0.1, 0.15, 0.86, 0.68))
    top = max(max(t.live_bytes) for t in traces.values()) / 1e6
    right = max(len(t.live_bytes) for t in traces.values()) * 1.02
    for checkpoint, trace in traces.items():
        megabytes = [b / 1e6 for b in trace.live_bytes]
        color = COLORS[checkpoint]
        ax.plot(range(len(megabytes)), megabytes, color=color, lw=1.4, label=NAMES[checkpoint],
                gid=f"trace:{checkpoint}")
        ax.axvline(trace.backward_from, color=color, ls=":", lw=1, gid=f"backward:{checkpoint}")
        end = megabytes[trace.backward_from - 1]
        ax.plot([trace.backward_from - 1], [end], "o", color=color, ms=5, gid=f"forward_end:{checkpoint}")
        peak_at = max(range(len(megabytes)), key=megabytes.__getitem__)
        ax.plot([peak_at], [megabytes[peak_at]], "^", color=color, ms=6, gid=f"peak:{checkpoint}")
        on_left = peak_at > 0.6 * right  # the label stays on the axes
        ax.annotate(f"peak {megabytes[peak_at]:.1f} MB", (peak_at, megabytes[peak_at]),
                    xytext=(-8 if on_left else 6, 4), textcoords="offset points", fontsize=FONT_PT,
                    color=color, ha="right" if on_left else "left", gid=f"peak_text:{checkpoint}")
    ax.set_ylim(0, top * 1.18)
    ax.set_xlim(0, right)
    ax.set_xlabel("operation, in the order run (a dotted line: backward begins)", fontsize=FONT_PT)
    ax.set_ylabel("tensors alive (MB)", fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 1.13), ncol=2, fontsize=FONT_PT, frameon=False)
    figure.suptitle(title or "Tensor memory through one training step, with and without checkpointing",
                    fontsize=10.5, y=0.985)
    return figure
