"""Chapter 10's diagrams of training across GPUs, each drawn from a live object of `infra_lab.parallel`.

- `draw_zero_stages`: what each rank holds under ZeRO's stages, the paper's Figure 1 (Rajbhandari
  et al., "ZeRO: memory optimizations toward training trillion parameter models", SC 2020) drawn
  from `memory.state_bytes`: per stage and rank, parameters, gradients and optimizer states to
  scale, the rank's own slice filled and what other ranks hold outlined.
- `draw_all_reduce`: a ring all-reduce as a reduce-scatter then an all-gather (Patarasuk and
  Yuan 2009), chunk by chunk, with the values of a real run written in when given.
- `draw_pipeline` and `draw_schedule`: one row per stage, a box per forward and backward, the idle
  time hatched: from a real run's `pipeline.Log`s, or from `pipeline.schedule` with forward 1 and
  backward 2 time slots, so the measured bubble sits beside the ideal (p - 1) / (m + p - 1).
- `draw_plan`: the explorer's picture of a `plan.Plan`: memory per GPU by kind against the GPU's
  memory, and the step's time split, on axes fixed per model shape so settings compare.

Every box and number carries a gid naming what it stands for, so the tests read the picture back.
The figures are `matplotlib.figure.Figure`s laid out in inches (6.5 wide, texts at 9 pt or more);
no pyplot state is left open. `parallel.pipeline` needs torch and is imported only where drawn.
"""
from __future__ import annotations

import dataclasses
import textwrap
from fractions import Fraction

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from infra_lab import hardware
from infra_lab.diagrams.gantt import legend_columns, text_in
from infra_lab.parallel import memory, plan as cost

WIDTH_IN = 6.5
FONT_PT = 9
TITLE_PT = 10.5
KIND_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868",
               "activations": "#8172b3"}
CHUNK_COLORS = colormaps["tab10"].colors  # chunk c (the one rank c reduces) in colour c % 10


def _bytes_text(n: float) -> str:
    """Bytes in the decimal unit that keeps 1 to 3 digits before the point: 120 GB, 1.88 GB, 16 KB."""
    for unit, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n:.3g} B"


def _count_text(n: int) -> str:
    for unit, name in ((1e9, "B"), (1e6, "M")):
        if n >= unit:
            return f"{n / unit:.3g}{name}"
    return f"{n:,}"


def _inch_axes(figure: Figure, height: float):
    """An axes over the whole figure whose data units are inches from the top left corner."""
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, WIDTH_IN), ylim=(height, 0))
    ax.axis("off")
    return ax


def _legend_below(ax, handles: list, top_in: float, figure_h: float) -> None:
    """Handles in as many columns as fit the page, centred, their top `top_in` from the figure's top."""
    ncol = legend_columns([h.get_label() for h in handles], WIDTH_IN - 0.3)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - top_in / figure_h),
              bbox_transform=ax.figure.transFigure, ncol=ncol, fontsize=FONT_PT, frameon=False,
              handlelength=1.5, columnspacing=1.0, handletextpad=0.5, borderaxespad=0)


# ---- ZeRO's stages --------------------------------------------------------------------------------

MAX_RANKS = 8  # more ranks are drawn as 0, 1, 2, ..., N - 1
STATE_KINDS = memory.KINDS[:3]  # parameters, gradients, optimizer states
STAGE_LABELS = {0: "stage 0: no sharding", 1: r"stage 1: $P_{os}$", 2: r"stage 2: $P_{os+g}$",
                3: r"stage 3: $P_{os+g+p}$"}
ELEMENT_BYTES = {"parameters": "parameter_bytes", "gradients": "gradient_bytes",
                 "optimizer states": "optimizer_bytes"}  # the Precision field of each kind


def shown_ranks(world: int) -> list[int | None]:
    """The ranks drawn as columns; None is the "..." column that stands for the ranks left out."""
    return list(range(world)) if world <= MAX_RANKS else [0, 1, 2, None, world - 1]


def held_span(params: int, world: int, rank: int, held_bytes: int, element_bytes: int) -> tuple[float, float]:
    """The share [start, end) of the model's elements `rank` holds of a kind it keeps `held_bytes`
    of: everything, or its shard, elements [rank s, (rank + 1) s) with s = ceil(Psi / N), less the
    padding past Psi."""
    held = held_bytes // element_bytes
    if held >= params:
        return 0.0, 1.0
    return min(rank * held, params) / params, min((rank + 1) * held, params) / params


