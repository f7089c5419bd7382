"""The explorer's static face: every setting of its selection controls is drawn, keyed, and
switched by the page's script; numeric sliders are named as fixed; budgets are enforced."""
import html
import json
import re
import sys
import types

import ipywidgets as widgets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from infra_lab import explore  # noqa: E402


def draw(batch, dtype="bf16", seed=0):
    figure, ax = plt.subplots(figsize=(2, 1.5))
    ax.set_title(f"batch={batch} dtype={dtype} seed={seed}")
    ax.plot([0, 1], [0, batch])
    return figure


def frames_of(html):
    payload = re.search(r'class="infra-lab-explorer-frames">(.*?)</script>', html, re.S).group(1)
    return json.loads(payload.replace("<\\/", "</"))


def test_static_face_draws_every_setting_under_its_indices():
    controls = {"batch": widgets.SelectionSlider(options=[1, 8, 64], value=8),
                "dtype": widgets.Dropdown(options=["fp32", "bf16"], value="bf16")}
    axes = explore.static_axes(controls)
    assert [(a.name, a.default) for a in axes] == [("batch", 1), ("dtype", 1)]
    frames = explore.precompute(draw, controls, axes)
    assert len(frames) == 6
    for i, batch in enumerate([1, 8, 64]):
        for j, dtype in enumerate(["fp32", "bf16"]):
            assert f"batch={batch} dtype={dtype} seed=0" in frames[f"{i},{j}"]


def test_numeric_sliders_stay_live_and_are_named_as_fixed():
    controls = {"batch": widgets.SelectionSlider(options=[1, 8], value=1),
                "seed": widgets.IntSlider(value=3, min=0, max=9, description="seed")}
    axes = explore.static_axes(controls)
    assert [a.name for a in axes] == ["batch"]
    frames = explore.precompute(draw, controls, axes)
    assert all("seed=3" in frame for frame in frames.values())
    html = explore.static_html(frames, axes, {"seed": 3})
    assert "Fixed here at seed = 3" in html and 'data-axis="seed"' not in html


def test_page_carries_frames_controls_and_script():
    controls = {"batch": widgets.SelectionSlider(options=[1, 8, 64], value=8,
                                                 description="batch")}
    axes = explore.static_axes(controls)
    frames = explore.precompute(draw, controls, axes)
    html = explore.static_html(frames, axes, {})
    assert frames_of(html) == frames
    assert 'type="range"' in html and 'value="1"' in html and 'data-key="1"' in html
    assert explore.SCRIPT in html


def test_a_frame_that_closes_a_script_tag_is_escaped():
    controls = {"x": widgets.Dropdown(options=["a"], value="a")}
    axes = explore.static_axes(controls)
    html = explore.static_html({"0": "<svg></script></svg>"}, axes, {})
    assert html.count("</script>") == 2  # the frames' and the switcher's, nothing inside
    assert frames_of(html) == {"0": "<svg></script></svg>"}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=6, unique=True), st.data())
def test_each_control_offers_every_option_and_starts_at_the_value(options, data):
    value = data.draw(st.sampled_from(options))
    axis = explore.static_axes({"batch": widgets.SelectionSlider(options=options, value=value)})[0]
    assert axis.values == tuple(options) and axis.default == options.index(value)
    control = explore.control_html(axis)
    if len(options) >= 3:  # ordered numbers: a range over the option indices
        assert f'max="{len(options) - 1}"' in control and f'value="{axis.default}"' in control
        assert json.loads(html.unescape(re.search(r'data-labels="([^"]*)"', control).group(1))) \
            == [str(o) for o in options]
    else:
        assert control.count("<option") == len(options)
        assert f'<option value="{axis.default}" selected>' in control


def test_labels_come_from_label_value_pairs():
    control = widgets.Dropdown(options=[("H100 SXM", "h100"), ("laptop", "cpu")], value="cpu")
    axis = explore.static_axes({"device": control})[0]
    assert axis.labels == ("H100 SXM", "laptop") and axis.values == ("h100", "cpu")
    assert axis.default == 1


def test_too_many_settings_are_refused_before_drawing():
    calls = []
    controls = {"a": widgets.Dropdown(options=list(range(9)), value=0),
                "b": widgets.Dropdown(options=list(range(8)), value=0)}
    with pytest.raises(ValueError, match="72 settings .*at most 64"):
        explore.precompute(lambda **kw: calls.append(kw), controls, explore.static_axes(controls))
    assert calls == []


