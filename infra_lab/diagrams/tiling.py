"""FlashAttention's tiling as a picture: one query row's scores against K and V in tiles, the
partial softmax (max m, sum l) of each tile, and the running (m, l) after each merge. The
numbers are those of `infra_lab.kernels.online_softmax` run over real q, K and V, so the
picture changes with them, and its final l is the softmax's normalizer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from infra_lab.kernels import online_softmax

MAX_KEYS, MAX_TILES = 16, 4  # the row must fit the page
LEFT_IN, RIGHT_IN, WIDTH_IN = 0.95, 0.1, 6.9  # row labels, the tiles, a margin
GAP_IN = 0.5  # between tiles: room for the merge arrow and its factor
FONT_PT = 9.0


@dataclass(frozen=True)
class TileStep:
    """One tile of keys [first, last) folded into the running softmax of one query row."""

    first: int
    last: int
    tile_max: float  # the tile's own partial: max score
    tile_sum: float  # sum of exp(score - tile_max) over the tile
    running_max: float  # after merging the tile into everything before it
    running_sum: float
    rescale: float  # exp(old running max - new running max): 1 when the max did not grow
    running_acc: np.ndarray  # (D,) the unnormalized output after the merge


def steps(scores: np.ndarray, values: np.ndarray, tile: int) -> list[TileStep]:
    """Run the online softmax over `scores` (n,) and `values` (n, D), `tile` keys at a time."""
    scores, values = np.asarray(scores, np.float64), np.asarray(values, np.float64)
    if scores.ndim != 1 or values.ndim != 2 or values.shape[0] != scores.shape[0]:
        raise ValueError(f"need scores (n,) and values (n, D); got {scores.shape}, {values.shape}")
    if not 1 <= tile <= scores.shape[0]:
        raise ValueError(f"tile must be in [1, {scores.shape[0]}] keys; got {tile}")
    found, running = [], None
    for first in range(0, scores.shape[0], tile):
        last = min(first + tile, scores.shape[0])
        part = online_softmax.partial(scores[None, first:last], values[first:last])
        old_max = None if running is None else float(running[0][0])
        running = part if running is None else online_softmax.merge(running, part)
        new_max = float(running[0][0])
        found.append(TileStep(first, last, float(part[0][0]), float(part[1][0]), new_max,
                              float(running[1][0]),
                              1.0 if old_max is None else math.exp(old_max - new_max),
                              running[2][0]))
    return found


def _box(ax, x, y, w, h, text, gid, edge="#4a6a8a", face="white", lw=1.0):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.05",
                                facecolor=face, edgecolor=edge, linewidth=lw, gid=gid))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=FONT_PT, gid=gid)


def _arrow(ax, start, end, color="#555555"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=9, color=color,
                                 linewidth=1.0, shrinkA=0, shrinkB=0))


def draw(q: np.ndarray, k: np.ndarray, v: np.ndarray, tile: int) -> Figure:
    """One query row `q` (D,) against keys `k` and values `v` (n, D), `tile` keys per tile."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if q.ndim != 1 or k.shape != v.shape or k.ndim != 2 or k.shape[1] != q.shape[0]:
        raise ValueError(f"need q (D,), k and v (n, D); got {q.shape}, {k.shape}, {v.shape}")
    n = k.shape[0]
    if not 2 <= n <= MAX_KEYS or not 2 <= tile <= n or -(-n // tile) > MAX_TILES:
        raise ValueError(f"the diagram draws 2 to {MAX_KEYS} keys in 1 to {MAX_TILES} tiles "
                         f"of at least 2 keys; got {n} keys in tiles of {tile}")
    scores = k @ q / math.sqrt(q.shape[0])  # (n,)
    found = steps(scores, v, tile)
    weights = np.exp(scores - scores.max())
    normalizer = float(weights.sum())  # the reference: softmax's denominator over the row
    error = float(np.abs(found[-1].running_acc / found[-1].running_sum
                         - weights @ v / normalizer).max())

    cell = (WIDTH_IN - LEFT_IN - RIGHT_IN - GAP_IN * (len(found) - 1)) / n
    row_h, box_h = 0.36, 0.5
    y_keys, y_cells, y_tile, y_run, y_end = 3.3, 2.82, 2.0, 1.0, 0.25
    height = 4.0
    figure = Figure(figsize=(WIDTH_IN, height))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_IN)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.text(WIDTH_IN / 2, height - 0.22,
            f"Online softmax: one row of a Q block against {n} keys, in K, V tiles of {tile}",
            ha="center", va="center", fontsize=10.5)
    for y, label in ((y_cells + row_h / 2, "scores\nq·k/√d"),
                     (y_tile + box_h / 2, "each tile\nalone"),
                     (y_run + box_h / 2, "running,\nafter merge")):
        ax.text(0.05, y, label, ha="left", va="center", fontsize=FONT_PT)
    shades = colormaps["Blues"]
    previous = None
    for index, step in enumerate(found):
        x0 = LEFT_IN + index * GAP_IN + step.first * cell
        width = (step.last - step.first) * cell
        ax.text(x0 + width / 2, y_keys, f"K, V rows {step.first}–{step.last - 1}",
                ha="center", va="center", fontsize=FONT_PT)
        for j in range(step.first, step.last):
            shade = weights[j] / weights.max()  # 1 for the row's largest score
            x = x0 + (j - step.first) * cell
            ax.add_patch(Rectangle((x, y_cells), cell, row_h, facecolor=shades(0.1 + 0.8 * shade),
                                   edgecolor="white", gid=f"score {j}"))
            ax.text(x + cell / 2, y_cells + row_h / 2, f"{scores[j]:.1f}", ha="center",
                    va="center", fontsize=FONT_PT, gid=f"score {j}",
                    color="white" if shade > 0.6 else "black")
        _box(ax, x0, y_tile, width, box_h,
             f"m = {step.tile_max:.2f}\nℓ = {step.tile_sum:.4g}", f"tile {index}")
        grew = step.rescale < 1.0
        _box(ax, x0, y_run, width, box_h,
             f"m = {step.running_max:.2f}\nℓ = {step.running_sum:.4g}", f"running {index}",
             edge="#d9822b" if grew else "#4a6a8a", lw=1.8 if grew else 1.0)
        _arrow(ax, (x0 + width / 2, y_cells - 0.04), (x0 + width / 2, y_tile + box_h))
        _arrow(ax, (x0 + width / 2, y_tile), (x0 + width / 2, y_run + box_h))
        if previous is not None:
            _arrow(ax, (previous, y_run + box_h / 2), (x0, y_run + box_h / 2))
            ax.text((previous + x0) / 2, y_run + box_h / 2 + 0.16, f"×{step.rescale:.2f}",
                    ha="center", va="center", fontsize=FONT_PT, gid=f"rescale {index}")
        previous = x0 + width
    note = ("×: the factor e^(m_old − m) that rescales the running ℓ and "
            "a = Σ e^(s − m)·v\nbefore the tile is added; orange: the tile raised the max; "
            "darker score: more weight.")
    ax.text(LEFT_IN, y_run - 0.12, note, ha="left", va="top", fontsize=FONT_PT,
            color="#333333")
    ax.text(0.05, y_end + 0.12,
            f"The whole row at once: max s = {scores.max():.2f} and softmax's normalizer "
            f"Σ e^(s − max s) = {normalizer:.4g}.", ha="left", va="center", fontsize=FONT_PT,
            gid="reference")
    ax.text(0.05, y_end - 0.16,
            f"The last running state holds the same; a / ℓ = softmax(s)·V to within "
            f"{error:.0e}.", ha="left", va="center", fontsize=FONT_PT, gid="output-error")
    return figure
