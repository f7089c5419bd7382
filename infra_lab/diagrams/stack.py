"""The AI-infrastructure stack as a picture: one band per layer, top to bottom as given, with
what lives there and a chip for each chapter of the book that builds it (dashed and grey for a
chapter still to come, `stack.PLANNED`). Drawn from `infra_lab.stack.STACK`, so the picture
changes when the stack does."""
from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from matplotlib.textpath import TextPath

from infra_lab.stack import CHAPTERS, PLANNED, STACK, Layer

WIDTH_IN = 6.8
TEXT_IN = 3.95  # the left part of a band: the layer's name and what lives there
CHIP_GAP_IN = 0.06
NAME_PT, TEXT_PT = 10.5, 9.0
LINE_IN = 1.3 / 72  # one line of text per point of font size, in inches
PAD_IN = 0.08
TITLE = "The stack, top to bottom, and the chapters that build each layer"


def text_width_in(text: str, size_pt: float, bold: bool = False) -> float:
    """Width of `text` set in the default font at `size_pt`, in inches."""
    path = TextPath((0, 0), text, size=size_pt, prop={"weight": "bold" if bold else "normal"})
    return path.get_extents().width / 72


def chip_label(chapter: str, names: Mapping[str, str], planned: frozenset[str] = PLANNED) -> str:
    number = f"{chapter}, to come" if chapter in planned else chapter
    return f"{number}\n{names[chapter]}" if chapter in names else number


def chip_rows(chapters: Sequence[str], names: Mapping[str, str],
              room_in: float) -> list[list[tuple[str, str, float]]]:
    """Chapters as (chapter, label, width) chips, flowed left to right into rows of
    `room_in` inches."""
    rows: list[list[tuple[str, str, float]]] = [[]]
    used = 0.0
    for chapter in chapters:
        label = chip_label(chapter, names)
        width = max(text_width_in(line, TEXT_PT, bold=True) for line in label.split("\n"))
        width += 2 * PAD_IN
        if rows[-1] and used + width > room_in:
            rows.append([])
            used = 0.0
        rows[-1].append((chapter, label, width))
        used += width + CHIP_GAP_IN
    return rows


def draw(layers: Sequence[Layer] = STACK, chapter_names: Mapping[str, str] = CHAPTERS) -> Figure:
    """One band per layer, the first at the top, and a chip per chapter; returns the figure."""
    if not layers:
        raise ValueError("the stack diagram needs at least one layer; got none")
    chip_room = WIDTH_IN - TEXT_IN - 2 * PAD_IN
    chip_h = 2 * TEXT_PT * LINE_IN + PAD_IN
    bands = []
    for layer in layers:
        lines = textwrap.wrap(layer.examples, width=int(TEXT_IN * 72 / (0.55 * TEXT_PT)))
        rows = chip_rows(layer.chapters, chapter_names, chip_room) if layer.chapters else []
        text_h = NAME_PT * LINE_IN + len(lines) * TEXT_PT * LINE_IN
        chips_h = len(rows) * chip_h + max(len(rows) - 1, 0) * CHIP_GAP_IN
        bands.append((layer, lines, rows, max(text_h, chips_h) + 2 * PAD_IN))
    title_h = 0.35
    height = title_h + sum(h for *_, h in bands) + CHIP_GAP_IN * (len(bands) - 1) + 0.05
    figure = Figure(figsize=(WIDTH_IN + 0.1, height))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.05, WIDTH_IN + 0.05)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.text(WIDTH_IN / 2, height - title_h / 2, TITLE, ha="center", va="center",
            fontsize=NAME_PT + 0.5)
    colors = colormaps["Blues"]
    top = height - title_h
    for index, (layer, lines, rows, band_h) in enumerate(bands):
        shade = colors(0.15 + 0.35 * index / max(len(bands) - 1, 1))
        ax.add_patch(FancyBboxPatch((0, top - band_h), WIDTH_IN, band_h, facecolor=shade,
                                    edgecolor="#4a6a8a", gid=f"layer {index}",
                                    boxstyle="round,pad=0,rounding_size=0.06"))
        ax.text(PAD_IN, top - PAD_IN, layer.name, ha="left", va="top", fontsize=NAME_PT,
                fontweight="bold")
        ax.text(PAD_IN, top - PAD_IN - NAME_PT * LINE_IN, "\n".join(lines), ha="left",
                va="top", fontsize=TEXT_PT, linespacing=1.15)
        chip_top = top - PAD_IN
        for row in rows:
            x = TEXT_IN + PAD_IN
            for chapter, label, width in row:
                planned = chapter in PLANNED  # dashed and grey: not in the book yet
                ax.add_patch(FancyBboxPatch((x, chip_top - chip_h), width, chip_h,
                                            facecolor="#f2f2f2" if planned else "white",
                                            edgecolor="#777777" if planned else "#1f4e79",
                                            linestyle="--" if planned else "-",
                                            boxstyle="round,pad=0,rounding_size=0.05",
                                            gid=f"chapter {chapter} of layer {index}"))
                ax.text(x + width / 2, chip_top - chip_h / 2, label, ha="center", va="center",
                        fontsize=TEXT_PT, fontweight="normal" if planned else "bold",
                        color="#555555" if planned else "black", linespacing=1.1)
                x += width + CHIP_GAP_IN
            chip_top -= chip_h + CHIP_GAP_IN
        top -= band_h + CHIP_GAP_IN
    return figure
