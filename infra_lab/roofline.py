"""The roofline model: FLOPs against bytes for the ops an LLM runs, and which roof binds.

A kernel doing F FLOPs while moving B bytes has arithmetic intensity F/B (FLOP/byte). On a
device with peak P FLOP/s and bandwidth W bytes/s it needs at least max(F/P, B/W) seconds and
is memory-bound when F/B < P/W, the ridge point (Williams, Waterman and Patterson, "Roofline",
CACM 2009). Byte counts here are the compulsory traffic: each operand read once, each result
written once, as if caches were perfect; real kernels move at least this much.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from infra_lab.hardware import Device
from infra_lab.model.config import CONFIGS, ModelConfig
from infra_lab.model.cost import (  # noqa: F401 (chapter 01 reads them here)
    BYTES_PER_ELEMENT, Cost, _positive, bytes_per_element, kv_bytes_per_token, step_cost)


# ---- the ops ---------------------------------------------------------------------------

def gemm(m: int, n: int, k: int, dtype: str) -> Cost:
    """(m, k) @ (k, n) -> (m, n): 2mnk FLOPs; read both operands, write the result."""
    _positive(m=m, n=n, k=k)
    return Cost(2 * m * n * k, (m * k + k * n + m * n) * bytes_per_element(dtype))


def gemv(n_out: int, n_in: int, dtype: str) -> Cost:
    """(n_out, n_in) @ (n_in,): a GEMM with one column, about 2 FLOPs per weight read."""
    return gemm(n_out, 1, n_in, dtype)


def attention_prefill(seq_len: int, n_heads: int, head_dim: int, dtype: str,
                      n_kv_heads: int | None = None, causal: bool = True) -> Cost:
    """softmax(Q K^T) V over a whole prompt, fused (FlashAttention-style: the L x L scores
    never reach memory). FLOPs: QK^T and PV, 2 * 2 * L^2 * d per head, halved when causal."""
    n_kv_heads = n_kv_heads or n_heads
    _positive(seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads)
    pairs = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len
    flops = 4 * pairs * head_dim * n_heads
    elements = seq_len * head_dim * (2 * n_heads + 2 * n_kv_heads)  # Q, O; K, V
    return Cost(flops, elements * bytes_per_element(dtype))


def attention_decode(context: int, n_heads: int, head_dim: int, dtype: str,
                     n_kv_heads: int | None = None, batch: int = 1) -> Cost:
    """One new query per sequence against `context` cached keys and values: every cached
    byte is read to do 4 FLOPs per element per query head sharing it."""
    n_kv_heads = n_kv_heads or n_heads
    _positive(context=context, n_heads=n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads, batch=batch)
    flops = 4 * context * head_dim * n_heads * batch
    elements = batch * (2 * context * n_kv_heads * head_dim + 2 * n_heads * head_dim)
    return Cost(flops, elements * bytes_per_element(dtype))


def elementwise(n_elements: int, dtype: str, n_inputs: int = 2, flops_per_element: float = 1) -> Cost:
    """An op like add or SiLU: `n_inputs` arrays read, one written."""
    _positive(n_elements=n_elements, n_inputs=n_inputs)
    return Cost(flops_per_element * n_elements,
                (n_inputs + 1) * n_elements * bytes_per_element(dtype))


def rmsnorm(n_tokens: int, d_model: int, dtype: str) -> Cost:
    """x / rms(x) * g: about 4 FLOPs per element (square, sum, scale, gain)."""
    _positive(n_tokens=n_tokens, d_model=d_model)
    return Cost(4 * n_tokens * d_model, (2 * n_tokens * d_model + d_model) * bytes_per_element(dtype))


# ---- the roofs -------------------------------------------------------------------------

def ridge_point(device: Device, dtype: str) -> float:
    """FLOP/byte above which `device` is compute-bound for `dtype`."""
    return device.flops(dtype) / device.memory_bandwidth


def attainable_flops(intensity: float, device: Device, dtype: str) -> float:
    """min(peak, intensity * bandwidth): the roofline itself."""
    _positive(intensity=intensity)
    return min(device.flops(dtype), intensity * device.memory_bandwidth)


def time_lower_bound(cost: Cost, device: Device, dtype: str) -> tuple[float, str]:
    """(seconds, "compute" or "memory"): the larger of the two roofs' times, and which it is."""
    compute_s = cost.flops / device.flops(dtype)
    memory_s = cost.bytes / device.memory_bandwidth
    return (compute_s, "compute") if compute_s >= memory_s else (memory_s, "memory")


