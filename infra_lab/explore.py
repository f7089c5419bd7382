"""Explorers: a chapter's key trade-off behind controls, live in Jupyter and precomputed on the site.

`explorer(draw, **controls)` displays one output with two faces. Jupyter and Colab render the
live face: ipywidgets controls that call `draw` again on every change. The static site has no
kernel, so it renders the other face: every setting of the controls that have a list of options
(Dropdown, SelectionSlider, ToggleButtons) is drawn when the page is built, stored in the page as
SVG, and switched by a few lines of JavaScript shipped inside the output. Numeric sliders stay
live-only; the static face names them with the value they are fixed at, so nothing that needs a
kernel looks live. Build-time sizes are capped so that an explorer adds about 2 MB at most.

The live face runs on ipywidgets 7 and 8. Colab renders ipywidgets 7 (what its runtime ships)
with its own widget manager; under ipywidgets 8 that manager shows nothing, so there the live
face switches on Colab's custom widget manager and names it in the message's metadata, which
is what that front end reads (`colab_metadata`). Elsewhere the metadata is empty.
"""
from __future__ import annotations

import html
import io
import itertools
import json
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

MAX_FRAMES = 64
MAX_BYTES = 2_000_000  # all frames of one explorer, as stored in the page
SCRIPT = (Path(__file__).parent / "explore.js").read_text(encoding="utf-8")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
LABEL_STYLE = "margin:0 1.5em 0.3em 0;white-space:nowrap;display:inline-block"
WIDGETS_MAJOR = int(widgets.__version__.split(".")[0])


@dataclass(frozen=True)
class Axis:
    """One control of the static face: its name, label, option labels and values."""

    name: str
    label: str
    labels: tuple[str, ...]
    values: tuple[Any, ...]
    default: int  # index of the control's value when the page was built


def options_of(control: widgets.ValueWidget) -> list[tuple[str, Any]] | None:
    """(label, value) pairs of a selection widget; None for a numeric slider or a text box."""
    options = getattr(control, "options", None)
    if options is None:
        return None
    if isinstance(options, dict):
        return [(str(label), value) for label, value in options.items()]
    return [(str(o[0]), o[1]) if isinstance(o, tuple) and len(o) == 2 else (str(o), o)
            for o in options]


def static_axes(controls: dict[str, widgets.ValueWidget]) -> list[Axis]:
    """The controls the built page can switch without a kernel: those with a list of options."""
    axes = []
    for name, control in controls.items():
        pairs = options_of(control)
        if pairs is None:
            continue
        values = tuple(value for _, value in pairs)
        if control.value not in values:
            raise ValueError(f"control {name!r} has value {control.value!r}, not one of {values}")
        axes.append(Axis(name, control.description or name, tuple(label for label, _ in pairs),
                         values, values.index(control.value)))
    return axes


def figure_svg(figure: plt.Figure) -> str:
    """The figure as an SVG document, text kept as text so a frame stays small."""
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def precompute(draw: Callable[..., plt.Figure], controls: dict[str, widgets.ValueWidget],
               axes: Sequence[Axis]) -> dict[str, str]:
    """Frames keyed by the option indices of `axes` joined with commas ("2,0"), as SVG."""
    count = 1
    for axis in axes:
        count *= len(axis.values)
    if count > MAX_FRAMES:
        sizes = " x ".join(f"{axis.name} {len(axis.values)}" for axis in axes)
        raise ValueError(f"the static face would draw {count} settings ({sizes}); at most "
                         f"{MAX_FRAMES}: give those controls fewer options")
    fixed = {name: control.value for name, control in controls.items()}
    frames, total = {}, 0
    for indices in itertools.product(*(range(len(axis.values)) for axis in axes)):
        values = {axis.name: axis.values[i] for axis, i in zip(axes, indices)}
        frame = figure_svg(draw(**{**fixed, **values}))
        total += len(frame.encode())
        if total > MAX_BYTES:
            raise ValueError(f"the static face passed {MAX_BYTES:,} bytes after "
                             f"{len(frames) + 1} of {count} settings: draw smaller figures "
                             "or give the controls fewer options")
        frames[",".join(map(str, indices))] = frame
    return frames


def control_html(axis: Axis) -> str:
    """A range input for three or more ordered options, a select otherwise."""
    label = html.escape(axis.label)
    current = html.escape(axis.labels[axis.default])
    attrs = f'data-axis="{html.escape(axis.name)}" aria-label="{label}"'
    if len(axis.values) >= 3 and all(isinstance(v, (int, float)) for v in axis.values):
        names = html.escape(json.dumps(axis.labels))
        return (f'<label style="{LABEL_STYLE}">{label} <input type="range" min="0" max="{len(axis.values) - 1}" '
                f'step="1" value="{axis.default}" {attrs} data-labels="{names}"> '
                f'<output>{current}</output></label>')
    options = "".join(
        f'<option value="{i}"{" selected" if i == axis.default else ""}>{html.escape(name)}</option>'
        for i, name in enumerate(axis.labels))
    return f'<label style="{LABEL_STYLE}">{label} <select {attrs}>{options}</select></label>'


