"""Chapter 04's concept diagram: the real radix tree, drawn from a live RadixCache.

The root sits on the left and each leaf has a row of its own, so a cached sequence reads left to
right along its row. The edge into a node carries the node's run of tokens above the line and,
below it, the node's lock count (requests in flight holding it) and its place in LRU order:
rank 1 is the least recently used, and nodes stamped at the same tick of the clock share a rank
(a match stamps every node on its path at once). Eviction takes unlocked leaves lowest rank first
(Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Circle
from matplotlib.textpath import TextPath

from infra_lab.kv.radix import Node, RadixCache

LABEL_PT, INFO_PT = 10.0, 9.0
FONT = {"family": "monospace"}
ROW_IN = 0.58  # between the rows of two leaves
PAD_IN = 0.08  # from a node's dot to the text on the edges that leave it
GAP_IN = 0.22  # after the longer of an edge's two texts, before the next dot
MARGIN_IN = 0.3
DOT_IN = 0.045
MAX_LABEL = 24  # characters of an edge's label; longer runs are cut with an ellipsis
COLORS = {"edge": "0.25", "locked": "tab:orange", "highlight": "tab:blue"}


def show_ints(key: np.ndarray) -> str:
    """The default edge label: the token ids."""
    return " ".join(str(int(t)) for t in key)


def lru_ranks(cache: RadixCache) -> dict[int, int]:
    """{id(node): rank} for every node below the root: 1 is the least recently used, and nodes
    with the same `last_access` share a rank."""
    nodes = list(walk(cache))
    stamps = sorted({node.last_access for node, _ in nodes})
    return {id(node): stamps.index(node.last_access) + 1 for node, _ in nodes}


def walk(cache: RadixCache) -> Iterable[tuple[Node, Node]]:
    """(node, parent) below the root, depth first, children in token order."""
    stack = [(child, cache.root) for _, child in sorted(cache.root.children.items(), reverse=True)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        stack.extend((child, node) for _, child in sorted(node.children.items(), reverse=True))


def cut(label: str, limit: int = MAX_LABEL) -> str:
    return label if len(label) <= limit else label[:limit - 1] + "\u2026"


def text_in(text: str, size_pt: float, prop: dict | None = FONT) -> float:
    """Width of `text` at `size_pt` in the diagram's font (or `prop`'s), in inches."""
    if not text:
        return 0.0
    return TextPath((0, 0), text, size=size_pt, prop=prop).get_extents().width / 72


@dataclass(frozen=True)
class Placed:
    """One node as drawn: its label and info texts, and where its dot sits (inches)."""

    node: Node
    parent: int  # index of the parent in the layout; the root is 0, with parent -1
    label: str
    info: str
    x: float
    row: int


def layout(cache: RadixCache, show: Callable[[np.ndarray], str] = show_ints) -> list[Placed]:
    """The root first, then every node depth first: a leaf takes the next free row, an inner
    node the row of its first child, and a dot sits as far right of its parent's as the longer
    of its edge's two texts needs."""
    ranks = lru_ranks(cache)
    placed = [Placed(cache.root, -1, "", "", MARGIN_IN + text_in("root", INFO_PT) + PAD_IN, 0)]
    index = {id(cache.root): 0}
    rows = {id(cache.root): 0}
    next_row = 0
    for node, parent in walk(cache):
        label = cut(show(node.key))
        info = f"lock {node.lock_refs} \u00b7 LRU {ranks[id(node)]}"
        width = max(text_in(label, LABEL_PT), text_in(info, INFO_PT))
        up = placed[index[id(parent)]]
        first_child = next(iter(sorted(parent.children.items())))[1] is node
        row = rows[id(parent)] if first_child else next_row
        rows[id(node)] = row
        next_row = max(next_row, row + (not node.children))
        index[id(node)] = len(placed)
        x = up.x + PAD_IN + width + GAP_IN
        placed.append(Placed(node, index[id(parent)], label, info, x, row))
    return placed


def draw(cache: RadixCache, show: Callable[[np.ndarray], str] = show_ints, title: str = "",
         highlight: Iterable[Node] = (), highlight_label: str = "highlighted") -> Figure:
    """The tree of `cache` as a figure sized to it: each edge labelled with `show(node.key)`
    (cut at MAX_LABEL characters) and, under it, the node's lock count and LRU rank. Locked
    nodes are orange; `highlight` nodes (the upper half of a split, say) are blue, and a key
    under the tree names both."""
    placed = layout(cache, show)
    marked = {id(node) for node in highlight}
    locked = any(p.node.lock_refs for p in placed[1:])
    rows = max(p.row for p in placed) + 1
    width = max(p.x for p in placed) + MARGIN_IN
    key_in = 0.35 if locked or marked else 0.0
    height = (MARGIN_IN + (0.3 if title else 0) + 0.1 + (rows - 1) * ROW_IN + 0.3 + key_in
              + MARGIN_IN / 2)
    figure = Figure(figsize=(width, height))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)  # inches from the top
    ax.axis("off")
    top = MARGIN_IN + (0.3 if title else 0) + 0.1

    def y(row: int) -> float:
        return top + row * ROW_IN

    if title:
        ax.text(MARGIN_IN / 2, 0.12, title, fontsize=10.5, va="top", ha="left")
    ax.text(placed[0].x - PAD_IN, y(0), "root", fontsize=INFO_PT, fontdict=FONT, ha="right",
            va="center", color="0.35")
    for k, p in enumerate(placed):
        color = (COLORS["highlight"] if id(p.node) in marked
                 else COLORS["locked"] if k and p.node.lock_refs else COLORS["edge"])
        ax.add_patch(Circle((p.x, y(p.row)), DOT_IN, color=color, gid=f"dot-{k}", zorder=3))
        if k == 0:
            continue
        up = placed[p.parent]
        line = Line2D([up.x, up.x, p.x], [y(up.row), y(p.row), y(p.row)], color=color,
                      linewidth=2.2 if color != COLORS["edge"] else 1.2, gid=f"edge-{k}")
        ax.add_line(line)
        ax.text(up.x + PAD_IN, y(p.row) - 0.05, p.label, fontsize=LABEL_PT, fontdict=FONT,
                ha="left", va="bottom", color="black" if color == COLORS["edge"] else color,
                gid=f"label-{k}-of-{p.parent}")
        ax.text(up.x + PAD_IN, y(p.row) + 0.06, p.info, fontsize=INFO_PT, fontdict=FONT,
                ha="left", va="top", color="0.35", gid=f"info-{k}")
    keys = [(COLORS["locked"], "locked by a request in flight")] if locked else []
    keys += [(COLORS["highlight"], highlight_label)] if marked else []
    x = MARGIN_IN / 2
    for color, text in keys:
        ax.add_line(Line2D([x, x + 0.3], [height - MARGIN_IN / 2 - 0.12] * 2, color=color,
                           linewidth=2.2))
        ax.text(x + 0.38, height - MARGIN_IN / 2 - 0.12, text, fontsize=INFO_PT, va="center",
                gid=f"key-{text}")
        x += 0.38 + text_in(text, INFO_PT, prop=None) + 0.4
    return figure