def test_the_byte_budget_is_enforced(monkeypatch):
    monkeypatch.setattr(explore, "MAX_BYTES", 1000)
    controls = {"batch": widgets.Dropdown(options=[1, 2], value=1)}
    with pytest.raises(ValueError, match="passed 1,000 bytes"):
        explore.precompute(draw, controls, explore.static_axes(controls))


def test_explorer_needs_a_control_with_options():
    with pytest.raises(ValueError, match="batch have none"):
        explore.explorer(draw, batch=widgets.IntSlider(value=1))
    with pytest.raises(ValueError, match="at least one control"):
        explore.explorer(draw)


def test_explorer_displays_both_faces(monkeypatch):
    shown = []
    monkeypatch.setattr(explore, "display", lambda obj, raw=False, metadata=None: shown.append(obj))
    explore.explorer(draw, batch=widgets.SelectionSlider(options=[1, 8], value=8),
                     seed=widgets.IntSlider(value=2))
    bundle = shown[-1]
    assert set(bundle) == {"text/plain", "text/html", explore.WIDGET_VIEW}
    assert len(frames_of(bundle["text/html"])) == 2
    assert bundle[explore.WIDGET_VIEW]["model_id"]


def test_the_live_face_redraws_when_a_control_moves(monkeypatch):
    monkeypatch.setattr(explore, "display", lambda *a, **k: None)
    batch = widgets.SelectionSlider(options=[1, 8, 64], value=8)
    seed = widgets.IntSlider(value=2, min=0, max=9)
    explore.explorer(draw, batch=batch, seed=seed)
    live = explore.LIVE[-1]
    assert live.view.children[:2] == (batch, seed) and live.draws == 1
    batch.value = 64
    seed.value = 5
    assert live.draws == 3 and live.drawn_with == {"batch": 64, "seed": 5}


def test_a_draw_that_fails_does_not_count_as_a_redraw(monkeypatch):
    monkeypatch.setattr(explore, "display", lambda *a, **k: None)

    def fragile(batch, seed):  # numeric sliders are live-only: the static face draws seed 2
        if seed == 5:
            raise ValueError("no figure for seed 5")
        return draw(batch, seed=seed)
    seed = widgets.IntSlider(value=2, min=0, max=9)
    explore.explorer(fragile, batch=widgets.SelectionSlider(options=[1, 8], value=8), seed=seed)
    live = explore.LIVE[-1]
    with pytest.raises(ValueError, match="no figure for seed 5"):  # IPython's Output swallows it
        seed.value = 5
    assert live.draws == 1 and live.drawn_with == {"batch": 8, "seed": 2}


class FakeColabOutput(types.ModuleType):
    """google.colab.output as far as widgets go: enable_custom_widget_manager sets the URL."""

    def __init__(self):
        super().__init__("google.colab.output")
        self._widgets = types.SimpleNamespace(_installed_url=None)
        self.enabled = 0

    def enable_custom_widget_manager(self):
        self.enabled += 1
        self._widgets._installed_url = "https://ssl.gstatic.com/colaboratory-static/widgets/m.js"


@pytest.fixture
def on_colab(monkeypatch):
    output = FakeColabOutput()
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    return output


def shown_metadata(monkeypatch):
    shown = []
    monkeypatch.setattr(explore, "display",
                        lambda obj, raw=False, metadata=None: shown.append((obj, metadata)))
    explore.explorer(draw, batch=widgets.SelectionSlider(options=[1, 8], value=8))
    return shown[-1]


def test_on_colab_under_ipywidgets_8_the_view_names_colabs_widget_manager(monkeypatch, on_colab):
    monkeypatch.setattr(explore, "WIDGETS_MAJOR", 8)
    bundle, metadata = shown_metadata(monkeypatch)
    assert bundle[explore.WIDGET_VIEW]["model_id"]
    url = metadata[explore.WIDGET_VIEW]["colab"]["custom_widget_manager"]["url"]
    assert url == on_colab._widgets._installed_url and on_colab.enabled == 1
    shown_metadata(monkeypatch)
    assert on_colab.enabled == 1  # switched on once per kernel


def test_on_colab_under_ipywidgets_7_and_off_colab_nothing_is_switched_on(monkeypatch, on_colab):
    monkeypatch.setattr(explore, "WIDGETS_MAJOR", 7)
    assert shown_metadata(monkeypatch)[1] == {} and on_colab.enabled == 0
    monkeypatch.delitem(sys.modules, "google.colab")
    monkeypatch.setattr(explore, "WIDGETS_MAJOR", 8)
    assert shown_metadata(monkeypatch)[1] == {} and on_colab.enabled == 0
