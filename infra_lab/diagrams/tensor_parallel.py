"""Chapter 10's picture of tensor parallelism (Shoeybi et al., "Megatron-LM: Training multi-billion
parameter language models using model parallelism", 2019, Section 3): the SwiGLU MLP split over
N ranks, drawn from the shards `parallel.tensor` gives each rank and the values each one computes.

The top row is one process. Row r + 1 is rank r: the input x, replicated, enters through f; rank r
multiplies it by its columns of gate and up (`tensor.shard_columns`), gates its slice of the hidden
units alone, and multiplies that by its rows of down (`tensor.shard_rows`), a partial sum of the
whole output; g adds the partial sums, which gives one process's y. Each matrix is a grid of
cells shaded by value (one colour scale per column, so the partial sums and y compare), outlined in
its rank's colour; every cell carries a gid, so the tests read the values back.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from infra_lab.diagrams.parallel import CHUNK_COLORS
from infra_lab.parallel import tensor

WIDTH_IN = 6.5
FONT_PT = 9
CELL_IN = 0.11
LABEL_IN = 0.95  # the row names' column
GAP_IN = 0.3
SHADES = colormaps["RdBu_r"]
COLUMNS = ("x", "gate | up", "gated", "down", "out", "y")
HEADS = {"x": "x", "gate | up": "gate | up\n(columns)", "gated": "silu(x gate)\n× (x up)",
         "down": "down\n(rows)", "out": "y, or a\npartial sum", "y": "g: y = Σ\nof partials"}


class MlpPieces(NamedTuple):
    x: torch.Tensor  # (T, d), the same on every rank
    whole: dict[str, torch.Tensor]  # one process: gate, up (d, h), gated (T, h), down (h, d), y (T, d)
    ranks: list[dict[str, torch.Tensor]]  # per rank: gate, up (d, h/N), gated (T, h/N), down (h/N, d),
    #                                        partial (T, d)
    summed: torch.Tensor  # (T, d): the partial sums added, what g returns on every rank


def mlp_pieces(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               world: int) -> MlpPieces:
    """What one process and each of `world` ranks hold and compute in the SwiGLU MLP on x (T, d)
    with gate and up (d, h) and down (h, d), through the package's own shards and linear layers."""
    if x.ndim != 2 or gate.shape != up.shape or gate.shape[0] != x.shape[1] or \
            down.shape != (gate.shape[1], x.shape[1]):
        raise ValueError(f"expected x (T, d), gate and up (d, h), down (h, d); got x {tuple(x.shape)}, gate "
                         f"{tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
    gated = F.silu(x @ gate) * (x @ up)  # (T, h)
    whole = {"gate": gate, "up": up, "gated": gated, "down": down, "y": gated @ down}
    ranks = []
    for rank in range(world):
        gate_r = tensor.shard_columns(gate, rank, world)  # (d, h/N)
        up_r = tensor.shard_columns(up, rank, world)
        gated_r = F.silu(tensor.column_parallel_linear(x, gate_r)) * tensor.column_parallel_linear(x, up_r)
        down_r = tensor.shard_rows(down, rank, world)  # (h/N, d)
        ranks.append({"gate": gate_r, "up": up_r, "gated": gated_r, "down": down_r,
                      "partial": gated_r @ down_r})  # what row_parallel_linear hands to g
    return MlpPieces(x, whole, ranks, sum(r["partial"] for r in ranks))


def _matrix(ax, values: np.ndarray, left: float, top: float, norm: Normalize, edge, gid: str) -> None:
    rows, cols = values.shape
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((left + j * CELL_IN, top + i * CELL_IN), CELL_IN, CELL_IN, lw=0.3,
                                   facecolor=SHADES(norm(values[i, j])), edgecolor="white",
                                   gid=f"cell:{gid}:{i}:{j}"))
    ax.add_patch(Rectangle((left, top), cols * CELL_IN, rows * CELL_IN, facecolor="none", edgecolor=edge,
                           lw=1.6, gid=f"matrix:{gid}"))


def _split(ax, left: float, top: float, rows: int, cols: int, world: int, by: str, gid: str) -> None:
    """Rank r's share of a whole matrix outlined, dashed, in its colour: columns or rows."""
    for rank in range(world):
        if by == "columns":
            part = cols // world
            box = (left + rank * part * CELL_IN, top, part * CELL_IN, rows * CELL_IN)
        else:
            part = rows // world
            box = (left, top + rank * part * CELL_IN, cols * CELL_IN, part * CELL_IN)
        ax.add_patch(Rectangle(box[:2], *box[2:], facecolor="none", edgecolor=CHUNK_COLORS[rank], lw=1.2,
                               ls=(0, (3, 2)), gid=f"share:{gid}:{rank}"))


