"""diagrams.checkpointing draws each trace's live bytes as given, marks where backward begins, the
end of the forward pass and the peak with its value, and stays legible; a trace that cannot be a
step is refused by name."""
import numpy as np
import pytest

from _figures import assert_legible
from infra_lab.diagrams import checkpointing as diagram
from infra_lab.parallel.checkpointing import Trace

TRACES = {False: Trace([1_000_000, 5_000_000, 9_000_000, 4_000_000, 3_000_000], 3),
          True: Trace([1_000_000, 2_000_000, 2_500_000, 6_000_000, 3_000_000, 7_500_000, 3_000_000], 3)}


def by_gid(figure) -> dict[str, object]:
    ax = figure.axes[0]
    return {a.get_gid(): a for a in list(ax.lines) + list(ax.texts) if a.get_gid()}


def test_the_traces_are_drawn_as_given_with_their_marks():
    figure = diagram.draw_live_bytes(TRACES)
    assert_legible(figure)
    drawn = by_gid(figure)
    for checkpoint, trace in TRACES.items():
        line = drawn[f"trace:{checkpoint}"]
        assert np.allclose(line.get_ydata(), np.array(trace.live_bytes) / 1e6)
        assert list(drawn[f"backward:{checkpoint}"].get_xdata()) == [trace.backward_from] * 2
        assert list(drawn[f"forward_end:{checkpoint}"].get_ydata()) == [trace.live_bytes[trace.backward_from - 1] / 1e6]
        peak = max(trace.live_bytes)
        assert list(drawn[f"peak:{checkpoint}"].get_xdata()) == [trace.live_bytes.index(peak)]
        assert drawn[f"peak_text:{checkpoint}"].get_text() == f"peak {peak / 1e6:.1f} MB"


@pytest.mark.parametrize("traces, message", [
    ({True: TRACES[True]}, r"keyed False and True; got keys \[True\]"),
    ({False: TRACES[False], True: Trace([1, 2], 2)}, "checkpoint=True needs operations on both sides of its "
                                                   "backward_from; got 2 operations and backward_from 2"),
    ({False: Trace([], 0), True: TRACES[True]}, "got 0 operations"),
])
def test_a_trace_that_is_no_step_is_refused(traces, message):
    with pytest.raises(ValueError, match=message):
        diagram.draw_live_bytes(traces)