def draw_zero_stages(params: int, world: int, precision: memory.Precision = memory.MIXED,
                     title: str | None = None) -> Figure:
    """Rows: ZeRO stages 0 to 3; columns: ranks (0, 1, 2, ..., N - 1 beyond MAX_RANKS). Each cell
    is the model's parameters, gradients and optimizer states to scale (2 : 2 : 12 bytes per
    parameter in mixed precision); the slice the rank holds is filled, the rest outlined. Right:
    the bytes one rank holds, `memory.state_bytes` summed."""
    if isinstance(params, bool) or not isinstance(params, int) or params < 1:
        raise ValueError(f"draw the model's parameter count as one int >= 1 (7_500_000_000, not 7.5e9); "
                         f"got {params!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the world size must be an integer >= 1; got {world!r}")
    states = {stage: memory.state_bytes(params, world, stage, precision) for stage in memory.STAGES}
    full = states[0]
    ranks = shown_ranks(world)

    left_in, right_in, gap_in, dots_in = 1.75, 0.8, 0.14, 0.35  # label columns; between cells; the "..."
    top_in, header_in, row_in, bar_in = 0.62, 0.32, 0.52, 0.28
    height = top_in + header_in + row_in * len(memory.STAGES) + 0.55
    figure = Figure(figsize=(WIDTH_IN, height))
    ax = _inch_axes(figure, height)
    room = WIDTH_IN - left_in - right_in
    cell_in = (room - (dots_in if None in ranks else 0)) / sum(r is not None for r in ranks)
    bar_w = cell_in - gap_in
    scale = bar_w / sum(full.values())  # inches per byte of one rank's full states

    x = left_in
    columns: list[tuple[int | None, float]] = []
    for rank in ranks:
        columns.append((rank, x))
        x += cell_in if rank is not None else dots_in
    rows_y = top_in + header_in
    for rank, x0 in columns:
        label = str(rank) if rank is not None else "…"
        width = bar_w if rank is not None else dots_in
        ax.text(x0 + width / 2, rows_y - 0.1, label, ha="center", va="bottom", fontsize=FONT_PT,
                gid=f"rank:{rank if rank is not None else 'more'}")
    ax.text(0.1, rows_y - 0.1, "rank", ha="left", va="bottom", fontsize=FONT_PT, weight="bold")
    ax.text(WIDTH_IN - 0.1, rows_y - 0.1, "per rank", ha="right", va="bottom", fontsize=FONT_PT, weight="bold")

    for stage in memory.STAGES:
        y = rows_y + stage * row_in + (row_in - bar_in) / 2
        ax.text(0.1, y + bar_in / 2, STAGE_LABELS[stage], ha="left", va="center", fontsize=FONT_PT + 1,
                gid=f"stage:{stage}")
        for rank, x0 in columns:
            if rank is None:
                ax.text(x0 + dots_in / 2, y + bar_in / 2, "…", ha="center", va="center", fontsize=FONT_PT + 1)
                continue
            at = x0
            for kind in STATE_KINDS:
                width = full[kind] * scale
                color = KIND_COLORS[kind]
                ax.add_patch(Rectangle((at, y), width, bar_in, facecolor="none", edgecolor=color, lw=0.8,
                                       gid=f"segment:{stage}:{rank}:{kind}"))
                start, end = held_span(params, world, rank, states[stage][kind],
                                       getattr(precision, ELEMENT_BYTES[kind]))
                # edged in its own colour: a slice too thin to fill still shows as a line
                ax.add_patch(Rectangle((at + start * width, y), (end - start) * width, bar_in, facecolor=color,
                                       edgecolor=color, lw=0.6, gid=f"held:{stage}:{rank}:{kind}"))
                at += width
        held = sum(states[stage].values())
        ax.text(WIDTH_IN - 0.1, y + bar_in / 2, _bytes_text(held), ha="right", va="center", fontsize=FONT_PT + 1,
                gid=f"total:{stage}:{held}")

    default = (f"ZeRO: what each of {world} data-parallel ranks holds\n"
               f"{_count_text(params)} parameters, {precision.name}; filled: the rank's own slice")
    ax.text(0.1, 0.1, default if title is None else title, ha="left", va="top", fontsize=TITLE_PT, gid="title")
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor=KIND_COLORS[k], label=k) for k in STATE_KINDS]
    handles.append(Patch(facecolor="none", edgecolor="0.4", label="outline: held by the other ranks"))
    _legend_below(ax, handles, rows_y + row_in * len(memory.STAGES) + 0.12, height)
    return figure