def fraction_of_roof(cost: Cost, seconds: float, device: Device, dtype: str) -> float:
    """Achieved FLOP/s over the roof at this intensity (for memory-bound kernels: achieved
    bandwidth over the measured bandwidth)."""
    _positive(seconds=seconds)
    return cost.flops / seconds / attainable_flops(cost.intensity, device, dtype)


# ---- transformer steps -----------------------------------------------------------------

PRESETS: dict[str, ModelConfig] = {config.name: config for config in (
    ModelConfig("llama-2-7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
                vocab=32000, context=4096,
                source="config.json of meta-llama/Llama-2-7b-hf on Hugging Face"),
    ModelConfig("llama-3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                vocab=128256, context=8192, rope_theta=500000.0,
                source="config.json of meta-llama/Meta-Llama-3-8B on Hugging Face"),
    ModelConfig("llama-3-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                vocab=128256, context=8192, rope_theta=500000.0,
                source="config.json of meta-llama/Meta-Llama-3-70B on Hugging Face"),
    ModelConfig("mixtral-8x7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                vocab=32000, context=32768, rope_theta=1e6,
                source="config.json of mistralai/Mixtral-8x7B-v0.1 on Hugging Face; Jiang et al., "
                       "Mixtral of Experts, 2024 (8 experts, 2 per token)",
                n_experts=8, experts_per_token=2),
    ModelConfig("llama-2-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                vocab=32000, context=4096,
                source="config.json of meta-llama/Llama-2-70b-hf on Hugging Face"),
    # OPT's MLP is two d x 4d matrices with ReLU; the cost model prices a SwiGLU MLP of three d x d_ff
    # matrices, so d_ff = 8d/3 (rounded) gives the same parameters and FLOPs per token (3 d d_ff = 8 d^2)
    ModelConfig("opt-13b", n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, d_ff=13653,
                vocab=50272, context=2048, tied_embeddings=True,
                source="config.json of facebook/opt-13b on Hugging Face (hidden_size 5120, ffn_dim 20480, 40 "
                       "layers, 40 heads); its 2-matrix MLP priced as SwiGLU with d_ff = 8 * 5120 / 3 = 13653, "
                       "so parameters and FLOPs match; learned position embeddings (2048 x 5120) left out"),
    ModelConfig("opt-66b", n_layers=64, d_model=9216, n_heads=72, n_kv_heads=72, d_ff=24576,
                vocab=50272, context=2048, tied_embeddings=True,
                source="config.json of facebook/opt-66b on Hugging Face (hidden_size 9216, ffn_dim 36864, 64 "
                       "layers, 72 heads); its 2-matrix MLP priced as SwiGLU with d_ff = 8 * 9216 / 3 = 24576, "
                       "so parameters and FLOPs match; learned position embeddings (2048 x 9216) left out"),
    ModelConfig("smollm2-135m", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536,
                vocab=49152, context=8192, rope_theta=100000.0, tied_embeddings=True,
                source="config.json of HuggingFaceTB/SmolLM2-135M-Instruct on Hugging Face (the "
                       "pretrained model the book's engine serves, infra_lab.model.pretrained)"),
    replace(CONFIGS["target"], name="infra-lab-tiny",
            source="this book's small GPT, infra_lab.model's target (chapter 02): bytes, "
                   f"{CONFIGS['target'].context}-token context"),
)}
LLAMA_3_8B = PRESETS["llama-3-8b"]


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def critical_batch(config: ModelConfig, device: Device, dtype: str,
                   context: int = 0, max_batch: int = 2**24) -> float:
    """Smallest decode batch up to `max_batch` whose step is compute-bound on `device`; math.inf
    if none is (when the KV cache read per sequence outweighs the weights it shares)."""
    ridge = ridge_point(device, dtype)

    def compute_bound(batch: int) -> bool:
        return step_cost(config, batch, 1, context, dtype).intensity >= ridge

    high = 1
    while not compute_bound(high):
        high *= 2
        if high > max_batch:
            return math.inf
    low = high // 2  # not compute-bound (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high


