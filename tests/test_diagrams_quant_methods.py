"""Chapter 08's diagrams of GPTQ, AWQ and SmoothQuant draw what the package computes: the GPTQ
panels are the weights as gptq.column_update left them (and the loop ends in gptq.gptq's
matrix), AWQ's points and columns are awq_search's scales and the errors of the two matrices,
SmoothQuant's are smoothing_scales applied to X and W. Every text keeps 9 pt, stays on the
page and clear of the others; what cannot be drawn is refused by name."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _figures import assert_legible as shared_assert_legible, shown_texts
from infra_lab.diagrams import quant_methods as diagram
from infra_lab.quant import awq, formats, gptq, smoothquant
from infra_lab.quant.matmul import QuantizedMatrix


def correlated(rng, n_samples, n_in):
    """(n_samples, n_in) float32 with correlated channels of different sizes."""
    mixing = rng.standard_normal((n_in, n_in)) + 2 * np.eye(n_in)
    return (rng.standard_normal((n_samples, n_in)) @ mixing * rng.uniform(0.2, 3, n_in)).astype(np.float32)


def with_outliers(rng, n_samples, n_in, loud=(3, 17), size=60.0):
    """(n_samples, n_in) float32 whose channels `loud` are `size` times louder than the rest."""
    inputs = rng.standard_normal((n_samples, n_in)) * rng.uniform(0.5, 1.5, n_in)
    inputs[:, list(loud)] *= size
    return inputs.astype(np.float32)


def by_gid(figure, prefix):
    return [a for ax in figure.axes for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def assert_legible(figure):
    """A title, and the shared checks: every text at least 9 pt, on the page, clear of the others."""
    assert figure.get_suptitle()
    shared_assert_legible(figure)
    assert len(shown_texts(figure)) > 10  # titles, labels and ticks were found


# ---- GPTQ ----------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4, 8]), group=st.sampled_from([None, 4]),
       n_out=st.integers(1, diagram.MAX_OUTPUTS), n_dead=st.integers(0, 1))
def test_the_steps_are_column_updates_that_end_in_gptqs_matrix(seed, bits, group, n_out, n_dead):
    rng = np.random.default_rng(seed)
    n_in = 12
    weights = rng.standard_normal((n_in, n_out)).astype(np.float32)
    inputs = correlated(rng, 40, n_in)
    inputs[:, rng.choice(n_in, n_dead, replace=False)] = 0
    first = int(rng.integers(0, n_in - 1))
    columns = (first, first + 1)
    steps = diagram.gptq_steps(weights, inputs, bits, group, columns)
    reference = gptq.gptq(weights, inputs, bits, group)
    assert np.array_equal(steps.matrix.values(), reference.values())
    assert np.array_equal(steps.matrix.scales, reference.scales)
    # a rounded input keeps its quantized value: each snapshot holds the final codes up to its input
    final = formats.dequantize_int(reference.values(), reference.scales, group)  # (n_out, n_in)
    for column, snapshot in zip(columns, steps.snapshots):
        assert np.array_equal(snapshot[:, :column + 1], final[:, :column + 1].astype(np.float32))
    # the second snapshot is the package's column_update applied to the first
    h, dead = gptq.hessian(inputs)
    after = gptq.column_update(steps.snapshots[0], gptq.inverse_cholesky(h), first + 1, reference.scales, group,
                               bits)
    assert np.array_equal(after.weights_t, steps.snapshots[1])
    assert np.array_equal(after.error, steps.errors[1])
    assert np.array_equal(steps.original_t[:, dead], np.zeros((n_out, int(dead.sum())), np.float32))


def test_each_panel_is_the_change_from_the_original_weights():
    rng = np.random.default_rng(0)
    weights, inputs = rng.standard_normal((12, 8)).astype(np.float32), correlated(rng, 48, 12)
    steps = diagram.gptq_steps(weights, inputs, 3, None, (0, 4, 8))
    figure = diagram.draw_gptq_steps(steps)
    images = {im.get_gid(): im.get_array() for ax in figure.axes for im in ax.get_images()}
    assert set(images) == {"change:0", "change:4", "change:8"}
    for column, snapshot in zip(steps.columns, steps.snapshots):
        assert np.array_equal(np.asarray(images[f"change:{column}"]), snapshot - weights.T)
        states = [g.get_gid().split(":")[-1] for g in sorted(by_gid(figure, f"strip:{column}:"),
                                                             key=lambda p: p.get_x())]
        assert states == ["rounded"] * column + ["current"] + ["float"] * (11 - column)
        frame, = by_gid(figure, f"frame:{column}")
        assert frame.get_x() == column - 0.5
    # the feedback moved the inputs still float: some of them differ from the original weights
    assert np.abs(steps.snapshots[0][:, 1:] - weights.T[:, 1:]).max() > 0
    assert "GPTQ at 3 bits" in figure.get_suptitle()
    assert_legible(figure)


@pytest.mark.parametrize("n_in, n_out, group, columns", [(4, 1, None, (0,)), (2, 3, 2, (0, 1)),
                                                         (16, 12, 4, (0, 5, 10, 15))])
def test_the_smallest_and_largest_steps_stay_legible(n_in, n_out, group, columns):
    rng = np.random.default_rng(n_in)
    steps = diagram.gptq_steps(rng.standard_normal((n_in, n_out)), correlated(rng, 3 * n_in, n_in), 4, group,
                               columns)
    figure = diagram.draw_gptq_steps(steps)
    assert len(figure.axes) == len(columns) + 1  # and the colour scale
    assert_legible(figure)


def test_gptq_steps_refuse_what_they_cannot_draw_by_name():
    rng = np.random.default_rng(1)
    weights, inputs = rng.standard_normal((12, 8)).astype(np.float32), correlated(rng, 48, 12)
    with pytest.raises(ValueError, match=r"columns must be 1 to 4 increasing inputs in \[0, 11\]; got \(3, 12\)"):
        diagram.gptq_steps(weights, inputs, 4, None, (3, 12))
    with pytest.raises(ValueError, match=r"got \(4, 2\)"):
        diagram.gptq_steps(weights, inputs, 4, None, (4, 2))
    with pytest.raises(ValueError, match=r"got \(\)"):
        diagram.gptq_steps(weights, inputs, 4, None, ())
    with pytest.raises(ValueError, match=r"at most 16 inputs and 12 outputs.*got W of shape \(32, 8\)"):
        diagram.gptq_steps(np.ones((32, 8)), np.ones((4, 32)), 4)
    with pytest.raises(ValueError, match="bits"):
        diagram.gptq_steps(weights, inputs, 5)
    with pytest.raises(ValueError, match=r"calibration inputs must be \(n_samples, 12\)"):
        diagram.gptq_steps(weights, inputs[:, :6], 4)
    with pytest.raises(ValueError, match="need the GptqSteps of gptq_steps"):
        diagram.draw_gptq_steps(weights)


# ---- AWQ -----------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([3, 4]), group=st.sampled_from([None, 16]),
       salient=st.integers(1, diagram.MAX_SALIENT))
def test_the_awq_view_is_the_search_and_the_two_matrices(seed, bits, group, salient):
    rng = np.random.default_rng(seed)
    weights, inputs = rng.standard_normal((32, 6)).astype(np.float32), with_outliers(rng, 64, 32)
    view = diagram.awq_scaling(weights, inputs, bits, group, grid=10, salient=salient)
    search = awq.awq_search(weights, inputs, bits, group, 10)
    assert np.array_equal(view.search.errors, search.errors) and view.search.best_alpha == search.best_alpha
    assert np.array_equal(view.scales, awq.activation_scales(inputs, search.best_alpha))
    mean_abs = np.abs(inputs.astype(np.float64)).mean(0)
    assert np.array_equal(view.salient, np.argsort(-mean_abs, kind="stable")[:salient])
    for matrix, errors in ((QuantizedMatrix.quantize(weights, bits, group), view.rtn_error),
                           (awq.awq(weights, inputs, bits, group, 10, clip=False), view.awq_error)):
        difference = weights.astype(np.float64) - matrix.dequantize()
        for j in range(32):  # channel j alone: ||outer(x_j, w_j - q_j)|| / ||X W||
            alone = np.linalg.norm(np.outer(inputs[:, j], difference[j])) / np.linalg.norm(inputs @ weights.astype(
                np.float64))
            assert errors[j] == pytest.approx(alone, rel=1e-9, abs=1e-15)


def test_the_awq_figure_draws_the_views_numbers():
    rng = np.random.default_rng(2)
    weights, inputs = rng.standard_normal((32, 6)).astype(np.float32), with_outliers(rng, 64, 32)
    view = diagram.awq_scaling(weights, inputs, 4, 16, grid=10, salient=2)
    assert set(view.salient.tolist()) == {3, 17}
    figure = diagram.draw_awq_scaling(view)
    loud, = by_gid(figure, "scales:salient")
    quiet, = by_gid(figure, "scales:quiet")
    assert np.array_equal(loud.get_offsets(), np.column_stack([view.mean_abs[view.salient],
                                                                view.scales[view.salient]]))
    assert len(quiet.get_offsets()) == 30
    for kind, errors in (("rtn", view.rtn_error), ("awq", view.awq_error)):
        for j in view.salient:
            column, = [p for p in by_gid(figure, f"error:{kind}:ch {j}")]
            assert column.get_height() == pytest.approx(100 * errors[j])
        others, = by_gid(figure, f"error:{kind}:other 30")
        assert others.get_height() == pytest.approx(100 * np.delete(errors, view.salient).mean())
    assert f"α = {view.search.best_alpha:g}" in figure.axes[0].get_title()
    assert figure.get_suptitle().startswith("AWQ")
    assert_legible(figure)


def test_awq_scaling_refuses_bad_input_by_name():
    rng = np.random.default_rng(3)
    weights, inputs = rng.standard_normal((32, 6)).astype(np.float32), with_outliers(rng, 64, 32)
    with pytest.raises(ValueError, match=r"salient \(the loudest channels drawn\) must be an integer in \[1, 6\]; "
                                         r"got 7"):
        diagram.awq_scaling(weights, inputs, 4, salient=7)
    with pytest.raises(ValueError, match="got True"):
        diagram.awq_scaling(weights, inputs, 4, salient=True)
    with pytest.raises(ValueError, match="grid must be an integer >= 1.*got 0"):
        diagram.awq_scaling(weights, inputs, 4, grid=0)
    with pytest.raises(ValueError, match="need the AwqScaling of awq_scaling"):
        diagram.draw_awq_scaling(None)


# ---- SmoothQuant ---------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), alpha=st.floats(0, 1), n_in=st.integers(4, 64))
def test_the_migration_is_smoothquants_scales_applied(seed, alpha, n_in):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_in, 5)).astype(np.float32)
    inputs = with_outliers(rng, 32, n_in, loud=(0, n_in - 1))
    view = diagram.migration(weights, inputs, alpha)
    s = smoothquant.smoothing_scales(weights, inputs, alpha)
    assert np.array_equal(view.scales, s)
    assert np.allclose(1 / view.scales, smoothquant.smooth(weights, inputs, alpha).input_scale, rtol=1e-6)
    assert np.allclose(view.activation_max_after, np.abs(inputs / s).max(0), rtol=1e-12)
    assert np.allclose(view.weight_max_after, np.abs(weights * s[:, None]).max(1), rtol=1e-12)
    # the product of the two maxima is what migration leaves unchanged
    assert np.allclose(view.activation_max_after * view.weight_max_after, view.activation_max * view.weight_max)
    median = np.median(view.activation_max)
    assert sorted(view.loud.tolist()) == sorted(np.flatnonzero(view.activation_max >= 10 * median).tolist())
    assert list(view.activation_max[view.loud]) == sorted(view.activation_max[view.loud], reverse=True)


def test_at_alpha_one_half_the_two_maxima_meet():
    rng = np.random.default_rng(4)
    weights, inputs = rng.standard_normal((24, 8)).astype(np.float32), with_outliers(rng, 48, 24)
    view = diagram.migration(weights, inputs, 0.5)
    assert np.allclose(view.activation_max_after, view.weight_max_after, rtol=1e-12)
    assert view.loud.tolist()[:2] in ([3, 17], [17, 3])


def test_the_migration_figure_draws_the_views_numbers():
    rng = np.random.default_rng(5)
    weights, inputs = rng.standard_normal((64, 8)).astype(np.float32), with_outliers(rng, 48, 64)
    view = diagram.migration(weights, inputs, 0.5)
    figure = diagram.draw_migration(view)
    order = np.argsort(-view.activation_max, kind="stable")
    for when, activations, weight_max in (("before", view.activation_max, view.weight_max),
                                          ("after", view.activation_max_after, view.weight_max_after)):
        columns, = by_gid(figure, f"activation:{when}")  # one step per channel
        assert np.array_equal(columns.get_data().values, activations[order])
        assert np.array_equal(columns.get_data().edges, np.arange(65) - 0.5)
        dots, = by_gid(figure, f"weight:{when}")
        assert np.allclose(dots.get_ydata(), weight_max[order])
        line, = by_gid(figure, f"loud:{when}")
        assert line.get_xdata()[0] == len(view.loud) - 0.5
    names, = by_gid(figure, "loud:names")
    assert names.get_text().startswith("2 outliers (≥ 10× the median max |X|)")
    assert ", ".join(str(j) for j in view.loud[:3]) in names.get_text()
    assert figure.get_suptitle().startswith("SmoothQuant")
    assert_legible(figure)


def test_migration_refuses_bad_input_by_name():
    rng = np.random.default_rng(6)
    weights, inputs = rng.standard_normal((16, 4)).astype(np.float32), with_outliers(rng, 8, 16, loud=(1,))
    with pytest.raises(ValueError, match=r"alpha .* must be in \[0, 1\]; got 1.5"):
        diagram.migration(weights, inputs, 1.5)
    with pytest.raises(ValueError, match=r"marked \(loud channels named\) must be an integer in \[0, 6\]; got -1"):
        diagram.draw_migration(diagram.migration(weights, inputs), marked=-1)
    with pytest.raises(ValueError, match="weights and calibration inputs must be finite"):
        diagram.migration(weights, np.full((8, 16), np.nan))
    with pytest.raises(ValueError, match="need the Migration of migration"):
        diagram.draw_migration(weights)


def wide_layer():
    """(W (512, 16), X (64, 512)): like the layer the chapter draws, 512 inputs whose loud
    channels are many and scattered."""
    rng = np.random.default_rng(7)
    inputs = with_outliers(rng, 64, 512, loud=tuple(range(0, 512, 9)), size=30.0)
    inputs *= rng.lognormal(0, 1.5, 512).astype(np.float32)  # channel sizes over orders of magnitude
    weights = (rng.standard_normal((512, 16)) * 0.05).astype(np.float32)
    return weights, inputs


def test_a_wide_migration_stays_legible():
    weights, inputs = wide_layer()
    assert_legible(diagram.draw_migration(diagram.migration(weights, inputs)))


def test_a_wide_awq_view_stays_legible():
    weights, inputs = wide_layer()
    figure = diagram.draw_awq_scaling(diagram.awq_scaling(weights, inputs, 3, 32, grid=10))
    assert figure.axes[1].get_title() == "Their rounding error, 3 bits, groups of 32"
    assert_legible(figure)
