"""Chapter 03's concept diagram: the block tables of a live PagedKVCache, drawn from the cache.

Each sequence's block table is a row of entries, one per logical block, each holding the number
of the physical block it maps to; an arrow runs from the entry to that block in the pool below,
whose reference count is written under it. Drawn after `fork`, the arrows of two sequences meet
on shared blocks; drawn again after one of them writes, copy-on-write has given it a private
copy of the last block (Kwon et al., SOSP 2023, Section 4.4).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from infra_lab.kv.paged import PagedKVCache

MAX_BOXES = 24  # per row; more would shrink a box below its 9-pt label
BOX, GAP, GROUP_GAP = 1.0, 0.25, 0.9  # widths in data units: a box, between boxes, between tables
LABEL_WIDTH = 2.5  # the narrowest table group: room for its "seq 1 / 10 tokens" label
TABLE_Y, POOL_Y, HEIGHT = 2.3, 0.0, 0.8  # bottoms of the two rows, and their boxes' height
FILL = {"free": "white", "cached": "#d9d9d9", "one table": "#cfe3f6", "shared": "#f7c98b"}
SEQUENCE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def block_state(cache: PagedKVCache, block: int) -> str:
    """The block's state, as the diagram colours it: free, cached (free, but keeping a known
    prefix), held by one table, or shared by several."""
    count = cache.allocator.ref_counts[block]
    if count == 0:
        return "cached" if block in cache.allocator.cached else "free"
    return "one table" if count == 1 else "shared"


def draw(cache: PagedKVCache, seqs: list[int] | None = None, ax: plt.Axes | None = None,
         title: str | None = None) -> plt.Figure:
    """The block tables of `seqs` (default: every live sequence) over the cache's pool.

    Entry i of sequence s's table is a box holding `cache.tables[s][i]`, with a bar under its
    number filled to the share of the block's slots that hold s's tokens; its arrow ends on that
    physical block. Pool boxes are coloured by state and carry their reference count below.
    Draws into `ax` when given, else into a new 6.5-inch figure; returns the figure.
    """
    seqs = sorted(cache.tables) if seqs is None else list(seqs)
    for seq in seqs:
        cache.view(seq)  # raises KeyError naming the live sequences
    num_blocks = cache.allocator.num_blocks
    widths = [max(len(cache.tables[seq]) * (BOX + GAP) - GAP, LABEL_WIDTH) for seq in seqs]
    table_width = sum(widths) + max(len(seqs) - 1, 0) * GROUP_GAP
    pool_width = num_blocks * (BOX + GAP) - GAP
    width = max(table_width, pool_width)
    if width > MAX_BOXES * (BOX + GAP):
        entries = sum(len(cache.tables[seq]) for seq in seqs)
        raise ValueError(f"the diagram draws rows of at most {MAX_BOXES} boxes; this cache has "
                         f"{num_blocks} blocks, and sequences {seqs} hold {entries} table "
                         "entries: draw fewer sequences or a smaller pool")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 2.6))

    pool_x = (width - pool_width) / 2
    for block in range(num_blocks):
        x = pool_x + block * (BOX + GAP)
        ax.add_patch(Rectangle((x, POOL_Y), BOX, HEIGHT, facecolor=FILL[block_state(cache, block)],
                               edgecolor="0.3", linewidth=0.8, gid=f"block:{block}"))
        ax.text(x + BOX / 2, POOL_Y + HEIGHT / 2, str(block), ha="center", va="center", fontsize=9)
        ax.text(x + BOX / 2, POOL_Y - 0.2, str(cache.allocator.ref_counts[block]), ha="center",
                va="top", fontsize=9, color="0.2", gid=f"refs:{block}")

    group_x = (width - table_width) / 2
    for n, (seq, group_width) in enumerate(zip(seqs, widths)):
        color = SEQUENCE_COLORS[n % len(SEQUENCE_COLORS)]
        table, length = cache.tables[seq], cache.lengths[seq]
        ax.text(group_x + group_width / 2, TABLE_Y + HEIGHT + 0.12, f"seq {seq}\n{length} tokens",
                ha="center", va="bottom", fontsize=9, color=color, linespacing=1.1)
        x = group_x + (group_width - (len(table) * (BOX + GAP) - GAP)) / 2
        for index, block in enumerate(table):
            ax.add_patch(Rectangle((x, TABLE_Y), BOX, HEIGHT, facecolor="white", edgecolor=color,
                                   linewidth=1.2, gid=f"entry:{seq}:{index}"))
            ax.text(x + BOX / 2, TABLE_Y + HEIGHT * 0.6, str(block), ha="center", va="center",
                    fontsize=9)
            used = min(max(length - index * cache.block_size, 0), cache.block_size)
            ax.add_patch(Rectangle((x + 0.12, TABLE_Y + 0.1), (BOX - 0.24) * used / cache.block_size,
                                   0.12, facecolor=color, linewidth=0, gid=f"fill:{seq}:{index}"))
            target = pool_x + block * (BOX + GAP) + BOX / 2
            ax.add_patch(FancyArrowPatch((x + BOX / 2, TABLE_Y), (target, POOL_Y + HEIGHT),
                                         arrowstyle="-|>", mutation_scale=9, shrinkA=0, shrinkB=0,
                                         color=color, linewidth=1.0, alpha=0.8,
                                         gid=f"arrow:{seq}:{index}"))
            x += BOX + GAP
        group_x += group_width + GROUP_GAP

    label_x = -0.25
    ax.text(label_x, TABLE_Y + HEIGHT / 2, "block\ntables", ha="right", va="center", fontsize=9)
    ax.text(label_x, POOL_Y + HEIGHT / 2, "pool", ha="right", va="center", fontsize=9)
    ax.text(label_x, POOL_Y - 0.2, "refs", ha="right", va="top", fontsize=9, color="0.2")
    states = [state for state in FILL if state != "cached" or cache.allocator.cached]
    ax.legend(handles=[Patch(facecolor=FILL[s], edgecolor="0.3", label=s) for s in states],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(states), fontsize=9,
              frameon=False, handlelength=1.2, columnspacing=1.2)
    ax.set_xlim(-2.0, width + 0.2)
    ax.set_ylim(POOL_Y - 0.75, TABLE_Y + HEIGHT + 0.8)
    ax.axis("off")
    ax.set_title(title or f"Block tables of {len(seqs)} sequences over a pool of {num_blocks} "
                 f"blocks of {cache.block_size} tokens", fontsize=10.5)
    return ax.figure