def weight_bound_batch(config: ModelConfig, device: Device, dtype: str, context: int = 0,
                       largest: int = 64) -> int:
    """The largest power of two, 2 to `largest`, below `critical_batch`: a batch whose decode
    step on `device` is still bound by reading the weights, so that it costs about what one
    sequence's step costs (2 when even that is compute-bound)."""
    if isinstance(largest, bool) or not isinstance(largest, int) or largest < 2:
        raise ValueError(f"largest must be an integer >= 2; got {largest!r}")
    ceiling = min(critical_batch(config, device, dtype, context, largest), largest + 1)
    batch = 2
    while batch * 2 < ceiling:
        batch *= 2
    return batch


# ---- the picture -----------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    label: str
    intensity: float  # FLOP/byte
    flops_per_s: float  # achieved, or the bound
    series: str = ""  # points of one series share a colour and a legend entry, joined by a line


def _label_offsets() -> list[tuple[float, float, str, str]]:
    """(dx, dy, ha, va) in points, nearest first: right, left, above, below, then diagonals."""
    offsets = []
    for r in (4, 14, 26, 40):
        offsets += [(r, -3, "left", "center"), (-r, -3, "right", "center"),
                    (0, r, "center", "bottom"), (0, -r, "center", "top"),
                    (r, r, "left", "bottom"), (r, -r, "left", "top"),
                    (-r, r, "right", "bottom"), (-r, -r, "right", "top")]
    return offsets


LABEL_OFFSETS = _label_offsets()


def _along(vertices, step_px: float):
    """Points every `step_px` pixels along a polyline given by its vertices in pixels."""
    import numpy as np

    points = [vertices[:1]]
    for start, end in zip(vertices[:-1], vertices[1:]):
        length = float(np.hypot(*(end - start)))
        if np.isfinite(length) and length > 0:
            steps = np.linspace(0, 1, max(2, int(length / step_px) + 1))[1:, None]
            points.append(start + steps * (end - start))
    return np.concatenate(points)


