"""Chapter 09's diagrams of a mixture of experts, drawn from live objects of `infra_lab.moe`.

- `draw_routing`: a real batch's tokens (rows) against the experts (columns), each chosen cell
  shaded by its gate weight and crossed where the expert's capacity was full, with each
  expert's load beside the capacity line.
- `draw_permutation`: the sort that dispatch makes. Assignments in token order on the left, the
  same assignments grouped by expert on the right (each expert's run is one dense block of rows
  for its GEMM), and an arrow per assignment: the inverse permutation, slot_of, read backwards.
- `draw_all_to_all`: an expert-parallel exchange from its send counts: each rank's send buffer,
  cut into one segment per destination rank, and the receive buffers they land in.

Every box carries a gid naming what it stands for, so the tests read the picture back.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

from infra_lab.moe.dispatch import Dispatch
from infra_lab.moe.routing import Routing

EXPERT_COLORS = plt.get_cmap("tab10").colors  # expert e (and rank r) is drawn in colour e % 10
MAX_TOKENS = 32  # rows of the routing grid; more would shrink a row below its 9-pt label
MAX_ASSIGNMENTS = 40  # boxes per column of the permutation


def _label(token: int) -> str:
    """A byte as the reader would write it: printable, or its escape."""
    text = bytes([token]).decode("latin-1")
    return text if text.isprintable() and text != " " else repr(text)[1:-1] if text != " " else "␣"


def draw_routing(routing: Routing, tokens: np.ndarray, slots: int | None = None,
                 title: str | None = None) -> plt.Figure:
    """Tokens (T,) byte values routed by `routing` (T, k): one row per token, one column per
    expert; a chosen cell is shaded by its gate weight and holds its rank of choice (1 = first),
    a dropped one is crossed. Right: the assignments each expert received, against `slots`."""
    n_tokens, k = routing.experts.shape
    n_experts = routing.probs.shape[1]
    if n_tokens > MAX_TOKENS or len(tokens) != n_tokens:
        raise ValueError(f"draw at most {MAX_TOKENS} tokens, one byte per routing row; got {len(tokens)} bytes "
                         f"for {n_tokens} rows")
    fig, (grid, bars) = plt.subplots(1, 2, figsize=(6.5, 0.22 * n_tokens + 1.4), width_ratios=[3, 2],
                                     layout="constrained")
    for t in range(n_tokens):
        for j in range(k):
            e, weight = int(routing.experts[t, j]), float(routing.weights[t, j])
            cell = Rectangle((e, t), 1, 1, facecolor=EXPERT_COLORS[e % 10], alpha=0.25 + 0.75 * weight,
                             edgecolor="white", gid=f"choice:{t}:{e}:{j}")
            grid.add_patch(cell)
            kept = bool(routing.kept[t, j])
            grid.text(e + 0.5, t + 0.5, str(j + 1) if kept else "×", ha="center", va="center", fontsize=9,
                      color="black" if kept else "darkred", gid=f"mark:{t}:{e}:{'kept' if kept else 'dropped'}")
    grid.set(xlim=(0, n_experts), ylim=(n_tokens, 0), xlabel="expert", ylabel="byte",
             title=title or "tokens routed to experts")
    grid.set_xticks(np.arange(n_experts) + 0.5, [str(e) for e in range(n_experts)])
    grid.set_yticks(np.arange(n_tokens) + 0.5, [_label(int(b)) for b in tokens], fontsize=9, family="monospace")
    grid.tick_params(length=0)
    received = np.bincount(routing.experts.reshape(-1), minlength=n_experts)
    kept_counts = np.bincount(routing.experts[routing.kept], minlength=n_experts)
    for e in range(n_experts):
        bars.barh(e, received[e], color="white", edgecolor=EXPERT_COLORS[e % 10], gid=f"received:{e}")
        bars.barh(e, kept_counts[e], color=EXPERT_COLORS[e % 10], gid=f"kept:{e}")
    if slots is not None:
        bars.axvline(slots, color="black", ls="--", lw=1, label=f"capacity {slots}")
    bars.axvline(n_tokens * k / n_experts, color="grey", ls=":", lw=1, label="mean")
    bars.legend(fontsize=9, loc="lower right")
    bars.set(yticks=range(n_experts), ylim=(n_experts - 0.5, -0.5), xlabel="assignments (outline: received)",
             ylabel="expert", title="load per expert")
    return fig


def draw_permutation(dispatch: Dispatch, title: str | None = None) -> plt.Figure:
    """Left, the kept assignments (t, j) in token order; right, the sorted rows, expert by
    expert; an arrow from each assignment to its row slot_of[t, j]. Dropped ones stay grey."""
    n_tokens, k = dispatch.slot_of.shape
    total = n_tokens * k
    if total > MAX_ASSIGNMENTS:
        raise ValueError(f"draw at most {MAX_ASSIGNMENTS} assignments; got {n_tokens} tokens x {k}")
    experts = np.full(total, -1)
    rows = np.searchsorted(dispatch.offsets, np.arange(len(dispatch.tokens)), side="right") - 1  # row -> expert
    flat_slots = dispatch.slot_of.reshape(-1)
    experts[flat_slots >= 0] = rows[flat_slots[flat_slots >= 0]]
    fig, ax = plt.subplots(figsize=(6.5, 0.2 * total + 1.0), layout="constrained")
    left, right, width = 0.0, 4.0, 1.3
    for a in range(total):
        t, j = divmod(a, k)
        e = int(experts[a])
        face = EXPERT_COLORS[e % 10] if e >= 0 else "#e0e0e0"
        ax.add_patch(Rectangle((left, a), width, 0.9, facecolor=face, alpha=0.6, gid=f"assignment:{t}:{j}"))
        ax.text(left + width / 2, a + 0.45, f"t{t}·{j + 1}" + ("" if e >= 0 else " ×"), ha="center",
                va="center", fontsize=9)
        if e >= 0:
            row = int(flat_slots[a])
            ax.add_patch(FancyArrowPatch((left + width, a + 0.45), (right, row + 0.45), arrowstyle="-|>",
                                         mutation_scale=7, lw=0.6, color="grey", gid=f"arrow:{t}:{j}:{row}"))
    for row, token in enumerate(dispatch.tokens):
        e = int(rows[row])
        ax.add_patch(Rectangle((right, row), width, 0.9, facecolor=EXPERT_COLORS[e % 10], alpha=0.6,
                               gid=f"row:{row}:{int(token)}:{e}"))
        ax.text(right + width / 2, row + 0.45, f"row {row}: t{int(token)}", ha="center", va="center", fontsize=9)
    for e in range(len(dispatch.offsets) - 1):
        start, end = int(dispatch.offsets[e]), int(dispatch.offsets[e + 1])
        if end > start:
            rows_text = f"{end - start} row{'s' if end - start != 1 else ''}"
            ax.text(right + width + 0.15, (start + end) / 2, f"expert {e}: {rows_text}", va="center",
                    fontsize=9, color=EXPERT_COLORS[e % 10])
    ax.text(left + width / 2, -0.6, "token order", ha="center", fontsize=9, weight="bold")
    ax.text(right + width / 2, -0.6, "sorted by expert", ha="center", fontsize=9, weight="bold")
    ax.set(xlim=(-0.2, right + width + 2.4), ylim=(total + 0.2, -1.2), title=title or "dispatch: a stable sort")
    ax.axis("off")
    return fig


def _light(color, amount: float = 0.55) -> tuple:
    return tuple(amount * 1.0 + (1 - amount) * c for c in color)


def draw_all_to_all(send_counts: np.ndarray, bytes_per_row: int, title: str | None = None) -> plt.Figure:
    """send_counts (R, R): rows rank r sends rank s. Left, each rank's send buffer, in its own
    colour, cut into one segment per destination; right, each rank's receive buffer, one segment
    per source in the source's colour; a line joins each segment to where it lands. Widths are
    to scale."""
    send_counts = np.asarray(send_counts, np.int64)
    world = send_counts.shape[0] if send_counts.ndim == 2 else 0
    if send_counts.shape != (world, world) or world < 1 or (send_counts < 0).any():
        raise ValueError(f"send counts must be a square (ranks, ranks) array of counts >= 0; got {send_counts.shape}")
    fig, ax = plt.subplots(figsize=(6.5, 0.9 + 0.75 * world), layout="constrained")
    scale = 1.0 / max(send_counts.sum(1).max(), send_counts.sum(0).max(), 1)
    send_x, receive_x, height = 0.0, 1.9, 0.55
    for r in range(world):
        ax.text(send_x - 0.04, r + height / 2, f"rank {r} sends", ha="right", va="center", fontsize=9)
        ax.text(receive_x + 1.04, r + height / 2, f"rank {r} gets", ha="left", va="center", fontsize=9)
    for r in range(world):
        for s in range(world):
            rows = int(send_counts[r, s])
            if not rows:
                continue
            width = rows * scale
            send_at = send_x + send_counts[r, :s].sum() * scale
            receive_at = receive_x + send_counts[:r, s].sum() * scale
            color = _light(EXPERT_COLORS[r % 10])
            ax.add_patch(Rectangle((send_at, r), width, height, facecolor=color, edgecolor="black", lw=0.6,
                                   zorder=2, gid=f"send:{r}:{s}:{rows}"))
            ax.add_patch(Rectangle((receive_at, s), width, height, facecolor=color, edgecolor="black", lw=0.6,
                                   zorder=2, gid=f"receive:{s}:{r}:{rows}"))
            if r != s:  # a rank's own rows stay in its memory
                ax.plot([send_at + width / 2, receive_at + width / 2], [r + height, s],
                        color=EXPERT_COLORS[r % 10], lw=0.8, alpha=0.7, zorder=1, gid=f"exchange:{r}:{s}")
            if width > 0.16:
                ax.text(send_at + width / 2, r + height / 2, f"→{s}", ha="center", va="center", fontsize=9, zorder=3)
                ax.text(receive_at + width / 2, s + height / 2, f"{r}→", ha="center", va="center", fontsize=9,
                        zorder=3)
    crossing = int(send_counts.sum() - np.trace(send_counts))
    ax.set_title(title or f"all-to-all: {crossing:,} rows ({crossing * bytes_per_row / 1e3:,.1f} kB) cross ranks; "
                          "each rank's own share stays home", fontsize=10)
    ax.set(xlim=(-0.9, receive_x + 1.75), ylim=(world - 0.3, -0.3))
    ax.axis("off")
    return fig