# ---- all-reduce as reduce-scatter then all-gather -------------------------------------------------

MAX_WORLD = 8
PHASES = ("before", "after reduce-scatter", "after all-gather")


def all_reduce_values(world: int, values) -> dict[str, np.ndarray] | None:
    """The numbers each panel writes, {phase: (world, world) with NaN where a rank holds no sum}:
    from the inputs (a list per rank of its `world` chunk values; the sums are computed), or as a
    run measured them ({phase: per rank, its chunks; after reduce-scatter, its one summed chunk})."""
    if values is None:
        return None
    if isinstance(values, dict):
        if set(values) != set(PHASES):
            raise ValueError(f"measured values need the phases {PHASES}; got {tuple(values)}")
        before = np.asarray(values["before"], float)
        shards = np.asarray(values["after reduce-scatter"], float).reshape(-1)
        after = np.asarray(values["after all-gather"], float)
        if before.shape != (world, world) or after.shape != (world, world) or shards.shape != (world,):
            raise ValueError(f"measured values on {world} ranks need {world} chunks per rank before and after, "
                             f"and one summed chunk per rank between; got {before.shape}, {shards.shape}, "
                             f"{after.shape}")
    else:
        before = np.asarray(values, float)
        if before.shape != (world, world):
            raise ValueError(f"give each of the {world} ranks {world} chunk values; got shape {before.shape}")
        shards, after = before.sum(axis=0), np.tile(before.sum(axis=0), (world, 1))  # what the collective sums
    middle = np.full((world, world), np.nan)
    middle[np.arange(world), np.arange(world)] = shards  # rank r reduces chunk r
    return {"before": before, "after reduce-scatter": middle, "after all-gather": after}


def _dark(color) -> bool:
    """Whether white text reads better than black on `color` (its luminance, Rec. 709)."""
    r, g, b = color[:3]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5


def _number(value: float) -> str:
    return f"{value:.4g}"