def draw_mlp(pieces: MlpPieces, title: str | None = None) -> Figure:
    """One row for one process and one per rank, a column per step of the MLP (see the module)."""
    world = len(pieces.ranks)
    if not 1 <= world <= 4:
        raise ValueError(f"draw 1 to 4 ranks; got {world}")
    x = pieces.x.detach().double().numpy()
    whole = {k: v.detach().double().numpy() for k, v in pieces.whole.items()}
    ranks = [{k: v.detach().double().numpy() for k, v in r.items()} for r in pieces.ranks]
    summed = pieces.summed.detach().double().numpy()
    t, d = x.shape
    h = whole["gate"].shape[1]
    widths = {"x": d, "gate | up": 2 * h + 1, "gated": h, "down": d, "out": d, "y": d}  # in cells
    left = {}
    at = LABEL_IN
    for column in COLUMNS:
        left[column] = at
        at += widths[column] * CELL_IN + GAP_IN
    if at - GAP_IN > WIDTH_IN:
        raise ValueError(f"an MLP of width {d} and {h} hidden units does not fit {WIDTH_IN} inches; "
                         f"draw a smaller one")

    def scale(*arrays) -> Normalize:
        top = max(float(np.abs(a).max()) for a in arrays) or 1.0
        return Normalize(-top, top)

    norms = {"x": scale(x), "weights": scale(whole["gate"], whole["up"], whole["down"]),
             "gated": scale(whole["gated"]), "out": scale(whole["y"], summed, *(r["partial"] for r in ranks))}
    head_in, title_in, foot_in = 0.45, 0.4, 0.75
    row_in = [max(h, t) * CELL_IN + 0.3] + [max(h // world, t, d) * CELL_IN + 0.3] * world
    height = title_in + head_in + sum(row_in) + foot_in
    figure = Figure(figsize=(WIDTH_IN, height))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, WIDTH_IN), ylim=(height, 0))
    ax.axis("off")
    ax.text(0.1, 0.12, title or f"The MLP split over {world} ranks: gate and up by columns, down by rows",
            ha="left", va="top", fontsize=10.5, gid="title")
    for column in COLUMNS:
        ax.text(left[column] + widths[column] * CELL_IN / 2, title_in + head_in - 0.05, HEADS[column],
                ha="center", va="bottom", fontsize=FONT_PT, gid=f"head:{column}")
    top = title_in + head_in
    rank_tops = []
    for row, height_in in enumerate(row_in):
        is_whole = row == 0
        values = whole if is_whole else ranks[row - 1]
        edge = "black" if is_whole else CHUNK_COLORS[row - 1]
        name = "one process" if is_whole else f"rank {row - 1}"
        ax.text(0.1, top + 0.05, name, ha="left", va="top", fontsize=FONT_PT, color=edge, gid=f"row:{name}")
        _matrix(ax, x, left["x"], top, norms["x"], "black", f"{name}:x")
        width = values["gate"].shape[1]
        _matrix(ax, values["gate"], left["gate | up"], top, norms["weights"], edge, f"{name}:gate")
        _matrix(ax, values["up"], left["gate | up"] + (width + 1) * CELL_IN, top, norms["weights"], edge,
                f"{name}:up")
        _matrix(ax, values["gated"], left["gated"], top, norms["gated"], edge, f"{name}:gated")
        _matrix(ax, values["down"], left["down"], top, norms["weights"], edge, f"{name}:down")
        _matrix(ax, values["y" if is_whole else "partial"], left["out"], top, norms["out"], edge,
                f"{name}:{'y' if is_whole else 'partial'}")
        if is_whole and world > 1:
            for name_, at in (("gate", left["gate | up"]), ("up", left["gate | up"] + (h + 1) * CELL_IN),
                              ("gated", left["gated"])):
                _split(ax, at, top, values[name_].shape[0], h, world, "columns", name_)
            _split(ax, left["down"], top, h, d, world, "rows", "down")
        if not is_whole:
            ax.text(left["x"] + d * CELL_IN + GAP_IN / 2, top + t * CELL_IN / 2, "f", ha="center",
                    va="center", fontsize=FONT_PT + 1, weight="bold", gid=f"f:{row - 1}")
            rank_tops.append(top)
        top += height_in
    middle = (rank_tops[0] + rank_tops[-1] + t * CELL_IN) / 2
    _matrix(ax, summed, left["y"], middle - t * CELL_IN / 2, norms["out"], "black", "g:y")
    ax.text(left["y"] - GAP_IN / 2, middle, "g", ha="center", va="center", fontsize=FONT_PT + 1,
            weight="bold", gid="g")
    gap = float(np.abs(summed - whole["y"]).max())
    ax.text(WIDTH_IN - 0.08, middle + t * CELL_IN / 2 + 0.05, f"= one process's y\n(largest gap {gap:.0e})",
            ha="right", va="top", fontsize=FONT_PT, gid="gap")
    foot = ("f: forward, the identity (x is already on every rank); backward, an all-reduce of x's gradient.\n"
            "g: forward, an all-reduce of the partial sums; backward, the identity.\n"
            "Shades: each cell's value, blue negative and red positive, one scale per column;\n"
            "dashed in the top row: each rank's share of the matrix.")
    ax.text(0.1, top + 0.05, foot, ha="left", va="top", fontsize=FONT_PT, linespacing=1.4, gid="foot")
    return figure
