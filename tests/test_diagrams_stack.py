"""The stack diagram is drawn from the layers it is given: change them, the picture changes."""
import dataclasses
import string

import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import stack
from infra_lab.diagrams import stack as diagram


def texts(figure):
    return [t.get_text() for ax in figure.axes for t in ax.texts]


def boxes(figure, prefix):
    """{gid: (x0, y0, x1, y1)} of the patches whose gid starts with `prefix`."""
    found = {}
    for patch in figure.axes[0].patches:
        gid = patch.get_gid() or ""
        if gid.startswith(prefix):
            x, y, w, h = patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()
            found[gid] = (x, y, x + w, y + h)
    return found


def test_every_layer_and_chapter_of_the_stack_is_drawn():
    drawn = texts(diagram.draw())
    for layer in stack.STACK:
        assert layer.name in drawn
        for chapter in layer.chapters:
            assert diagram.chip_label(chapter, stack.CHAPTERS) in drawn


def test_chapters_to_come_are_marked_and_are_not_in_the_book(root):
    drawn = texts(diagram.draw())
    for chapter in stack.CHAPTERS:
        written = any((root / "book").glob(f"ch{chapter}_*.ipynb"))
        assert written != (chapter in stack.PLANNED), chapter  # update PLANNED when a chapter lands
        assert (f"{chapter}, to come\n{stack.CHAPTERS[chapter]}" in drawn) == (chapter in stack.PLANNED)


def test_every_chapter_has_a_name_for_its_chip():
    assert sorted(stack.CHAPTERS) == sorted(c for layer in stack.STACK for c in layer.chapters)


def test_changing_the_layers_changes_the_picture():
    before = texts(diagram.draw())
    moved = list(stack.STACK)
    moved[0] = dataclasses.replace(moved[0], name="Routing", chapters=("06", "12"))
    after = texts(diagram.draw(moved))
    assert after != before
    assert "Routing" in after and "Serving and orchestration" not in after
    assert "12" in after  # a chapter without a short name gets its number alone
    fewer = texts(diagram.draw(stack.STACK[1:]))
    assert stack.STACK[0].name not in fewer and len(fewer) < len(before)


def test_an_empty_stack_is_refused():
    with pytest.raises(ValueError, match="at least one layer; got none"):
        diagram.draw(())


words = st.text(alphabet=string.ascii_letters + " ", min_size=1, max_size=24).map(str.strip)
layers = st.lists(
    st.builds(stack.Layer, name=words.filter(bool),
              examples=st.lists(words, max_size=12).map(" ".join),
              chapters=st.lists(st.sampled_from(sorted(stack.CHAPTERS) + ["12", "A"]),
                                max_size=6, unique=True).map(tuple)),
    min_size=1, max_size=7)


@settings(max_examples=25, deadline=None)
@given(layers=layers)
def test_bands_follow_the_given_order_and_hold_their_chips(layers):
    figure = diagram.draw(layers)
    width, height = figure.get_size_inches()
    bands = boxes(figure, "layer ")
    assert len(bands) == len(layers)
    tops = [bands[f"layer {i}"][3] for i in range(len(layers))]
    assert tops == sorted(tops, reverse=True)  # the first layer at the top
    for i in range(len(layers) - 1):  # bands do not overlap
        assert bands[f"layer {i + 1}"][3] <= bands[f"layer {i}"][1]
    assert 0 <= bands[f"layer {len(layers) - 1}"][1] and tops[0] <= height
    for i, layer in enumerate(layers):
        chips = boxes(figure, "chapter ")
        mine = {gid: box for gid, box in chips.items() if gid.endswith(f"of layer {i}")}
        assert sorted(gid.split()[1] for gid in mine) == sorted(layer.chapters)
        x0, y0, x1, y1 = bands[f"layer {i}"]
        for cx0, cy0, cx1, cy1 in mine.values():
            assert x0 <= cx0 and cx1 <= x1 and y0 <= cy0 and cy1 <= y1
