"""The roofline as a picture: the roofs of a few machines, and where a model's ops sit on them.

Each roof is min(peak, intensity x bandwidth) for one (Device, dtype); its corner is the ridge
point. An op is a vertical line at its arithmetic intensity, with a marker where it meets each
roof: filled where that machine is compute-bound for it, hollow where memory-bound. The same op
can be compute-bound on one machine and memory-bound on another (Williams, Waterman and
Patterson, "Roofline", CACM 2009).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

from infra_lab import roofline
from infra_lab.hardware import Device

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def rate(value: float, unit: str) -> str:
    """A rate with an SI prefix that keeps 1 to 3 digits: 9.9e11 -> '989 G' + unit."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def roof_label(device: Device, dtype: str) -> str:
    return (f"{device.name}, {dtype}: {rate(device.flops(dtype), 'FLOP/s')}, "
            f"{rate(device.memory_bandwidth, 'B/s')}, "
            f"ridge {roofline.ridge_point(device, dtype):.3g} FLOP/B")


def label_rows(ax, xs: Sequence[float], labels: Sequence[str], row_height: float = 0.075,
               gap_px: float = 6) -> list:
    """Each label at the top of the axes over its x (data), horizontal, on the first row where
    it overlaps no other label (rows go down from the top, `row_height` of the axes each), and
    shifted sideways to stay inside the axes. Returns the texts in the order of `labels`."""
    renderer = ax.figure.canvas.get_renderer()
    left, right = ax.get_window_extent(renderer).x0, ax.get_window_extent(renderer).x1
    rows: list[list[tuple[float, float]]] = []  # pixel spans taken on each row
    texts = [None] * len(labels)
    for i in sorted(range(len(labels)), key=lambda i: xs[i]):
        text = ax.text(0, 0, labels[i], ha="center", va="top", fontsize=9, zorder=4,
                       bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none"})
        width = text.get_window_extent(renderer).width + gap_px
        center = ax.transData.transform((xs[i], 1))[0]
        center = min(max(center, left + width / 2), right - width / 2)
        span = (center - width / 2, center + width / 2)
        row = next((r for r, taken in enumerate(rows)
                    if all(span[1] <= a or span[0] >= b for a, b in taken)), len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(span)
        x = ax.transData.inverted().transform((center, 0))[0]
        text.set_position((x, 0.98 - row * row_height))
        text.set_transform(ax.get_xaxis_transform())  # x in data, y in axes fraction
        texts[i] = text
    return texts


def draw(roofs: Sequence[tuple[Device, str]], ops: Mapping[str, roofline.Cost],
         title: str | None = None, figsize: tuple[float, float] = (6.8, 5.0)) -> plt.Figure:
    """The roofs of each (device, dtype) in `roofs`, and each op of `ops` (label -> Cost) placed
    on every roof at its intensity. Returns the figure."""
    if not roofs or not ops:
        raise ValueError(f"need at least one roof and one op; got {len(roofs)} and {len(ops)}")
    if len(roofs) > len(COLORS):
        raise ValueError(f"at most {len(COLORS)} roofs; got {len(roofs)}")
    intensities = [cost.intensity for cost in ops.values()]
    ridges = [roofline.ridge_point(device, dtype) for device, dtype in roofs]
    low = min(intensities + ridges) / 4
    high = max(intensities + ridges) * 4
    fig, (ax, key) = plt.subplots(2, 1, figsize=figsize, height_ratios=(4, 1))
    tops = []
    for (device, dtype), ridge, color in zip(roofs, ridges, COLORS):
        x = np.array([low, ridge, high])  # a roof is straight on either side of its ridge
        ax.loglog(x, np.minimum(device.flops(dtype), x * device.memory_bandwidth), color=color,
                  lw=2, label=roof_label(device, dtype))
        ax.axvline(ridge, color=color, ls=":", lw=1)
        tops.append(device.flops(dtype))
    for label, cost in ops.items():
        ax.axvline(cost.intensity, color="0.75", lw=0.8, zorder=0)
        for (device, dtype), ridge, color in zip(roofs, ridges, COLORS):
            height = roofline.attainable_flops(cost.intensity, device, dtype)
            bound = cost.intensity >= ridge
            ax.loglog([cost.intensity], [height], "o", ms=7, color=color, zorder=3,
                      markerfacecolor=color if bound else "white", markeredgewidth=1.5,
                      gid=f"{label} on {device.name}, {'compute' if bound else 'memory'}-bound")
    bottom = min(roofline.attainable_flops(low, device, dtype) for device, dtype in roofs) / 2
    ax.set_xlim(low, high)
    headroom = 0.3  # top share of the axes kept for the op labels
    decades = np.log10(max(tops)) - np.log10(bottom)
    ax.set_ylim(bottom, max(tops) * 10 ** (decades * headroom / (1 - headroom)))
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker="o", color="0.3", markerfacecolor="white",
                       label="op memory-bound there (left of the ridge, dotted)"),
                Line2D([], [], ls="", marker="o", color="0.3", label="op compute-bound there")]
    ax.set_yticks([10.0**k for k in range(int(np.floor(np.log10(bottom))),
                                         int(np.log10(max(tops))) + 1)])
    ax.minorticks_off()
    key.axis("off")
    key.legend(handles=handles, loc="center", fontsize=9, frameon=False)
    ax.set_title(title or "The roofline: each op at its intensity, on every machine's roof")
    fig.tight_layout()
    label_rows(ax, intensities, list(ops))
    return fig
