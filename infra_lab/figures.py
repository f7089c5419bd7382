"""The book's figure style: SVG output, and fonts that stay legible at the page's width.

The site's text column is about 700 px wide at a desktop width (the site test measures it).
A figure at most 7 inches wide is shown at its natural size there, so the 9-point minimum set
here is what the reader sees. `book_style()` runs in every notebook's setup cell.
"""
from __future__ import annotations

import matplotlib

MIN_FONT_PT = 9
MAX_WIDTH_IN = 7.0  # figures wider than this are scaled down on the page, and so are their fonts

STYLE = {
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.labelsize": 10,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "figure.titlesize": 11,
    "figure.figsize": (MAX_WIDTH_IN, 4.0),
}


def book_style() -> None:
    """Apply STYLE, and ask IPython's inline backend for SVG figures when there is one."""
    matplotlib.rcParams.update(STYLE)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and "IPKernelApp" in shell.config:
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("svg")
