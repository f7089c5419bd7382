"""Figures read at the page's width: the book style's fonts are at least 9 pt, and no notebook
or package module asks for a smaller font or a figure wider than the text column."""
import re

import matplotlib
import pytest

from infra_lab import figures

FONT_KEYS = ("font.size", "axes.titlesize", "axes.labelsize", "xtick.labelsize",
             "ytick.labelsize", "legend.fontsize", "figure.titlesize")
FONTSIZE = re.compile(r"fontsize\s*=\s*(\d+(?:\.\d+)?)")
FIGSIZE = re.compile(r"figsize\s*=\s*\(\s*(\d+(?:\.\d+)?)\s*,")


def test_book_style_sets_fonts_of_at_least_the_floor():
    with matplotlib.rc_context():
        figures.book_style()
        for key in FONT_KEYS:
            assert matplotlib.rcParams[key] >= figures.MIN_FONT_PT, key
        assert matplotlib.rcParams["figure.figsize"][0] <= figures.MAX_WIDTH_IN


def sources(root):
    from infra_lab.grading import notebooks

    for path in sorted((root / "book").glob("*.ipynb")):
        for cell in notebooks.read(path).cells:
            if cell.cell_type == "code":
                yield path.name, cell.source
    for path in sorted((root / "infra_lab").rglob("*.py")):
        yield path.name, path.read_text(encoding="utf-8")


def test_no_figure_asks_for_a_small_font_or_a_wide_canvas(root):
    for name, source in sources(root):
        small = [float(size) for size in FONTSIZE.findall(source)
                 if float(size) < figures.MIN_FONT_PT]
        wide = [float(width) for width in FIGSIZE.findall(source)
                if float(width) > figures.MAX_WIDTH_IN]
        assert small == [] and wide == [], (name, small, wide)


@pytest.mark.parametrize("text, found", [("ax.text(1, 2, 's', fontsize=8)", [8.0]),
                                         ("fontsize = 7.5", [7.5]), ("fontsize=10", [])])
def test_the_font_scan_finds_small_fonts(text, found):
    assert [float(s) for s in FONTSIZE.findall(text) if float(s) < figures.MIN_FONT_PT] == found
