"""Chapter 00's references against brute-force models."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from infra_lab import stack

times = st.floats(-5, 15, allow_nan=False)


@given(intervals=st.lists(st.tuples(times, st.floats(0, 5)), max_size=12),
       start=st.floats(0, 5), length=st.floats(0.1, 5))
def test_idle_fraction_matches_a_fine_grid(intervals, start, length):
    intervals = [(begin, begin + duration) for begin, duration in intervals]
    end = start + length
    grid = np.linspace(start, end, 20001)[:-1] + length / 40000  # cell midpoints
    busy = np.zeros(grid.shape, bool)
    for begin, finish in intervals:
        busy |= (grid >= begin) & (grid < finish)
    assert stack.idle_fraction(intervals, start, end) == pytest.approx(1 - busy.mean(), abs=2e-4)


def test_idle_fraction_rejects_an_empty_window():
    with pytest.raises(ValueError, match=r"end_s > start_s; got \[2, 2\]"):
        stack.idle_fraction([], 2, 2)


@given(arrival=st.floats(0, 100), gaps=st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_ttft_tpot_from_the_definitions(arrival, gaps):
    tokens = list(arrival + np.cumsum(gaps))
    ttft, tpot = stack.ttft_tpot(arrival, tokens)
    assert ttft == pytest.approx(tokens[0] - arrival)
    between = np.diff(tokens)
    assert tpot == pytest.approx(between.mean() if len(between) else 0.0, abs=1e-9)


def test_ttft_tpot_needs_a_token():
    with pytest.raises(ValueError, match="at least one output token"):
        stack.ttft_tpot(0.0, [])


@given(n_params=st.floats(1, 1e12), batch=st.integers(1, 4096),
       bytes_per_param=st.sampled_from([0.5, 1, 2, 4]))
def test_decode_intensity_is_two_flops_per_weight_per_token(n_params, batch, bytes_per_param):
    assert math.isclose(stack.decode_intensity(n_params, batch, bytes_per_param),
                        2 * batch / bytes_per_param, rel_tol=1e-12)


def test_decode_timeline_records_ordered_kernels_inside_the_window():
    intervals, start, end = stack.decode_timeline(16, n_layers=3, steps=4)
    assert len(intervals) == 12
    assert all(start <= b <= e <= end for b, e in intervals)
    assert all(e1 <= b2 for (_, e1), (b2, _) in zip(intervals, intervals[1:]))
    with pytest.raises(ValueError, match="got 0, 3, 4"):
        stack.decode_timeline(0, n_layers=3, steps=4)


def test_every_chapter_of_the_plan_sits_on_one_layer():
    chapters = [c for layer in stack.STACK for c in layer.chapters]
    assert sorted(chapters) == [f"{n:02d}" for n in range(12)]


@given(n_layers=st.integers(1, 6), steps=st.integers(1, 6),
       gaps=st.lists(st.floats(0, 1), min_size=74, max_size=74))
def test_step_windows_tile_the_run_and_each_holds_its_kernels(n_layers, steps, gaps):
    edges = np.cumsum(gaps[:2 * n_layers * steps + 2])  # start, begin, end, ..., end of window
    start, end = edges[0], edges[-1]
    intervals = list(zip(edges[1:-1:2], edges[2:-1:2]))
    windows = stack.step_windows(intervals, start, end, n_layers)
    assert len(windows) == steps
    assert windows[0][0] == start and windows[-1][1] == end
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    for k, (begin, finish) in enumerate(windows):
        for kernel_begin, kernel_end in intervals[k * n_layers:(k + 1) * n_layers]:
            assert begin <= kernel_begin <= kernel_end <= finish


def test_step_windows_of_a_real_timeline():
    intervals, start, end = stack.decode_timeline(16, n_layers=3, steps=4)
    windows = stack.step_windows(intervals, start, end, 3)
    assert len(windows) == 4 and windows[0][0] == start and windows[-1][1] == end
    with pytest.raises(ValueError, match="got 12 intervals and n_layers=5"):
        stack.step_windows(intervals, start, end, 5)
