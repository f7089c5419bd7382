import json

import pytest

from infra_lab import show, stack
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