def draw_all_reduce(world: int, values=None, tensor_bytes: int | None = None, title: str | None = None) -> Figure:
    """Three panels, one row per rank and one box per chunk of its tensor: before; after the
    reduce-scatter, where rank r holds chunk r summed over the ranks (its other chunks outlined:
    stale); after the all-gather, where every rank holds every summed chunk. Chunk c is drawn in
    colour c. `values` (see `all_reduce_values`) are written in the boxes, else symbols: A0 is
    rank 0's chunk A. Between panels, what each rank sends: (N - 1) / N of the tensor per phase,
    in bytes when `tensor_bytes` (one rank's whole tensor) is given."""
    if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= MAX_WORLD:
        raise ValueError(f"draw an all-reduce on 2 to {MAX_WORLD} ranks; got {world!r}")
    numbers = all_reduce_values(world, values)
    left_in, right_in, row_in, box_in = 0.8, 0.15, 0.27, 0.21
    chunk_in = min(0.9, (WIDTH_IN - left_in - right_in) / world)
    x0 = left_in + (WIDTH_IN - left_in - right_in - chunk_in * world) / 2
    top_in, head_in, step_in = 0.62, 0.3, 0.5
    panel_in = head_in + row_in * world
    height = top_in + 3 * panel_in + 2 * step_in + 0.1
    figure = Figure(figsize=(WIDTH_IN, height))
    ax = _inch_axes(figure, height)
    letters = [chr(ord("A") + c) for c in range(world)]
    heads = {"before": f"before: each rank holds its own tensor, in {world} chunks",
             "after reduce-scatter": "after reduce-scatter: rank r holds chunk r, summed over the ranks",
             "after all-gather": "after all-gather: every rank holds every summed chunk"}
    share = Fraction(world - 1, world)
    sent = "" if tensor_bytes is None else f" = {_bytes_text(float(share * tensor_bytes))}"
    steps = {"reduce-scatter": f"↓ reduce-scatter: each rank sends {world - 1} of its {world} chunks, "
                               f"{share.numerator}/{share.denominator} of the tensor{sent}",
             "all-gather": f"↓ all-gather: each rank sends its summed chunk to "
                           f"{'the other rank' if world == 2 else f'the {world - 1} others'}, "
                           f"{share.numerator}/{share.denominator} of the tensor{sent}"}
    y = top_in
    for p, phase in enumerate(PHASES):
        if p:
            step = ("reduce-scatter", "all-gather")[p - 1]
            ax.text(0.1, y + step_in / 2, steps[step], ha="left", va="center", fontsize=FONT_PT,
                    style="italic", gid=f"sends:{step}")
            y += step_in
        ax.text(0.1, y + head_in / 2, heads[phase], ha="left", va="center", fontsize=FONT_PT + 0.5, weight="bold",
                gid=f"panel:{phase}")
        y += head_in
        for rank in range(world):
            ry = y + rank * row_in
            ax.text(x0 - 0.08, ry + box_in / 2, f"rank {rank}", ha="right", va="center", fontsize=FONT_PT)
            for c in range(world):
                held = phase != "after reduce-scatter" or c == rank
                summed = phase != "before"
                color = CHUNK_COLORS[c % 10]
                face = "none" if not held else color
                ax.add_patch(Rectangle((x0 + c * chunk_in + 0.02, ry), chunk_in - 0.04, box_in, facecolor=face,
                                       alpha=None if not held else (0.9 if summed else 0.35),
                                       edgecolor=color, lw=0.8, ls="-" if held else "--",
                                       gid=f"chunk:{phase}:{rank}:{c}:{'held' if held else 'stale'}"))
                if not held:
                    continue
                if numbers is not None:
                    text = _number(numbers[phase][rank, c])
                else:
                    text = f"Σ{letters[c]}" if summed else f"{letters[c]}{rank}"
                ax.text(x0 + (c + 0.5) * chunk_in, ry + box_in / 2, text, ha="center", va="center",
                        fontsize=FONT_PT, color="white" if summed and _dark(color) else "black",
                        gid=f"value:{phase}:{rank}:{c}")
        y += row_in * world
    default = (f"all-reduce on {world} ranks: a reduce-scatter, then an all-gather;\n"
               f"each rank sends 2 × {share.numerator}/{share.denominator} of its tensor in all")
    ax.text(0.1, 0.12, default if title is None else title, ha="left", va="top", fontsize=TITLE_PT, gid="title")
    return figure


# ---- pipeline timelines ---------------------------------------------------------------------------

MAX_STAGES = 16
OP_COLORS = {"F": "#4c72b0", "B": "#dd8452"}
OP_TEXT = {"F": "white", "B": "black"}
IDLE_HATCH = "////"
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def as_timelines(logs_or_timelines) -> list[list[tuple[str, int, float, float]]]:
    """Per rank, (kind, micro, start, end): `pipeline.timelines` of a list of `pipeline.Log`, or
    such timelines as given (saved from a run, say), checked."""
    runs = list(logs_or_timelines)
    if runs and all(hasattr(run, "events") for run in runs):
        from infra_lab.parallel import pipeline

        runs = pipeline.timelines(runs)
    lines = [[(str(k), int(i), float(s), float(e)) for k, i, s, e in ops] for ops in runs]
    if not lines or not all(lines) or len(lines) > MAX_STAGES:
        raise ValueError(f"draw 1 to {MAX_STAGES} stages, each with at least one operation; got {len(lines)} ranks")
    for rank, ops in enumerate(lines):
        for kind, micro, start, end in ops:
            if kind not in OP_COLORS or end < start:
                raise ValueError(f"rank {rank}: ({kind!r}, {micro}, {start}, {end}) is not an operation "
                                 "(kind 'F' or 'B', start <= end)")
    return lines


def idle_share(timelines: list[list[tuple[str, int, float, float]]]) -> float:
    """`pipeline.idle_share` read from timelines: 1 - (busy time over ranks) / (p x span)."""
    starts = [s for ops in timelines for _, _, s, _ in ops]
    ends = [e for ops in timelines for *_, e in ops]
    busy = sum(e - s for ops in timelines for _, _, s, e in ops)
    return 1.0 - busy / (len(timelines) * (max(ends) - min(starts)))


