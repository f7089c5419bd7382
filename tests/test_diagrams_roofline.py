"""The roofline diagram is drawn from the devices and ops it is given."""
import dataclasses
import io

import matplotlib
import pytest
from hypothesis import given, settings, strategies as st

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from infra_lab import hardware, roofline  # noqa: E402
from infra_lab.diagrams import roofline as diagram  # noqa: E402

H200 = hardware.get("H200")
CPU = hardware.Device("a CPU", {"fp32": 50e9}, 10e9, 0.0, "test")
OPS = {"triad": roofline.elementwise(2**20, "fp32", 2, 2),
       "decode GEMV": roofline.gemv(4096, 4096, "bf16"),
       "matmul 1024": roofline.gemm(1024, 1024, 1024, "bf16")}


def svg(fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    plt.close(fig)
    return buffer.getvalue()


def texts(fig) -> set[str]:
    return {t.get_text() for ax in fig.axes for t in ax.texts} | {
        t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}


def markers(fig) -> list:
    ax = fig.axes[0]
    return [line for line in ax.get_lines() if line.get_gid()]


def test_each_roof_is_named_with_its_figures_and_ridge():
    fig = diagram.draw([(CPU, "fp32"), (H200, "bf16")], OPS)
    found = texts(fig)
    assert "a CPU, fp32: 50 GFLOP/s, 10 GB/s, ridge 5 FLOP/B" in found
    assert "H200, bf16: 989 TFLOP/s, 4.8 TB/s, ridge 206 FLOP/B" in found
    assert set(OPS) <= found
    plt.close(fig)


def test_changing_a_device_bandwidth_changes_the_picture():
    faster = dataclasses.replace(H200, memory_bandwidth=2 * H200.memory_bandwidth)
    before = diagram.draw([(H200, "bf16")], OPS)
    after = diagram.draw([(faster, "bf16")], OPS)
    assert "H200, bf16: 989 TFLOP/s, 9.6 TB/s, ridge 103 FLOP/B" in texts(after)
    heights = [line.get_ydata()[0] for line in markers(before)]
    doubled = [line.get_ydata()[0] for line in markers(after)]
    assert doubled[:2] == pytest.approx([2 * h for h in heights[:2]])  # memory-bound ops
    assert svg(before) != svg(after)


def test_changing_an_op_intensity_moves_it():
    moved = {**OPS, "decode GEMV": roofline.gemm(4096, 16, 4096, "bf16")}  # a batch of 16
    before = diagram.draw([(H200, "bf16")], OPS)
    after = diagram.draw([(H200, "bf16")], moved)
    x = {line.get_gid(): line.get_xdata()[0] for line in markers(after)}
    assert x["decode GEMV on H200, memory-bound"] == pytest.approx(moved["decode GEMV"].intensity)
    assert svg(before) != svg(after)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="need at least one roof and one op; got 0 and 3"):
        diagram.draw([], OPS)
    with pytest.raises(ValueError, match="at most 4 roofs; got 5"):
        diagram.draw([(H200, "bf16")] * 5, OPS)


devices = st.builds(lambda bw, peak: hardware.Device("dev", {"bf16": peak}, bw, 0.0, "t"),
                    st.floats(1e9, 1e13), st.floats(1e10, 1e16))
op_sets = st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 4096)),
                   min_size=1, max_size=6, unique=True)


@settings(max_examples=15, deadline=None)
@given(device=devices, shapes=op_sets)
def test_every_op_sits_on_the_roof_filled_iff_compute_bound_and_labels_do_not_overlap(
        device, shapes):
    ops = {f"gemm {m}x{n}x{k}": roofline.gemm(m, n, k, "bf16") for m, n, k in shapes}
    fig = diagram.draw([(device, "bf16")], ops)
    ridge = roofline.ridge_point(device, "bf16")
    for line in markers(fig):
        label = line.get_gid().split(" on ")[0]
        intensity = ops[label].intensity
        assert line.get_ydata()[0] == pytest.approx(
            roofline.attainable_flops(intensity, device, "bf16"))
        filled = line.get_markerfacecolor() != "white"
        assert filled == (intensity >= ridge) == line.get_gid().endswith("compute-bound")
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    frame = ax.get_window_extent(renderer)
    assert len(boxes) == len(ops)
    for i, box in enumerate(boxes):
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1
        assert not any(box.overlaps(other) for other in boxes[i + 1:])
    plt.close(fig)
