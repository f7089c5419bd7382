"""Figure checks shared by the diagram tests: every text a reader sees, and that each stays at
9 pt or more, on the page and clear of the others."""
import io

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from infra_lab.figures import MAX_WIDTH_IN, MIN_FONT_PT


def shown_texts(figure) -> list[Text]:
    """Every text a reader sees: the figure's and each axes' texts, titles, axis labels, the major
    and minor tick labels inside the limits (matplotlib keeps, but does not draw, those beyond)
    and the legends' entries."""
    found = list(figure.texts)
    for ax in figure.axes:
        for loc in ("left", "center", "right"):
            title = ax.get_title(loc=loc)
            if title:
                found += figure.findobj(lambda a, t=title: isinstance(a, Text) and a.get_text() == t)
        found += [ax.xaxis.label, ax.yaxis.label, *ax.texts] if ax.axison else list(ax.texts)
        if ax.get_legend() is not None:
            found += ax.get_legend().get_texts()
        for axis, limits, index in ((ax.xaxis, ax.get_xlim(), 0), (ax.yaxis, ax.get_ylim(), 1)):
            if not ax.axison:
                continue
            lo, hi = sorted(limits)
            slack = 1e-9 * max(hi - lo, 1.0)
            found += [t for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True)
                      if lo - slack <= t.get_position()[index] <= hi + slack]
    unique = list({id(t): t for t in found}.values())
    return [t for t in unique if t.get_visible() and t.get_text()]


def assert_legible(figure):
    """Every text at least 9 pt, on the page, clear of every other; a value written in a box (same
    gid fields) stays inside it; the figure fits the page's width and renders as SVG."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    shown = shown_texts(figure)
    extents = [Text.get_window_extent(t, renderer) for t in shown]
    page = figure.bbox
    for text, box in zip(shown, extents):
        assert text.get_fontsize() >= MIN_FONT_PT, text
        assert page.x0 - 0.5 <= box.x0 and box.x1 <= page.x1 + 0.5, text
        assert page.y0 - 0.5 <= box.y0 and box.y1 <= page.y1 + 0.5, text
    clashes = [(shown[i].get_text(), shown[j].get_text()) for i in range(len(shown))
               for j in range(i + 1, len(shown)) if extents[i].overlaps(extents[j])]
    assert not clashes
    assert figure.get_figwidth() <= MAX_WIDTH_IN
    svg = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(svg, format="svg")
    return renderer, len(svg.getvalue().encode())