def ideal_timelines(kind: str, stages: int, micro_batches: int, forward: float = 1.0,
                    backward: float = 2.0) -> list[list[tuple[str, int, float, float]]]:
    """`pipeline.schedule` timed on balanced stages: each rank runs its operations in order, each
    as soon as the rank is free and its input has arrived (forward i from the previous stage's
    forward i, backward i from the next stage's backward i), taking `forward` or `backward`."""
    from infra_lab.parallel import pipeline

    plan = pipeline.schedule(kind, stages, micro_batches)
    done: dict[tuple[int, str, int], float] = {}  # (rank, kind, micro) -> end
    lines: list[list[tuple[str, int, float, float]]] = [[] for _ in range(stages)]
    free = [0.0] * stages
    while any(len(lines[r]) < len(plan[r]) for r in range(stages)):
        progressed = False
        for rank in range(stages):
            while len(lines[rank]) < len(plan[rank]):
                op, micro = plan[rank][len(lines[rank])]
                needs = [(rank - 1, "F", micro)] if op == "F" and rank > 0 else []
                needs += [(rank + 1, "B", micro)] if op == "B" and rank < stages - 1 else []
                if any(need not in done for need in needs):
                    break
                start = max([free[rank]] + [done[need] for need in needs])
                free[rank] = start + (forward if op == "F" else backward)
                done[(rank, op, micro)] = free[rank]
                lines[rank].append((op, micro, start, free[rank]))
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {kind} schedule deadlocks on {stages} stages")
    return lines


def _draw_timelines(lines, title: str, scale: float, xlabel: str) -> Figure:
    """The timelines' boxes, x = seconds x `scale`; the title states the idle share and the formula."""
    p = len(lines)
    m = sum(op == "F" for op, *_ in lines[0])
    share, formula = idle_share(lines), (p - 1) / (m + p - 1)
    row_in = min(0.42, 4.2 / p)
    left_in, right_in, top_in, bottom_in = 0.75, 0.25, 0.62, 0.95
    height = top_in + row_in * p + bottom_in
    figure = Figure(figsize=(WIDTH_IN, height))
    ax = figure.add_axes((left_in / WIDTH_IN, bottom_in / height, (WIDTH_IN - left_in - right_in) / WIDTH_IN,
                          row_in * p / height))
    first = min(s for ops in lines for _, _, s, _ in ops)
    last = max(e for ops in lines for *_, e in ops)
    x_hi = last * scale * 1.01
    in_per_x = (WIDTH_IN - left_in - right_in) / x_hi
    fill, labelled = 0.78, False
    for rank, ops in enumerate(lines):  # the run's span, hatched: idle wherever no box covers it
        ax.add_patch(Rectangle((first * scale, rank - fill / 2), (last - first) * scale, fill, facecolor="white",
                               edgecolor="0.6", hatch=IDLE_HATCH, lw=0, gid=f"idle:{rank}"))
        for op, micro, start, end in ops:
            x0, width = start * scale, (end - start) * scale
            ax.add_patch(Rectangle((x0, rank - fill / 2), width, fill, facecolor=OP_COLORS[op], edgecolor="white",
                                   lw=0.5, gid=f"op:{rank}:{op}:{micro}"))
            label = str(micro)
            if width * in_per_x >= text_in(label) + 0.05 and row_in * 72 * fill >= FONT_PT + 2:
                ax.text(x0 + width / 2, rank, label, ha="center", va="center", fontsize=FONT_PT,
                        color=OP_TEXT[op], gid=f"micro:{rank}:{op}:{micro}")
                labelled = True
    ax.set(xlim=(0, x_hi), ylim=(p - 0.5, -0.5))
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.tick_params(labelsize=FONT_PT, length=3)
    ax.set_xlabel(xlabel, fontsize=FONT_PT + 1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{title}: p = {p} stages, m = {m} micro-batches\nidle {share:.1%} of the stages' time; "
                 f"bubble (p − 1)/(m + p − 1) = {formula:.1%}", fontsize=TITLE_PT, loc="left",
                 x=-(left_in - 0.1) / (WIDTH_IN - left_in - right_in))  # from the page's left edge
    handles = [Patch(facecolor=OP_COLORS["F"], label="forward" + (" (number: micro-batch)" if labelled else "")),
               Patch(facecolor=OP_COLORS["B"], label="backward"),
               Patch(facecolor="white", edgecolor="0.6", hatch=IDLE_HATCH, label="idle")]
    _legend_below(ax, handles, top_in + row_in * p + 0.55, height)
    return figure


