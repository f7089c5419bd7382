"""Chapter 09's diagrams of a mixture of experts, drawn from live objects of `infra_lab.moe`.

- `draw_routing`: a real batch's tokens (rows) against the experts (columns), each chosen cell
  shaded by its gate weight and crossed where the expert's capacity was full, with each
  expert's load beside the capacity line.
- `draw_permutation`: the sort that dispatch makes. Assignments in token order on the left, the
  same assignments grouped by expert on the right (each expert's run is one dense block of rows
  for its GEMM), and an arrow per assignment: the inverse permutation, slot_of, read backwards.
- `draw_all_to_all`: an expert-parallel exchange from its send counts: each rank's send buffer,
  cut into one segment per destination rank, and the receive buffers they land in.
- `draw_balancing`: the same tokens balanced four ways (none, the Switch auxiliary loss,
  DeepSeek-V3's bias, EPLB's placement), each expert's load beside the router's mean
  probability for it, from `balance`, which runs each method with the package's own functions.

Every box carries a gid naming what it stands for, so the tests read the picture back.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from infra_lab.moe import placement, routing
from infra_lab.moe.dispatch import Dispatch
from infra_lab.moe.routing import Routing

EXPERT_COLORS = plt.get_cmap("tab10").colors  # expert e (and rank r) is drawn in colour e % 10
MAX_TOKENS = 32  # rows of the routing grid; more would shrink a row below its 9-pt label
MAX_ASSIGNMENTS = 40  # boxes per column of the permutation


def _label(token: int) -> str:
    """A byte as the reader would write it: printable, or its escape."""
    text = bytes([token]).decode("latin-1")
    return text if text.isprintable() and text != " " else repr(text)[1:-1] if text != " " else "␣"


def draw_routing(routing: Routing, tokens: np.ndarray, slots: int | None = None,
                 title: str | None = None) -> plt.Figure:
    """Tokens (T,) byte values routed by `routing` (T, k): one row per token, one column per
    expert; a chosen cell is shaded by its gate weight and holds its rank of choice (1 = first),
    a dropped one is crossed. Right: the assignments each expert received, against `slots`."""
    n_tokens, k = routing.experts.shape
    n_experts = routing.probs.shape[1]
    if n_tokens > MAX_TOKENS or len(tokens) != n_tokens:
        raise ValueError(f"draw at most {MAX_TOKENS} tokens, one byte per routing row; got {len(tokens)} bytes "
                         f"for {n_tokens} rows")
    fig, (grid, bars) = plt.subplots(1, 2, figsize=(6.5, 0.22 * n_tokens + 1.4), width_ratios=[3, 2],
                                     layout="constrained")
    for t in range(n_tokens):
        for j in range(k):
            e, weight = int(routing.experts[t, j]), float(routing.weights[t, j])
            cell = Rectangle((e, t), 1, 1, facecolor=EXPERT_COLORS[e % 10], alpha=0.25 + 0.75 * weight,
                             edgecolor="white", gid=f"choice:{t}:{e}:{j}")
            grid.add_patch(cell)
            kept = bool(routing.kept[t, j])
            grid.text(e + 0.5, t + 0.5, str(j + 1) if kept else "×", ha="center", va="center", fontsize=9,
                      color="black" if kept else "darkred", gid=f"mark:{t}:{e}:{'kept' if kept else 'dropped'}")
    grid.set(xlim=(0, n_experts), ylim=(n_tokens, 0), xlabel="expert", ylabel="byte",
             title=title or "tokens routed to experts")
    grid.set_xticks(np.arange(n_experts) + 0.5, [str(e) for e in range(n_experts)])
    grid.set_yticks(np.arange(n_tokens) + 0.5, [_label(int(b)) for b in tokens], fontsize=9, family="monospace")
    grid.tick_params(length=0)
    received = np.bincount(routing.experts.reshape(-1), minlength=n_experts)
    kept_counts = np.bincount(routing.experts[routing.kept], minlength=n_experts)
    for e in range(n_experts):
        bars.barh(e, received[e], color="white", edgecolor=EXPERT_COLORS[e % 10], gid=f"received:{e}")
        bars.barh(e, kept_counts[e], color=EXPERT_COLORS[e % 10], gid=f"kept:{e}")
    if slots is not None:
        bars.axvline(slots, color="black", ls="--", lw=1, label=f"capacity {slots}")
    bars.axvline(n_tokens * k / n_experts, color="grey", ls=":", lw=1, label="mean")
    bars.legend(fontsize=9, loc="lower right")
    bars.set(yticks=range(n_experts), ylim=(n_experts - 0.5, -0.5), xlabel="assignments (outline: received)",
             ylabel="expert", title="load per expert")
    return fig


def draw_permutation(dispatch: Dispatch, title: str | None = None) -> plt.Figure:
    """Left, the kept assignments (t, j) in token order; right, the sorted rows, expert by
    expert; an arrow from each assignment to its row slot_of[t, j]. Dropped ones stay grey."""
    n_tokens, k = dispatch.slot_of.shape
    total = n_tokens * k
    if total > MAX_ASSIGNMENTS:
        raise ValueError(f"draw at most {MAX_ASSIGNMENTS} assignments; got {n_tokens} tokens x {k}")
    experts = np.full(total, -1)
    rows = np.searchsorted(dispatch.offsets, np.arange(len(dispatch.tokens)), side="right") - 1  # row -> expert
    flat_slots = dispatch.slot_of.reshape(-1)
    experts[flat_slots >= 0] = rows[flat_slots[flat_slots >= 0]]
    fig, ax = plt.subplots(figsize=(6.5, 0.2 * total + 1.0), layout="constrained")
    left, right, width = 0.0, 4.0, 1.3
    for a in range(total):
        t, j = divmod(a, k)
        e = int(experts[a])
        face = EXPERT_COLORS[e % 10] if e >= 0 else "#e0e0e0"
        ax.add_patch(Rectangle((left, a), width, 0.9, facecolor=face, alpha=0.6, gid=f"assignment:{t}:{j}"))
        ax.text(left + width / 2, a + 0.45, f"t{t}·{j + 1}" + ("" if e >= 0 else " ×"), ha="center",
                va="center", fontsize=9)
        if e >= 0:
            row = int(flat_slots[a])
            ax.add_patch(FancyArrowPatch((left + width, a + 0.45), (right, row + 0.45), arrowstyle="-|>",
                                         mutation_scale=7, lw=0.6, color="grey", gid=f"arrow:{t}:{j}:{row}"))
    for row, token in enumerate(dispatch.tokens):
        e = int(rows[row])
        ax.add_patch(Rectangle((right, row), width, 0.9, facecolor=EXPERT_COLORS[e % 10], alpha=0.6,
                               gid=f"row:{row}:{int(token)}:{e}"))
        ax.text(right + width / 2, row + 0.45, f"row {row}: t{int(token)}", ha="center", va="center", fontsize=9)
    for e in range(len(dispatch.offsets) - 1):
        start, end = int(dispatch.offsets[e]), int(dispatch.offsets[e + 1])
        if end > start:
            rows_text = f"{end - start} row{'s' if end - start != 1 else ''}"
            ax.text(right + width + 0.15, (start + end) / 2, f"expert {e}: {rows_text}", va="center",
                    fontsize=9, color=EXPERT_COLORS[e % 10])
    ax.text(left + width / 2, -0.6, "token order", ha="center", fontsize=9, weight="bold")
    ax.text(right + width / 2, -0.6, "sorted by expert", ha="center", fontsize=9, weight="bold")
    ax.set(xlim=(-0.2, right + width + 2.4), ylim=(total + 0.2, -1.2), title=title or "dispatch: a stable sort")
    ax.axis("off")
    return fig


def _light(color, amount: float = 0.55) -> tuple:
    return tuple(amount * 1.0 + (1 - amount) * c for c in color)


def draw_all_to_all(send_counts: np.ndarray, bytes_per_row: int, title: str | None = None) -> plt.Figure:
    """send_counts (R, R): rows rank r sends rank s. Left, each rank's send buffer, in its own
    colour, cut into one segment per destination; right, each rank's receive buffer, one segment
    per source in the source's colour; a line joins each segment to where it lands. Widths are
    to scale."""
    send_counts = np.asarray(send_counts, np.int64)
    world = send_counts.shape[0] if send_counts.ndim == 2 else 0
    if send_counts.shape != (world, world) or world < 1 or (send_counts < 0).any():
        raise ValueError(f"send counts must be a square (ranks, ranks) array of counts >= 0; got {send_counts.shape}")
    fig, ax = plt.subplots(figsize=(6.5, 0.9 + 0.75 * world), layout="constrained")
    scale = 1.0 / max(send_counts.sum(1).max(), send_counts.sum(0).max(), 1)
    send_x, receive_x, height = 0.0, 1.9, 0.55
    for r in range(world):
        ax.text(send_x - 0.04, r + height / 2, f"rank {r} sends", ha="right", va="center", fontsize=9)
        ax.text(receive_x + 1.04, r + height / 2, f"rank {r} gets", ha="left", va="center", fontsize=9)
    for r in range(world):
        for s in range(world):
            rows = int(send_counts[r, s])
            if not rows:
                continue
            width = rows * scale
            send_at = send_x + send_counts[r, :s].sum() * scale
            receive_at = receive_x + send_counts[:r, s].sum() * scale
            color = _light(EXPERT_COLORS[r % 10])
            ax.add_patch(Rectangle((send_at, r), width, height, facecolor=color, edgecolor="black", lw=0.6,
                                   zorder=2, gid=f"send:{r}:{s}:{rows}"))
            ax.add_patch(Rectangle((receive_at, s), width, height, facecolor=color, edgecolor="black", lw=0.6,
                                   zorder=2, gid=f"receive:{s}:{r}:{rows}"))
            if r != s:  # a rank's own rows stay in its memory
                ax.plot([send_at + width / 2, receive_at + width / 2], [r + height, s],
                        color=EXPERT_COLORS[r % 10], lw=0.8, alpha=0.7, zorder=1, gid=f"exchange:{r}:{s}")
            if width > 0.16:
                ax.text(send_at + width / 2, r + height / 2, f"→{s}", ha="center", va="center", fontsize=9, zorder=3)
                ax.text(receive_at + width / 2, s + height / 2, f"{r}→", ha="center", va="center", fontsize=9,
                        zorder=3)
    crossing = int(send_counts.sum() - np.trace(send_counts))
    ax.set_title(title or f"all-to-all: {crossing:,} rows ({crossing * bytes_per_row / 1e3:,.1f} kB) cross ranks; "
                          "each rank's own share stays home", fontsize=10)
    ax.set(xlim=(-0.9, receive_x + 1.75), ylim=(world - 0.3, -0.3))
    ax.axis("off")
    return fig


MAX_BALANCED_EXPERTS = 16  # columns per panel of the balancing figure; more would crowd the 9-pt ticks
LABEL_ROOM = 0.1  # the share of a balancing panel's height that a 9-pt label needs
METHOD_TITLES = {"none": "no balancing", "aux": "auxiliary loss (Switch)", "bias": "bias (DeepSeek-V3)"}


class Balanced(NamedTuple):
    routings: dict[str, Routing]  # "none", "aux", "bias": the shown tokens routed (dropless) by each
    bias: np.ndarray  # (E,) float32: DeepSeek-V3's bias after `steps` calls of routing.update_bias
    offset: np.ndarray  # (E,) float32: the logit offset that `steps` gradient steps on the aux loss trained
    aux_loss: tuple[float, float]  # routing.switch_aux_loss on the shown tokens, before and after
    fit_loads: np.ndarray  # (E,) assignments per expert on the fitting tokens, unbalanced: what EPLB places by
    steps: int

    def loads(self, method: str) -> np.ndarray:
        """(E,) assignments each expert received under `method`."""
        chosen = self.routings[method]
        return routing.expert_loads(chosen.experts, chosen.kept, chosen.probs.shape[1])


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    return int(value)


def balance(fit_logits, logits, k: int, steps: int = 60, rate: float = 0.005,
            aux_step: float = 2.4) -> Balanced:
    """Start each method from the same router (bias 0) and give it `steps` steps on the router
    logits `fit_logits` (T, E); then route `logits` (T', E), the tokens shown, with what it
    learned (EPLB, drawn by `draw_balancing`, places the experts by the fitting tokens' loads):
    - "bias": routing.update_bias at `rate`, on every step's loads; it moves only the choice;
    - "aux": gradient steps of size `aux_step` on the Switch loss (torch_moe.switch_aux_loss, by
      autograd) for one offset per expert added to every token's logits: the probabilities move,
      and with them the gate weights (a model moves its router's weights the same way);
    - "none": the router as it is."""
    import torch

    from infra_lab.moe import torch_moe

    fit_logits, logits = np.asarray(fit_logits, np.float32), np.asarray(logits, np.float32)
    if fit_logits.ndim != 2 or logits.ndim != 2 or fit_logits.shape[1] != logits.shape[1]:
        raise ValueError(f"need two (tokens, experts) batches of router logits over the same experts; got "
                         f"{fit_logits.shape} and {logits.shape}")
    steps = _positive_int("steps", steps)
    for name, value in (("rate", rate), ("aux_step", aux_step)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0; got {value!r}")
    n_experts = logits.shape[1]
    bias = np.zeros(n_experts, np.float32)
    for _ in range(steps):
        chosen = routing.route(fit_logits, k, bias=bias)
        bias = routing.update_bias(bias, routing.expert_loads(chosen.experts, chosen.kept, n_experts), rate)
    offset = torch.zeros(n_experts, requires_grad=True)
    fit = torch.from_numpy(fit_logits)
    for _ in range(steps):
        loss = torch_moe.switch_aux_loss(torch_moe.route(fit + offset, k))
        (gradient,) = torch.autograd.grad(loss, offset)  # flows through the mean probabilities P_i
        with torch.no_grad():
            offset -= aux_step * gradient
    offset = offset.detach().numpy()
    routings = {"none": routing.route(logits, k), "aux": routing.route(logits + offset, k),
                "bias": routing.route(logits, k, bias=bias)}
    before, after = (routing.switch_aux_loss(routings[m].probs, routings[m].experts) for m in ("none", "aux"))
    unbalanced = routing.route(fit_logits, k)
    fit_loads = routing.expert_loads(unbalanced.experts, unbalanced.kept, n_experts)
    return Balanced(routings, bias, offset, (before, after), fit_loads, steps)


def _ratio(values: np.ndarray) -> float:
    return float(values.max() / values.mean())


def draw_balancing(balanced: Balanced, gpus: int = 4, replicas: int = 12, title: str | None = None) -> plt.Figure:
    """Four panels on one scale, load over the mean load. Three per expert (none, aux, bias):
    its assignments as a column in the expert's colour, the router's mean probability for it
    times E as a dot (both 1 when even), the max/mean of the loads above. The fourth per GPU:
    the unbalanced loads served by EPLB's placement (moe.placement, `replicas` slots on `gpus`
    GPUs, placed by the fitting tokens' loads), each column stacked from its replicas' shares,
    beside plain expert parallelism's (outlined)."""
    n_experts = balanced.routings["none"].probs.shape[1]
    if not 1 <= n_experts <= MAX_BALANCED_EXPERTS:
        raise ValueError(f"draw at most {MAX_BALANCED_EXPERTS} experts; got {n_experts}")
    gpus, replicas = _positive_int("gpus", gpus), _positive_int("replicas", replicas)
    unbalanced = balanced.loads("none").astype(np.float64)[None]  # (1 layer, E)
    placed = placement.place(balanced.fit_loads[None], replicas, gpus=gpus)  # names what does not divide
    eplb = placement.gpu_loads(unbalanced, placed, gpus)[0]
    plain = placement.contiguous_loads(unbalanced, gpus)[0]
    loads = {m: balanced.loads(m) for m in METHOD_TITLES}
    means = {m: balanced.routings[m].probs.mean(0) * n_experts for m in METHOD_TITLES}  # P_i * E
    top = 1.3 * max(max(_ratio(v) for v in loads.values()), max(v.max() for v in means.values()),
                    _ratio(plain), _ratio(eplb))
    fig, axes = plt.subplots(2, 2, figsize=(7, 5.6), layout="constrained")
    notes = {"none": "the router alone, bias 0",
             "aux": f"{balanced.steps} gradient steps: loss {balanced.aux_loss[0]:.3f} → {balanced.aux_loss[1]:.3f}",
             "bias": f"{balanced.steps} bias steps; probabilities untouched"}
    for ax, method in zip(axes.flat, METHOD_TITLES):
        shares = loads[method] / loads[method].mean()
        for e in range(n_experts):
            ax.bar(e, shares[e], color=EXPERT_COLORS[e % 10], alpha=0.8, gid=f"load:{method}:{e}:{loads[method][e]}")
        ax.plot(range(n_experts), means[method], "o", color="black", ms=4, gid=f"probability:{method}")
        ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)])
        ax.set(xlabel="expert", title=f"{METHOD_TITLES[method]}\n{notes[method]}")
        _mark_ratio(ax, _ratio(loads[method]), method)
    _draw_placement(axes.flat[3], unbalanced[0], placed, plain, eplb.mean(), top)
    axes.flat[3].set(title=f"EPLB placement, no balancing\n{replicas} slots on {gpus} GPUs; routing untouched")
    _mark_ratio(axes.flat[3], _ratio(eplb), "eplb", f"; plain {_ratio(plain):.2f}")
    for ax in axes.flat:
        ax.axhline(1, color="grey", ls=":", lw=1)
        ax.set_ylim(0, top)
    for ax in axes[:, 0]:
        ax.set_ylabel("load / mean")
    handles = [Patch(color="grey", alpha=0.8, label="load: assignments (colour: expert)"),
               Line2D([], [], marker="o", color="black", ls="", ms=4, label="mean probability × E"),
               Patch(fill=False, edgecolor="black", ls="--", label="plain expert parallelism"),
               Line2D([], [], color="grey", ls=":", label="mean")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=9)
    shown, k = balanced.routings["none"].experts.shape
    fit = int(balanced.fit_loads.sum()) // k
    fig.suptitle(title or f"{shown:,} tokens routed four ways, each way balanced on {fit:,} others")
    return fig


