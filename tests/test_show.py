import json
import re

import pytest

from infra_lab import show, stack
from infra_lab.show import FOLD_LINES
from infra_lab.kernels import gemv, paged_attention


def test_show_renders_highlighted_source_with_its_location():
    shown = show(stack.idle_fraction)
    html = shown._repr_html_()
    assert "infra_lab/stack.py, lines" in html
    assert "idle_fraction" in html and "<span" in html  # highlighted
    assert 'style="' in html  # inline styles: the static site needs no extra CSS
    assert repr(shown).startswith("# infra_lab/stack.py, lines")
    assert "def idle_fraction" in shown.code


def test_show_reaches_through_numba_dispatchers():
    assert "prange" in show(gemv._gemv_rows).code


def test_show_reaches_through_functools_caches():
    code = show(paged_attention._paged_chunks_for).code
    assert code.startswith("@functools.cache") and "def paged_chunks(" in code


def test_show_reaches_through_triton_kernels():
    triton_kernels = pytest.importorskip("infra_lab.kernels.paged_attention_triton")
    code = show(triton_kernels._split_kernel).code
    assert code.startswith("@triton.jit") and "def _split_kernel(" in code


def test_show_lines_match_the_file():
    shown = show(stack.ttft_tpot)
    lines = open(stack.__file__).read().splitlines()
    assert lines[shown.first_line - 1].startswith("def ttft_tpot")
    assert shown.code.rstrip("\n").splitlines()[-1] == lines[shown.last_line - 1]


def test_show_refuses_code_outside_the_package():
    with pytest.raises(ValueError, match="infra_lab code only"):
        show(json.dumps)


def test_show_refuses_objects_without_source():
    with pytest.raises(TypeError, match="got 3 of type int"):
        show(3)


def test_short_listings_show_whole():
    shown = show(stack.idle_fraction)
    assert shown.last_line - shown.first_line + 1 <= FOLD_LINES
    assert "<details" not in shown._repr_html_()


def test_long_listings_fold_whole_without_a_pick():
    folded = show(paged_attention._paged_chunks_for)
    length = folded.whole.last_line - folded.whole.first_line + 1
    assert length > FOLD_LINES and folded.shown is None
    html = folded._repr_html_()
    assert html.startswith("<details") and f"All {length} lines" in html


def test_a_pick_shows_its_lines_and_folds_the_rest():
    folded = show(paged_attention._paged_chunks_for, lines=("def paged_chunks(", "for "))
    whole, part = folded.whole, folded.shown
    file_lines = open(paged_attention.__file__).read().splitlines()
    assert file_lines[part.first_line - 1].lstrip().startswith("def paged_chunks(")
    assert "for " in file_lines[part.last_line - 1]
    assert whole.first_line <= part.first_line <= part.last_line <= whole.last_line
    assert part.title in folded._repr_html_() and "<details" in folded._repr_html_()
    assert repr(folded) == repr(part)


def test_a_pick_that_matches_nothing_is_named():
    with pytest.raises(ValueError, match="no line contains 'no such text'"):
        show(stack.idle_fraction, lines=("no such text", "return"))
    with pytest.raises(ValueError, match="contains 'no such end'"):
        show(stack.idle_fraction, lines=("def idle_fraction", "no such end"))


def test_listings_wrap_under_a_hanging_indent_instead_of_running_past_the_page():
    shown = show(stack.idle_fraction)
    html = shown._repr_html_()
    assert "white-space:pre-wrap" in html and 'id="L-' not in html
    hangs = [int(h) for h in re.findall(r"padding-left:(\d+)ch;text-indent:-\1ch", html)]
    lines = shown.code.splitlines()
    assert hangs == [len(line) - len(line.lstrip(" ")) + 4 for line in lines]