def draw_pipeline(logs_or_timelines, title: str = "pipeline run, measured") -> Figure:
    """One row per stage of a real run: its forwards and backwards as boxes on the run's clock (ms
    from the earliest rank's start, s for runs over 5 s), labelled with their micro-batch where
    wide enough, the idle time between hatched. The title sets the measured idle share
    (`pipeline.idle_share`) beside the balanced-stage bubble (p - 1) / (m + p - 1).
    Takes a list of `pipeline.Log` or `pipeline.timelines` of one."""
    lines = as_timelines(logs_or_timelines)
    last = max(e for ops in lines for *_, e in ops)
    scale, unit = (1e3, "ms") if last <= 5.0 else (1.0, "s")
    return _draw_timelines(lines, title, scale, f"time ({unit}) since the ranks left the barrier")


def draw_schedule(kind: str, stages: int, micro_batches: int, title: str | None = None) -> Figure:
    """`pipeline.schedule(kind, stages, micro_batches)` on ideal balanced stages, a forward taking
    one time slot and a backward two (`ideal_timelines`): the picture a measured run is held to."""
    if isinstance(stages, int) and stages > MAX_STAGES:
        raise ValueError(f"draw at most {MAX_STAGES} stages; got {stages}")
    lines = ideal_timelines(kind, stages, micro_batches)
    default = f"{SCHEDULE_NAMES[kind]}, ideal"
    return _draw_timelines(lines, default if title is None else title, 1.0,
                           "time (slots: a forward takes 1, a backward 2)")


# ---- the plan explorer ----------------------------------------------------------------------------

TIME_KINDS = ("compute", "tensor-parallel communication", "data-parallel communication", "pipeline bubble")
TIME_COLORS = {"compute": "#55a868", "tensor-parallel communication": "#dd8452",
               "data-parallel communication": "#c44e52", "pipeline bubble": "#bbbbbb"}
MEMORY_AXIS_BYTES = 1.5 * max(hardware.get(g).memory_bytes for g in cost.GPUS)  # one axis for every plan
TIME_AXIS_COMPUTE = 3.0  # the time axis spans this many of the shape's compute times without recompute


def time_axis_s(plan: cost.Plan) -> float:
    """The time axis's top for every plan of this shape, batch, sequence and GPU count: a multiple
    of the step's compute time without recomputation, which no parallel setting changes."""
    return TIME_AXIS_COMPUTE * cost.time_split(dataclasses.replace(plan, recompute=False))["compute"]


def _stacked_bar(ax, parts: dict[str, float], colors: dict[str, str], top: float, unit: float, name: str,
                 fmt) -> list[Patch]:
    """One bar at x = 0 stacking `parts` bottom up in units of `unit`, clipped at `top` (an arrow
    and the total mark a clipped bar); legend handles with each part's value, top part first."""
    total = sum(parts.values())
    at, handles = 0.0, []
    for kind, value in parts.items():
        height = min(value, max(top - at, 0.0))
        ax.add_patch(Rectangle((-0.4, min(at, top) / unit), 0.8, height / unit, facecolor=colors[kind],
                               edgecolor="white", lw=0.5, hatch=IDLE_HATCH if kind == "pipeline bubble" else None,
                               gid=f"{name}:{kind}:{value!r}"))
        at += value
        handles.append(Patch(facecolor=colors[kind], hatch=IDLE_HATCH if kind == "pipeline bubble" else None,
                             label=f"{kind}: {fmt(value)}"))
    if total > top:
        ax.text(0, top / unit, f"↑ {fmt(total)}", ha="center", va="bottom", fontsize=FONT_PT, weight="bold",
                gid=f"{name}-clipped:{total!r}")
    return handles[::-1]


