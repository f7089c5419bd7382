"""Chapter 08's diagrams of three ways to choose the integers, drawn from `infra_lab.quant`.

- `draw_gptq_steps`: GPTQ's loop (Frantar et al., "GPTQ: Accurate Post-Training Quantization
  for Generative Pre-trained Transformers", 2022) on a small matrix, run with the
  package's own `gptq.column_update`, seen right after a few of its steps: the change of every
  weight from its original value, for the inputs already rounded, the one just rounded and the
  ones still float, which the error feedback has moved.
- `draw_awq_scaling`: AWQ's scales (Lin et al., "AWQ: Activation-aware Weight Quantization for
  LLM Compression and Acceleration", 2023) against each input channel's mean |x|,
  from `awq.awq_search`'s chosen alpha, and the output error that the loudest channels' weights
  cause alone, rounded to nearest before and after the scaling.
- `draw_migration`: SmoothQuant's migration (Xiao et al., "SmoothQuant: Accurate and Efficient
  Post-Training Quantization for Large Language Models", 2022): each input channel's max |X|
  and max |W| before and after dividing X by `smoothquant.smoothing_scales` and multiplying W
  by them, the loudest channels marked.

Each drawing takes a small record (`gptq_steps`, `awq_scaling`, `migration`) computed by the
package's quantizers, so the book's sentence and the tests read the same numbers as the picture.
Every drawn element carries a gid naming what it stands for.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from infra_lab.figures import MAX_WIDTH_IN
from infra_lab.quant import awq, gptq, smoothquant
from infra_lab.quant.matmul import QuantizedMatrix

FONT_PT, TITLE_PT = 9.0, 10.5
ROUNDED, CURRENT, FLOAT = "0.55", "#d55e00", "white"  # the strip over each GPTQ panel
ACTIVATION, WEIGHT, LOUD = "#0072b2", "#e69f00", "#cc79a7"  # Okabe and Ito's palette
MAX_INPUTS, MAX_OUTPUTS, MAX_STEPS = 16, 12, 4  # a cell narrower than this would lose its 9-pt ticks
MAX_SALIENT = 6
LOUD_RATIO = 10  # a channel whose max |X| is this many times the median channel's counts as loud


def _whole(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]; got {value!r}")
    return int(value)


# ---- GPTQ ----------------------------------------------------------------------------------------


class GptqSteps(NamedTuple):
    original_t: np.ndarray  # float32 (n_out, n_in): W^T as the loop starts (dead inputs zeroed)
    columns: tuple[int, ...]  # the inputs shown, in the loop's order
    snapshots: tuple[np.ndarray, ...]  # float32 (n_out, n_in): weights_t right after each shown input
    errors: tuple[np.ndarray, ...]  # float32 (n_out,): the error e column_update spread from each
    matrix: QuantizedMatrix  # what the whole loop produced: gptq.gptq's matrix


def gptq_steps(weights, inputs, bits: int, group: int | None = None, columns=(0, 4, 8),
               damp: float = 0.01) -> GptqSteps:
    """GPTQ's loop on W (n_in, n_out) with calibration inputs (n_samples, n_in), step by step
    through gptq.column_update, keeping the weights right after each input in `columns`."""
    weights, inputs = gptq.check_calibration(weights, inputs)
    n_in, n_out = weights.shape
    if n_in > MAX_INPUTS or n_out > MAX_OUTPUTS:
        raise ValueError(f"the diagram draws at most {MAX_INPUTS} inputs and {MAX_OUTPUTS} outputs, one cell "
                         f"each; got W of shape {weights.shape}")
    gptq.check_format(n_in, bits, group)
    columns = tuple(columns) if isinstance(columns, (tuple, list)) else columns
    if not isinstance(columns, tuple) or not 1 <= len(columns) <= MAX_STEPS or \
            any(isinstance(c, bool) or not isinstance(c, numbers.Integral) for c in columns) or \
            list(columns) != sorted(set(columns)) or not 0 <= columns[0] <= columns[-1] < n_in:
        raise ValueError(f"columns must be 1 to {MAX_STEPS} increasing inputs in [0, {n_in - 1}]; "
                         f"got {columns!r}")
    h, dead = gptq.hessian(inputs, damp)
    try:
        u = gptq.inverse_cholesky(h)  # (n_in, n_in)
    except np.linalg.LinAlgError:
        raise ValueError(f"H = 2 X^T X is singular even after damping by damp={damp}") from None
    weights_t = weights.T.copy()  # (n_out, n_in)
    weights_t[:, dead] = 0
    original_t = weights_t.copy()
    size = group or n_in
    scales = np.zeros((n_out, n_in // size), np.float16)
    values = np.zeros((n_out, n_in), np.int8)
    snapshots, errors = [], []
    for column in range(n_in):
        if column % size == 0:  # entering a group: its scales from the weights updated so far
            scales[:, column // size] = gptq.group_scales(weights_t[:, column:column + size], bits)
        weights_t, values[:, column], error = gptq.column_update(weights_t, u, column, scales, group, bits)
        if column in columns:
            snapshots.append(weights_t.copy())
            errors.append(error)
    matrix = QuantizedMatrix.from_values(values, scales, bits, group)
    return GptqSteps(original_t, tuple(int(c) for c in columns), tuple(snapshots), tuple(errors), matrix)


def draw_gptq_steps(steps: GptqSteps, title: str | None = None) -> Figure:
    """One panel per shown step: every weight's change from its original value (outputs are rows,
    inputs columns, W transposed as GPTQ keeps it), on one colour scale. The strip over each
    panel marks the inputs already rounded (grey), the one just rounded (orange, framed in the
    panel) and those still float (white), which the error feedback has moved."""
    if not isinstance(steps, GptqSteps):
        raise ValueError(f"need the GptqSteps of gptq_steps(...); got {type(steps).__name__}")
    n_out, n_in = steps.original_t.shape
    changes = [snapshot - steps.original_t for snapshot in steps.snapshots]  # (n_out, n_in) each
    limit = max(float(np.abs(c).max()) for c in changes) or 1.0
    norm = TwoSlopeNorm(0.0, -limit, limit)
    count = len(steps.columns)
    figure = Figure(figsize=(MAX_WIDTH_IN, 1.7 + 0.2 * n_out), layout="constrained")
    axes = figure.subplots(1, count, squeeze=False)[0]
    image = None
    for ax, column, change in zip(axes, steps.columns, changes):
        image = ax.imshow(change, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest",
                          extent=(-0.5, n_in - 0.5, n_out - 0.5, -0.5))
        image.set_gid(f"change:{column}")
        for i in range(n_in):  # the strip over the panel
            face = ROUNDED if i < column else CURRENT if i == column else FLOAT
            state = "rounded" if i < column else "current" if i == column else "float"
            ax.add_patch(Rectangle((i - 0.5, -1.6), 1, 0.9, facecolor=face, edgecolor="0.3", linewidth=0.5,
                                   clip_on=False, gid=f"strip:{column}:{i}:{state}"))
        ax.add_patch(Rectangle((column - 0.5, -0.5), 1, n_out, facecolor="none", edgecolor=CURRENT,
                               linewidth=2.0, gid=f"frame:{column}"))
        ax.set_xlim(-0.5, n_in - 0.5)
        ax.set_ylim(n_out - 0.5, -1.7)
        ticks = list(range(0, n_in, 4 if n_in > 8 else 2))
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=FONT_PT)
        rows = sorted({0, n_out - 1})
        ax.set_yticks(rows, [str(r) for r in rows], fontsize=FONT_PT)
        ax.tick_params(length=2)
        ax.set_xlabel("input", fontsize=FONT_PT)
        ax.set_title(f"input {column} rounded", fontsize=FONT_PT, pad=2)
    axes[0].set_ylabel("output", fontsize=FONT_PT)
    scale = figure.colorbar(image, ax=list(axes), shrink=0.9, pad=0.02)
    scale.ax.tick_params(labelsize=FONT_PT)
    scale.set_label("change from\nthe original weight", fontsize=FONT_PT)
    bits = steps.matrix.bits
    figure.suptitle(title or f"GPTQ at {bits} bits: grey inputs rounded, orange just rounded, "
                    "white still float,\nmoved by the rounding errors fed forward", fontsize=TITLE_PT)
    return figure


# ---- AWQ -----------------------------------------------------------------------------------------


class AwqScaling(NamedTuple):
    search: awq.AwqSearch  # awq.awq_search's alphas, errors and best alpha
    mean_abs: np.ndarray  # float64 (n_in,): each input channel's mean |x|
    scales: np.ndarray  # float64 (n_in,): s = awq.activation_scales(inputs, best alpha)
    salient: np.ndarray  # int (k,): the k channels of largest mean |x|, loudest first
    rtn_error: np.ndarray  # float64 (n_in,): channel j's error alone, ||x_j|| ||w_j - q_j|| / ||X W||
    awq_error: np.ndarray  # float64 (n_in,): the same after AWQ's scaling (awq.awq without clipping)
    bits: int
    group: int | None  # None: one scale per output channel


def channel_errors(weights: np.ndarray, inputs: np.ndarray, matrix: QuantizedMatrix) -> np.ndarray:
    """(n_in,) float64: the output error that input channel j's rounded weights cause alone,
    ||x_j (w_j - q_j)||_F = ||x_j|| ||w_j - q_j||, as a share of ||X W||_F; x_j is column j of
    inputs (n_samples, n_in), w_j row j of W (n_in, n_out), q_j that row of the matrix."""
    x, w = inputs.astype(np.float64), weights.astype(np.float64)
    difference = w - matrix.dequantize()  # (n_in, n_out)
    return np.linalg.norm(x, axis=0) * np.linalg.norm(difference, axis=1) / np.linalg.norm(x @ w)


def awq_scaling(weights, inputs, bits: int, group: int | None = None, grid: int = 20,
                salient: int = 4) -> AwqScaling:
    """AWQ's search on W (n_in, n_out) and inputs (n_samples, n_in), its scales, and each
    channel's error rounded to nearest (QuantizedMatrix.quantize) and after the scaling
    (awq.awq with clip=False: the scaling alone)."""
    weights, inputs = gptq.check_calibration(weights, inputs)
    salient = _whole(salient, "salient (the loudest channels drawn)", 1, min(MAX_SALIENT, weights.shape[0]))
    search = awq.awq_search(weights, inputs, bits, group, grid)
    mean_abs = np.abs(inputs.astype(np.float64)).mean(0)
    loudest = np.argsort(-mean_abs, kind="stable")[:salient]
    rtn = QuantizedMatrix.quantize(weights, bits, group)
    scaled = awq.awq(weights, inputs, bits, group, grid, clip=False)
    return AwqScaling(search, mean_abs, awq.activation_scales(inputs, search.best_alpha), loudest,
                      channel_errors(weights, inputs, rtn), channel_errors(weights, inputs, scaled), bits, group)


def draw_awq_scaling(view: AwqScaling, title: str | None = None) -> Figure:
    """Left: each input channel's scale s against its mean |x|, both on log axes, where
    s = mean|x|^alpha is a line of slope alpha; the loudest channels in colour. Right: the error
    each loud channel causes alone, rounded to nearest and after scaling, with the mean of the
    other channels beside them."""
    if not isinstance(view, AwqScaling):
        raise ValueError(f"need the AwqScaling of awq_scaling(...); got {type(view).__name__}")
    alpha = view.search.best_alpha
    figure = Figure(figsize=(MAX_WIDTH_IN, 3.3), layout="constrained")
    left, right = figure.subplots(1, 2, width_ratios=(1, 1.15))
    quiet = np.setdiff1d(np.arange(len(view.mean_abs)), view.salient)
    left.scatter(view.mean_abs[quiet], view.scales[quiet], s=10, color="0.6", label="channels",
                 gid="scales:quiet")
    left.scatter(view.mean_abs[view.salient], view.scales[view.salient], s=30, color=LOUD,
                 label=f"the {len(view.salient)} loudest", gid="scales:salient")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("mean |x| of the input channel", fontsize=FONT_PT)
    left.set_ylabel("AWQ's scale s", fontsize=FONT_PT)
    left.set_title(f"s ∝ mean $|x|^{{\\alpha}}$, α = {alpha:g} chosen by the search", fontsize=FONT_PT)
    left.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    left.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    left.yaxis.set_minor_formatter(NullFormatter())
    left.tick_params(labelsize=FONT_PT)
    left.legend(fontsize=FONT_PT, loc="upper left")

    other = quiet if len(quiet) else view.salient
    labels = [f"ch {int(j)}" for j in view.salient] + [f"other {len(quiet)}\n(mean)"]
    before = [100 * view.rtn_error[j] for j in view.salient] + [100 * float(view.rtn_error[other].mean())]
    after = [100 * view.awq_error[j] for j in view.salient] + [100 * float(view.awq_error[other].mean())]
    xs = np.arange(len(labels))
    for k, (x, b, a) in enumerate(zip(xs, before, after)):
        name = labels[k].split("\n")[0]
        right.bar(x - 0.2, b, 0.4, color="0.7", gid=f"error:rtn:{name}", label="round to nearest" if k == 0 else None)
        right.bar(x + 0.2, a, 0.4, color=ACTIVATION, gid=f"error:awq:{name}",
                  label=f"scaled, α = {alpha:g}" if k == 0 else None)
    right.set_xticks(xs, labels, fontsize=FONT_PT)
    right.set_ylabel("output error from the channel\nalone, % of ‖XW‖", fontsize=FONT_PT)
    shape = "per channel" if view.group is None else f"groups of {view.group}"
    right.set_title(f"Their rounding error, {view.bits} bits, {shape}", fontsize=FONT_PT)
    right.tick_params(labelsize=FONT_PT)
    right.set_ylim(0, 1.3 * max(max(before), max(after), 1e-12))
    right.legend(fontsize=FONT_PT, loc="upper right")
    figure.suptitle(title or "AWQ: loud input channels get larger scales, and their weights finer steps",
                    fontsize=TITLE_PT)
    return figure


# ---- SmoothQuant ---------------------------------------------------------------------------------


class Migration(NamedTuple):
    alpha: float
    scales: np.ndarray  # float64 (n_in,): s = smoothquant.smoothing_scales(W, X, alpha)
    activation_max: np.ndarray  # float64 (n_in,): max |X_j| before
    weight_max: np.ndarray  # float64 (n_in,): max |W_j| before, over input j's outputs
    activation_max_after: np.ndarray  # max |X_j / s_j|
    weight_max_after: np.ndarray  # max |s_j W_j|
    loud: np.ndarray  # int: channels whose max |X| is at least LOUD_RATIO x the median's, loudest first


def migration(weights, inputs, alpha: float = 0.5) -> Migration:
    """Each input channel's max |X| and max |W| before and after SmoothQuant divides X (n_samples,
    n_in) by s and multiplies W (n_in, n_out) by it."""
    weights, inputs = gptq.check_calibration(weights, inputs)
    s = smoothquant.smoothing_scales(weights, inputs, alpha)  # (n_in,), names a bad alpha
    x, w = np.abs(inputs.astype(np.float64)), np.abs(weights.astype(np.float64))
    activation_max, weight_max = x.max(0), w.max(1)
    order = np.argsort(-activation_max, kind="stable")
    loud = order[activation_max[order] >= LOUD_RATIO * np.median(activation_max)]
    return Migration(float(alpha), s, activation_max, weight_max, (x / s).max(0), (w * s[:, None]).max(1),
                     loud[activation_max[loud] > 0])


def draw_migration(view: Migration, marked: int = 3, title: str | None = None) -> Figure:
    """Two panels on one log scale, before and after: each input channel's max |X| (a column) and
    max |W| (dots), the channels ordered by max |X| before, loudest first, in both; the loud
    channels (LOUD_RATIO x the median) left of the dashed line, the `marked` loudest named."""
    if not isinstance(view, Migration):
        raise ValueError(f"need the Migration of migration(...); got {type(view).__name__}")
    n_in = len(view.scales)
    marked = _whole(marked, "marked (loud channels named)", 0, min(MAX_SALIENT, n_in))
    order = np.argsort(-view.activation_max, kind="stable")  # position p shows channel order[p]
    figure = Figure(figsize=(MAX_WIDTH_IN, 3.4), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    positions = np.arange(n_in)
    panels = (("before", view.activation_max, view.weight_max, "before"),
              ("after", view.activation_max_after, view.weight_max_after, f"after (α = {view.alpha:g})"))
    every = np.concatenate([p[1] for p in panels] + [p[2] for p in panels])
    every = every[every > 0]
    low, high = (every.min(), every.max()) if every.size else (0.1, 1.0)
    dot = max(0.5, min(3.0, 300 / n_in))
    for ax, (when, activations, weights, heading) in zip(axes, panels):
        ax.stairs(activations[order], np.arange(n_in + 1) - 0.5, baseline=low / 2, fill=True, color=ACTIVATION,
                  alpha=0.85, gid=f"activation:{when}", label="max |X| of the channel")  # one column each
        ax.plot(positions, weights[order], ".", color=WEIGHT, markersize=dot, gid=f"weight:{when}",
                label="max |W| of its weights")
        if len(view.loud):
            ax.axvline(len(view.loud) - 0.5, color=LOUD, linestyle="--", linewidth=1, gid=f"loud:{when}")
        ax.set_yscale("log")
        ax.set_ylim(low / 2, high * 20)
        ax.set_xlim(-0.5, n_in - 0.5)
        ax.set_xlabel("input channels, loudest first", fontsize=FONT_PT)
        middle = np.median(activations)
        spread = activations.max() / middle if middle > 0 else np.inf
        ax.set_title(f"{heading}: largest max |X| {spread:.0f}× the median", fontsize=FONT_PT)
        ax.title.set_gid(f"spread:{when}")
        ax.tick_params(labelsize=FONT_PT)
    axes[0].set_ylabel("largest magnitude", fontsize=FONT_PT)
    axes[0].legend(fontsize=FONT_PT, loc="lower left", framealpha=0.9, markerscale=4 / dot)
    names = ", ".join(str(int(j)) for j in view.loud[:marked])
    more = ", ..." if len(view.loud) > marked else ""
    axes[0].text(0.98, 0.97, f"{len(view.loud)} outliers (≥ {LOUD_RATIO}× the median max |X|)" +
                 (f",\nleft of the dashed line: {names}{more}" if names else ""), transform=axes[0].transAxes,
                 ha="right", va="top", fontsize=FONT_PT, color="0.2", gid="loud:names")
    figure.suptitle(title or "SmoothQuant: dividing X by s moves the activations' range into the weights",
                    fontsize=TITLE_PT)
    return figure