def place_labels(ax, anchors: list[tuple[float, float]], labels: list[str],
                 colors: list | None = None, fontsize: float = 9) -> list:
    """Label each anchor (data coordinates) with the nearest offset that overlaps the least:
    no other label, inside the axes, off the plotted lines and markers where it can. A label
    set away from its anchor gets a leader line. Set the limits and the layout first; returns
    the texts in the order of `labels`."""
    from matplotlib.text import Text

    if len(anchors) != len(labels):
        raise ValueError(f"{len(anchors)} anchors for {len(labels)} labels")
    colors = colors or ["black"] * len(labels)
    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer).padded(-2)
    # what a label should not cover, in pixels, and the cost of covering each point of it:
    # markers weigh more than lines, and one point of a line more than every nearer offset,
    # so a label steps away from a roof rather than run into it
    import numpy as np

    points, weights = [np.empty((0, 2))], [np.empty(0)]
    for line in ax.get_lines():
        vertices = line.get_transform().transform(line.get_xydata())
        marker_only = line.get_linestyle() in ("None", "", " ")
        chosen = vertices if marker_only else _along(vertices, step_px=3)
        points.append(chosen)
        weights.append(np.full(len(chosen), 200.0 if marker_only else 40.0))
    points, weights = np.concatenate(points), np.concatenate(weights)
    legend = ax.get_legend()
    taken = [legend.get_window_extent(renderer)] if legend is not None else []
    texts = [None] * len(labels)
    order = sorted(range(len(labels)), key=lambda i: (anchors[i][0], anchors[i][1]))
    for i in order:
        best = None
        for rank, (dx, dy, ha, va) in enumerate(LABEL_OFFSETS):
            far = abs(dx) > 4 or abs(dy) > 4
            text = ax.annotate(labels[i], anchors[i], xytext=(dx, dy), color=colors[i],
                               textcoords="offset points", ha=ha, va=va, fontsize=fontsize,
                               arrowprops={"arrowstyle": "-", "color": colors[i], "lw": 0.6,
                                           "shrinkA": 0, "shrinkB": 3} if far else None)
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer)  # the text alone, not its leader
            covered = ((points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
                       & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1))
            crossings = float(weights[covered].sum())
            penalty = (100_000 * sum(box.overlaps(other) for other in taken)
                       + 1_000_000 * (not (inside.contains(box.x0, box.y0)
                                      and inside.contains(box.x1, box.y1)))
                       + crossings + rank)  # nearer is better, all else equal
            if best is None or penalty < best[0]:
                if best is not None:
                    best[1].remove()
                best = (penalty, text, box)
            else:
                text.remove()
            if penalty == rank:  # nothing covered: no later, farther offset can do better
                break
        texts[i] = best[1]
        taken.append(best[2])
    return texts


ROOF_COLORS = ("#1f77b4", "#ff7f0e", "#17becf", "#7f7f7f")
POINT_COLORS = ("#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e6550d", "#0b7a75", "#393b79",
                "#7b4173", "#637939", "#843c39")


def plot(roofs: list[tuple[Device, str]], points: list[Point] = (), ax=None,
         intensity_range: tuple[float, float] = (0.05, 2e4), title: str | None = None):
    """Log-log roofline: one roof per (device, dtype), and labelled points placed so that no
    two labels overlap where there is room. Points that share a `series` share a colour and a
    legend entry, and are joined by a line. Returns the axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    low, high = intensity_range
    top = 0.0
    for (device, dtype), color in zip(roofs, ROOF_COLORS * len(roofs)):
        ridge = ridge_point(device, dtype)
        intensity = np.array([low] + ([ridge] if low < ridge < high else []) + [high])
        roof = np.minimum(device.flops(dtype), intensity * device.memory_bandwidth)
        ax.loglog(intensity, roof, color=color, label=f"{device.name}, {dtype}")
        ax.axvline(ridge_point(device, dtype), color=color, ls=":", lw=0.8)
        top = max(top, device.flops(dtype))
    groups = list(dict.fromkeys(point.series or f"point {i}" for i, point in enumerate(points)))
    color_of = {group: POINT_COLORS[i % len(POINT_COLORS)] for i, group in enumerate(groups)}
    colors = [color_of[point.series or f"point {i}"] for i, point in enumerate(points)]
    for group in groups:
        members = [p for i, p in enumerate(points) if (p.series or f"point {i}") == group]
        ax.loglog([p.intensity for p in members], [p.flops_per_s for p in members], "o-",
                  ms=5, lw=0.8, color=color_of[group], label=members[0].series or None)
        top = max([top] + [p.flops_per_s for p in members])
    ax.set_xlim(*intensity_range)
    if top > 0:
        ax.set_ylim(top=top * 4)  # room above the highest roof for the legend and labels
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.legend(loc="upper left")
    if title:
        ax.set_title(title)
    place_labels(ax, [(p.intensity, p.flops_per_s) for p in points], [p.label for p in points],
                 colors)
    return ax
