"""Explorers: a chapter's key trade-off behind sliders, that still shows on the static site.

With Jupyter Book 1 a plain `ipywidgets.interact` cell renders nothing on the built page, not
even the figure it drew. `explorer` therefore draws the default figure as an ordinary output
first, says how to run it live, and only then adds the controls and a live view.
"""
from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

LIVE_NOTE = (
    "*Explorer.* The figure below uses the default settings. The sliders under it need a "
    "running Python kernel: open this page on Colab or Binder (the rocket button at the top) "
    "or in local Jupyter, run all cells, and move them; the live view redraws underneath."
)


def explorer(draw: Callable[..., plt.Figure], **controls: widgets.ValueWidget) -> None:
    """Show `draw(**defaults)` as a plain figure, then controls that redraw a live copy."""
    if not controls:
        raise ValueError("explorer needs at least one control, e.g. batch=IntSlider(...)")
    display(Markdown(LIVE_NOTE))
    figure = draw(**{name: control.value for name, control in controls.items()})
    display(figure)
    plt.close(figure)
    live = widgets.Output()

    def redraw(change: object = None) -> None:
        with live:
            live.clear_output(wait=True)
            figure = draw(**{name: control.value for name, control in controls.items()})
            display(figure)
            plt.close(figure)

    for control in controls.values():
        control.observe(redraw, names="value")
    display(widgets.VBox([*controls.values(), live]))