def draw_plan(plan: cost.Plan) -> Figure:
    """Left, memory per GPU by kind (`plan.memory_per_gpu`) stacked against the GPU's memory, with
    "does not fit" when over; right, the step's seconds by kind (`plan.time_split`). The memory
    axis is the same for every plan and the time axis for every plan of a shape (`time_axis_s`),
    so switching settings compares like with like; a bar past its axis is clipped, marked ↑."""
    plan.check()
    held = cost.memory_per_gpu(plan)
    seconds = cost.time_split(plan)
    capacity = hardware.get(plan.gpu).memory_bytes
    step = sum(seconds.values())
    time_top = time_axis_s(plan)
    time_unit, time_name = (1.0, "s") if time_top >= 1.0 else (1e-3, "ms")

    height, axes_in, legend_in = 4.3, 2.3, 1.25
    figure = Figure(figsize=(WIDTH_IN, height))
    axes = []
    for left_in in (0.7, 3.85):
        axes.append(figure.add_axes((left_in / WIDTH_IN, legend_in / height, 2.2 / WIDTH_IN, axes_in / height)))
    memory_ax, time_ax = axes

    gb = 1e9
    handles = _stacked_bar(memory_ax, {k: held[k] for k in memory.KINDS}, KIND_COLORS, MEMORY_AXIS_BYTES, gb,
                           "memory", _bytes_text)
    memory_ax.axhline(capacity / gb, color="black", lw=1.2, ls="--", zorder=3, gid=f"capacity:{capacity!r}")
    fits = sum(held.values()) <= capacity
    memory_ax.text(0.47, capacity / gb, f"{plan.gpu}\n{_bytes_text(capacity)}", ha="left", va="center",
                   fontsize=FONT_PT, backgroundcolor="white", gid="capacity-label")
    if not fits:
        memory_ax.text(0.98, 0.98, "does not fit", transform=memory_ax.transAxes, ha="right", va="top",
                       fontsize=FONT_PT + 1, weight="bold", color="#c44e52",
                       gid=f"does-not-fit:{sum(held.values())!r}")
    memory_ax.set(xlim=(-0.6, 1.6), ylim=(0, MEMORY_AXIS_BYTES / gb * 1.08), xticks=[])
    memory_ax.set_ylabel("GB per GPU", fontsize=FONT_PT + 1)
    memory_ax.set_title(f"memory per GPU: {_bytes_text(sum(held.values()))}", fontsize=TITLE_PT)
    memory_ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.45, -0.04), fontsize=FONT_PT,
                     frameon=False, handlelength=1.2, borderaxespad=0)

    def seconds_text(s: float) -> str:
        return f"{s:.3g} s" if s >= 1 or s == 0 else f"{s * 1e3:.3g} ms"

    handles = _stacked_bar(time_ax, {k: seconds[k] for k in TIME_KINDS}, TIME_COLORS, time_top, time_unit,
                           "time", seconds_text)
    time_ax.set(xlim=(-0.6, 1.6), ylim=(0, time_top / time_unit * 1.08), xticks=[])
    time_ax.set_ylabel("seconds per step" if time_name == "s" else "ms per step", fontsize=FONT_PT + 1)
    time_ax.set_title(f"step {seconds_text(step)}, {seconds['compute'] / step:.0%} compute", fontsize=TITLE_PT)
    time_ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.45, -0.04), fontsize=FONT_PT,
                   frameon=False, handlelength=1.2, borderaxespad=0)
    for ax in axes:
        ax.tick_params(labelsize=FONT_PT)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)

    s = plan.shape
    figure.text(0.1 / WIDTH_IN, 1 - 0.1 / height,
                f"{s.name} on {plan.gpus} × {plan.gpu}: ZeRO stage {plan.stage}, tensor {plan.tensor} × "
                f"pipeline {plan.pipeline} × data {plan.data}\n{plan.micro_batches} micro-batch"
                f"{'es' if plan.micro_batches != 1 else ''} of "
                f"{plan.micro_batch} × {plan.sequence} tokens, recompute {'on' if plan.recompute else 'off'}",
                ha="left", va="top", fontsize=TITLE_PT, gid="title")
    return figure


def draw_plan_or_why(plan: cost.Plan) -> Figure:
    """`draw_plan`, or for a plan the cluster cannot run (a layout that does not divide the GPUs,
    the heads or the batch) a figure that says why, so a live explorer never shows a traceback."""
    try:
        return draw_plan(plan)
    except ValueError as error:
        figure = Figure(figsize=(WIDTH_IN, 1.2))
        figure.text(0.02, 0.5, textwrap.fill(f"This setting cannot run: {error}.", 90), va="center",
                    fontsize=FONT_PT)
        return figure