def static_html(frames: dict[str, str], axes: Sequence[Axis],
                fixed: dict[str, Any]) -> str:
    """The static face: controls, the frames as JSON, and the script that switches them."""
    element_id = f"infra-lab-explorer-{uuid.uuid4().hex[:12]}"
    key = ",".join(str(axis.default) for axis in axes)
    note = (f"Precomputed when this page was built for {len(frames)} settings: move the "
            "controls to switch between them.")
    if fixed:
        named = ", ".join(f"{html.escape(name)} = {html.escape(str(value))}"
                          for name, value in fixed.items())
        note += (f" Fixed here at {named}; those need a running Python kernel (the rocket "
                 "button at the top opens this page on Colab or Binder).")
    payload = json.dumps(frames).replace("</", "<\\/")
    return (
        f'<div class="infra-lab-explorer" id="{element_id}">'
        f'<p class="infra-lab-explorer-note"><em>Explorer.</em> {note}</p>'
        f'<div class="infra-lab-explorer-controls">'
        f'{"".join(control_html(axis) for axis in axes)}</div>'
        f'<img class="infra-lab-explorer-frame" alt="explorer figure" data-key="{key}" '
        f'style="max-width:100%;height:auto">'
        f'<script type="application/json" class="infra-lab-explorer-frames">{payload}</script>'
        f"<script>{SCRIPT}</script></div>"
    )


@dataclass
class Live:
    """A live face built in this kernel: its widget, its controls and what it drew."""

    view: widgets.VBox
    controls: dict[str, widgets.ValueWidget]
    draws: int = 0  # figures drawn into the output: one when built, one per change
    drawn_with: dict[str, Any] = field(default_factory=dict)  # the values of the last draw


LIVE: list[Live] = []  # every live face built in this kernel, newest last (drive one from Python)


def live_view(draw: Callable[..., plt.Figure],
              controls: dict[str, widgets.ValueWidget]) -> Live:
    """The live face: the controls over an output that `draw` refills on every change."""
    output = widgets.Output()
    live = Live(widgets.VBox([*controls.values(), output]), controls)

    def redraw(change: object = None) -> None:
        values = {name: control.value for name, control in controls.items()}
        with output:  # under IPython, Output shows a failed draw's traceback and swallows it
            output.clear_output(wait=True)
            figure = draw(**values)
            display(figure)
            plt.close(figure)
            live.draws += 1  # so a draw counts only once its figure is shown
            live.drawn_with = values

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    LIVE.append(live)
    return live


def colab_metadata() -> dict:
    """The display metadata Colab's front end needs to render a widget view; {} elsewhere.

    On Colab under ipywidgets 8 this switches on Colab's custom widget manager (once; the
    call is Colab's own) and names its URL under the widget view's metadata, as Colab's
    display hook would. Under ipywidgets 7 Colab's built-in manager renders the view as is.
    """
    colab = sys.modules.get("google.colab")
    if colab is None or WIDGETS_MAJOR < 8:
        return {}
    from google.colab import output  # noqa: PLC0415 (Colab's runtime only)

    url = getattr(getattr(output, "_widgets", None), "_installed_url", None)
    if url is None:
        output.enable_custom_widget_manager()
        url = getattr(getattr(output, "_widgets", None), "_installed_url", None)
    if url is None:
        return {}
    return {WIDGET_VIEW: {"colab": {"custom_widget_manager": {"url": url}}}}


def explorer(draw: Callable[..., plt.Figure], **controls: widgets.ValueWidget) -> None:
    """Display `draw` behind `controls`: live under a kernel, precomputed on the static site.

    `draw(**values)` returns a matplotlib figure. Selection controls (with `options`) are
    switched on the static site; numeric sliders are fixed there at their value.
    """
    if not controls:
        raise ValueError("explorer needs at least one control, e.g. "
                         "batch=SelectionSlider(options=[1, 8, 64])")
    axes = static_axes(controls)
    if not axes:
        raise ValueError(f"explorer needs a control with options for the static site; "
                         f"{', '.join(controls)} have none: use a Dropdown or SelectionSlider")
    frames = precompute(draw, controls, axes)
    fixed = {controls[name].description or name: control.value
             for name, control in controls.items() if name not in {a.name for a in axes}}
    live = live_view(draw, controls)
    bundle = {
        "text/plain": f"Explorer over {', '.join(controls)} ({len(frames)} settings precomputed)",
        "text/html": static_html(frames, axes, fixed),
        WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": live.view.model_id},
    }
    # one display_data message with both faces: a front end with a widget manager shows the
    # live one, the built page the static one
    display(bundle, raw=True, metadata=colab_metadata())