def _mark_ratio(ax, ratio: float, method: str, extra: str = "") -> None:
    ax.text(0.98, 0.95, f"max/mean {ratio:.2f}{extra}", transform=ax.transAxes, ha="right", va="top", fontsize=9,
            gid=f"ratio:{method}")


def _draw_placement(ax, loads: np.ndarray, placed: placement.Placement, plain: np.ndarray, mean: float,
                    top: float) -> None:
    """Per GPU: plain expert parallelism's load outlined, and EPLB's stacked from its slots, each
    replica serving an even share of its expert's load, numbered when there is room for its label;
    all over the mean GPU load `mean`."""
    gpus = len(plain)
    per_gpu = placed.slot_expert.shape[1] // gpus
    for g in range(gpus):
        ax.bar(g, plain[g] / plain.mean(), width=0.8, fill=False, edgecolor="black", ls="--", lw=1,
               gid=f"plain:{g}:{plain[g]:g}")
        bottom = 0.0
        for slot in range(g * per_gpu, (g + 1) * per_gpu):
            expert = int(placed.slot_expert[0, slot])
            share = loads[expert] / placed.replicas[0, expert] / mean
            ax.bar(g, share, bottom=bottom, width=0.6, color=EXPERT_COLORS[expert % 10], alpha=0.8,
                   edgecolor="white", gid=f"replica:{g}:{slot}:{expert}")
            if share > LABEL_ROOM * top:
                ax.text(g, bottom + share / 2, str(expert), ha="center", va="center", fontsize=9,
                        gid=f"expert:{g}:{slot}")
            bottom += share
    ax.set_xticks(range(gpus), [str(g) for g in range(gpus)])
    ax.set(xlabel="GPU (numbers: its experts)")
