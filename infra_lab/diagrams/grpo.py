"""Chapter 11's diagrams of RL post-training, each drawn from the objects of a real run.

- `draw_step`: one GRPO step (Shao et al. 2024, "DeepSeekMath", section 4.1) from a real
  `rl.rollout.Rollout`, its rewards and the trainer's advantages: the engine serving weight
  version v samples G completions per prompt, the verifier scores each, each group's rewards
  become advantages, the loss and the optimizer make version v + 1, and the sync hands it back
  to the engine. `StepPicture` checks that the pieces belong to one step before anything is drawn.
- `draw_timelines`: each layout's processes on one clock from its recorded `rl.loop.Event`s, a
  box per phase (rollout, score, train, sync, evaluate), the gaps idle, with each process's idle
  share over the window drawn.

Every box and number carries a gid naming what it stands for (`sample:p:i`, `advantage:p:i`,
`event:layout:process:k`...), so the tests read the picture back. Figures are
`matplotlib.figure.Figure`s laid out in inches, texts at 9 pt or more; no pyplot state is left open.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

WIDTH_IN = 6.8
FONT_PT = 9
TITLE_PT = 10.5
ROW_IN = 0.2  # one completion's row
GROUP_GAP_IN = 0.12
MAX_ROWS = 24  # completions drawn at most: more groups are left out, a larger group is refused
END_MARK = "⏎"  # the newline that ends an answer, made visible
REWARD_COLORS = {True: "#cfe8cf", False: "#f2d4d4"}  # reward above zero, zero or below
ADVANTAGE_COLORS = {True: "#2e7d32", False: "#c62828"}
PHASES = ("rollout", "score", "train", "sync", "evaluate")
PHASE_COLORS = {"rollout": "#4c72b0", "score": "#55a868", "train": "#dd8452", "sync": "#c44e52",
                "evaluate": "#8172b3"}
PROCESSES = ("rollout", "trainer")


def _visible(text: str) -> str:
    return text.replace("\n", END_MARK) or "(empty)"


def _bytes_text(n: float) -> str:
    for unit, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n:.0f} B"


# ---- one step ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPicture:
    """What one GRPO step is made of, by group: P prompts with G completions each."""
    prompts: tuple[str, ...]  # (P,) "47+85="
    answers: tuple[str, ...]  # (P,) what a correct completion holds before its newline
    completions: tuple[tuple[str, ...], ...]  # (P, G) as sampled
    rewards: np.ndarray  # (P, G)
    advantages: np.ndarray  # (P, G), the same for every token of a completion
    version: int  # the weight version that sampled the rollout
    loss: float
    tokens: int  # completion tokens the loss counted
    kl: float  # mean k3 KL to the reference, nats per token (NaN without a KL term)
    sync_bytes: int  # bytes the sync delivered to the engine
    buckets: int  # how many buckets they went in

    def __post_init__(self):
        groups, size = len(self.prompts), len(self.completions[0]) if self.completions else 0
        if groups == 0 or size < 2:
            raise ValueError(f"a step needs at least one prompt and groups of at least 2 completions; got {groups} "
                             f"prompts and groups of {size}")
        if len(self.answers) != groups or any(len(c) != size for c in self.completions):
            raise ValueError(f"every prompt needs its answer and {size} completions; got {len(self.answers)} "
                             f"answers and groups of {sorted({len(c) for c in self.completions})}")
        for name in ("rewards", "advantages"):
            value = np.asarray(getattr(self, name), dtype=np.float64)
            if value.shape != (groups, size):
                raise ValueError(f"{name} must be (P, G) = ({groups}, {size}), one per completion; got shape "
                                 f"{value.shape}")
            if not np.isfinite(value).all():
                where = [tuple(int(i) for i in w) for w in np.argwhere(~np.isfinite(value))[:3]]
                raise ValueError(f"{name} must be finite; NaN or inf at (prompt, sample) {where}")
            object.__setattr__(self, name, value)
        if self.sync_bytes < 0 or self.buckets < 1 or self.tokens < 0:
            raise ValueError(f"sync_bytes and tokens must be >= 0 and buckets >= 1; got {self.sync_bytes}, "
                             f"{self.tokens} and {self.buckets}")

    @property
    def group(self) -> int:
        return len(self.completions[0])


def picture(rollout, rewards, advantages, stats, sync) -> StepPicture:
    """The StepPicture of a real step: `rollout` (rl.rollout.Rollout), its (B,) `rewards`, the (B,)
    `advantages` the trainer used (LossConfig.advantages), the trainer's StepStats and the sync's
    receipt (rl.sync.Sync, or (nbytes, buckets)). Refuses counts that do not match the rollout and
    a rollout whose tokens came from more than one weight version."""
    size, count = rollout.group, len(rollout.completions)
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    advantages = np.asarray(getattr(advantages, "detach", lambda: advantages)(), dtype=np.float64).reshape(-1)
    for name, value in (("rewards", rewards), ("advantages", advantages)):
        if value.shape != (count,):
            raise ValueError(f"expected {count} {name}, one per completion of the rollout; got {value.size}")
    versions = sorted({v for tokens in rollout.versions for v in tokens})
    if len(versions) > 1:
        raise ValueError(f"one step's rollout comes from one weight version; its tokens came from versions {versions}")
    nbytes, buckets = (sync if isinstance(sync, tuple) else (sync.nbytes, getattr(sync, "buckets", 1)))
    texts = rollout.texts
    return StepPicture(
        prompts=tuple(p.prompt for p in rollout.problems), answers=tuple(p.answer for p in rollout.problems),
        completions=tuple(tuple(texts[p * size:(p + 1) * size]) for p in range(len(rollout.problems))),
        rewards=rewards.reshape(-1, size), advantages=advantages.reshape(-1, size),
        version=versions[0] if versions else 0, loss=float(stats.loss), tokens=int(stats.tokens),
        kl=float(stats.kl_mean), sync_bytes=int(nbytes), buckets=int(buckets))


def shown_groups(step: StepPicture, groups: Sequence[int] | None = None, most: int = 3) -> list[int]:
    """The groups to draw: `groups` as given, or up to `most` that fit MAX_ROWS, groups whose rewards
    differ first (they carry the gradient) and one whose rewards are all equal (zero advantage)."""
    count = len(step.prompts)
    if groups is not None:
        chosen = list(groups)
        bad = [g for g in chosen if not (isinstance(g, (int, np.integer)) and 0 <= g < count)]
        if bad or not chosen or len(set(chosen)) != len(chosen):
            raise ValueError(f"groups must be distinct indices from 0 to {count - 1}, at least one; got {chosen}")
    else:
        fit = max(1, min(most, MAX_ROWS // step.group))
        mixed = [p for p in range(count) if np.ptp(step.rewards[p]) > 0]
        flat = [p for p in range(count) if np.ptp(step.rewards[p]) == 0]
        chosen = (mixed[:fit - 1] + flat[:1] + mixed[fit - 1:])[:fit] if flat else mixed[:fit]
        chosen = chosen or list(range(min(fit, count)))
    if len(chosen) * step.group > MAX_ROWS:
        raise ValueError(f"{len(chosen)} groups of {step.group} make {len(chosen) * step.group} rows; at most "
                         f"{MAX_ROWS} are drawn: show fewer groups")
    return sorted(int(g) for g in chosen)


def _box(ax, x, y, w, h, text, gid, face="white", edge="0.35", size=FONT_PT, **kwargs):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.05", facecolor=face,
                                edgecolor=edge, linewidth=1.0, gid=gid))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, gid=f"{gid}_text",
            linespacing=1.25, **kwargs)


def _arrow(ax, start, end, gid, **kwargs):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, color="0.3", linewidth=1.1,
                                 shrinkA=0, shrinkB=0, gid=gid, **kwargs))


def draw_step(step: StepPicture, groups: Sequence[int] | None = None, title: str | None = None) -> Figure:
    """One GRPO step: the engine's box on top, then per shown group its prompt, its completions
    (filled green where the reward is positive), the rewards and the advantages as bars about zero
    with their values; on the right the loss, the optimizer step and the sync back to the engine."""
    chosen = shown_groups(step, groups)
    rows = len(chosen) * step.group
    top = 0.95  # the table's first row, from the figure's top
    table_h = rows * ROW_IN + (len(chosen) - 1) * GROUP_GAP_IN
    height = top + table_h + 0.45
    above = 0.3 if title else 0.0  # room for the title over the engine's box
    figure = Figure(figsize=(WIDTH_IN, height + above))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, WIDTH_IN), ylim=(height, -above))  # inches down from the engine's box
    ax.axis("off")

    _box(ax, 0.05, 0.08, 4.55, 0.42, f"engine serving weights version {step.version}: "
         f"{len(step.prompts)} prompts × G = {step.group} samples each", "engine", face="#e3ebf6")
    columns = {"prompt": 0.55, "sample": 1.55, "reward": 2.3, "advantage A": 3.55}
    for label, x in columns.items():
        ax.text(x, top - 0.1, label, ha="center", va="bottom", fontsize=FONT_PT, weight="bold",
                gid=f"header:{label}")
    _arrow(ax, (2.3, 0.5), (2.3, 0.64), "arrow:engine")

    scale = max(float(np.abs(step.advantages[chosen]).max()), 1e-12)
    bar_mid, bar_half = 3.25, 0.55  # the bars' zero and their longest half-length, inches
    y = top
    for p in chosen:
        group_h = step.group * ROW_IN
        _box(ax, 0.05, y + 0.02, 1.0, group_h - 0.04, f"{step.prompts[p]}\nwants\n{step.answers[p]}{END_MARK}",
             f"prompt:{p}", face="#f4f4f4", family="monospace")
        ax.plot([bar_mid, bar_mid], [y, y + group_h], color="0.5", linewidth=0.8, gid=f"zero:{p}")
        for i in range(step.group):
            r, a = step.rewards[p, i], step.advantages[p, i]
            row_y = y + i * ROW_IN
            ax.add_patch(Rectangle((1.15, row_y + 0.015), 0.8, ROW_IN - 0.03, facecolor=REWARD_COLORS[bool(r > 0)],
                                   edgecolor="none", gid=f"cell:{p}:{i}"))
            ax.text(1.55, row_y + ROW_IN / 2, _visible(step.completions[p][i]), ha="center", va="center",
                    fontsize=FONT_PT, family="monospace", gid=f"sample:{p}:{i}")
            ax.text(2.3, row_y + ROW_IN / 2, f"{r:g}", ha="center", va="center", fontsize=FONT_PT,
                    gid=f"reward:{p}:{i}")
            width = bar_half * a / scale
            ax.add_patch(Rectangle((bar_mid, row_y + 0.04), width, ROW_IN - 0.08, linewidth=0,
                                   facecolor=ADVANTAGE_COLORS[bool(a >= 0)], gid=f"advantage:{p}:{i}"))
            ax.text(bar_mid + bar_half + 0.08, row_y + ROW_IN / 2, f"{a:+.2f}", ha="left", va="center",
                    fontsize=FONT_PT, gid=f"advantage_value:{p}:{i}")
        y += group_h + GROUP_GAP_IN
    left_out = len(step.prompts) - len(chosen)
    note = (f"{len(chosen)} of {len(step.prompts)} groups shown" if left_out else "every group shown") + \
        "; A = (r − group mean) / group std"
    ax.text(0.05, height - 0.12, note, ha="left", va="bottom", fontsize=FONT_PT, color="0.3", gid="note")

    x, w = 4.85, 1.9
    kl = "no KL term" if math.isnan(step.kl) else f"KL to the reference {step.kl:.2g}"
    boxes = [("loss", f"loss over {step.tokens} tokens:\nclipped ratio × A − β·KL\nvalue {step.loss:+.2g}\n({kl})",
              0.85, "#fbe9d9"),
             ("optimizer", f"AdamW step:\nversion {step.version} → {step.version + 1}", 0.5, "#fbe9d9"),
             ("sync", f"weight sync:\n{_bytes_text(step.sync_bytes)} in {step.buckets} "
                      f"bucket{'s' if step.buckets != 1 else ''}\ninto the engine", 0.62, "#f6dcdc")]
    y, centres = top + 0.05, {}
    for gid, text, h, face in boxes:
        _box(ax, x, y, w, h, text, gid, face=face)
        centres[gid] = (y, y + h)
        y += h + 0.3
    _arrow(ax, (bar_mid + bar_half + 0.5, top + 0.45), (x, top + 0.45), "arrow:advantages")
    _arrow(ax, (x + w / 2, centres["loss"][1]), (x + w / 2, centres["optimizer"][0]), "arrow:loss")
    _arrow(ax, (x + w / 2, centres["optimizer"][1]), (x + w / 2, centres["sync"][0]), "arrow:optimizer")
    back = x + w - 0.12  # the way back up, inside the page
    ax.plot([x + w, back + 0.1, back + 0.1], [sum(centres["sync"]) / 2] * 2 + [0.29], color="0.3",
            linewidth=1.1, gid="arrow:sync_line")
    _arrow(ax, (back + 0.1, 0.29), (4.6, 0.29), "arrow:sync")
    ax.text(x + w / 2, 0.2, f"next step: version {step.version + 1}", ha="center", va="center",
            fontsize=FONT_PT, color="0.3", gid="next")
    if title:
        ax.text(WIDTH_IN / 2, -above / 2, title, ha="center", va="center", fontsize=TITLE_PT, gid="title")
    return figure


# ---- the layouts' timelines ------------------------------------------------------------------------

def _field(event, name):
    return event[name] if isinstance(event, Mapping) else getattr(event, name)


def check_events(events: Sequence) -> None:
    """ValueError naming the first event that is not (process, phase, start_s <= end_s)."""
    if not events:
        raise ValueError("no events to draw; a timeline needs at least one")
    for k, e in enumerate(events):
        process, phase, start, end = (_field(e, n) for n in ("process", "phase", "start_s", "end_s"))
        if process not in PROCESSES or phase not in PHASES:
            raise ValueError(f"event {k}: process {process!r}, phase {phase!r}; allowed are {PROCESSES} and {PHASES}")
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"event {k} ({process} {phase}) ends at {end} s, before it starts at {start} s")


def window_idle_share(events: Sequence, process: str, start_s: float, end_s: float) -> float:
    """The share of [start_s, end_s] in which `process` ran no phase (events of one process do not overlap)."""
    if not end_s > start_s:
        raise ValueError(f"the window must have end_s > start_s; got [{start_s}, {end_s}]")
    busy = sum(max(0.0, min(_field(e, "end_s"), end_s) - max(_field(e, "start_s"), start_s)) for e in events
               if _field(e, "process") == process)
    return max(0.0, 1.0 - busy / (end_s - start_s))


def recorded_until(events: Sequence) -> float:
    """The last time every process has events for: a stored run may keep only its first events, and
    past this time a process's missing events would read as idle."""
    return min(max(_field(e, "end_s") for e in events if _field(e, "process") == p)
               for p in PROCESSES if any(_field(e, "process") == p for e in events))


def draw_timelines(runs: Mapping[str, Sequence], window_s: tuple[float, float] | None = None,
                   title: str = "What each process did, step by step") -> Figure:
    """One panel per layout (`runs`: layout name -> its events, rl.loop.Event or their dicts), a row
    per process, a box per phase coloured by phase; each row's label gives its idle share over the
    window drawn. The default window runs from 0 to the earliest `recorded_until` of the runs, so
    every panel spans the same seconds and shows only what was recorded."""
    if not runs:
        raise ValueError("give at least one layout's events")
    for name, events in runs.items():
        try:
            check_events(events)
        except ValueError as error:
            raise ValueError(f"layout {name!r}: {error}") from None
    start, end = window_s or (0.0, min(recorded_until(events) for events in runs.values()))
    if not end > start:
        raise ValueError(f"the window must have end_s > start_s; got [{start}, {end}]")
    panel_h, gap = 0.9, 0.5
    height = 0.6 + len(runs) * panel_h + (len(runs) - 1) * gap + 0.85
    figure = Figure(figsize=(WIDTH_IN, height))
    for n, (name, events) in enumerate(runs.items()):
        y0 = height - 0.6 - (n + 1) * panel_h - n * gap  # the panel's bottom, inches from the figure's
        ax = figure.add_axes((1.75 / WIDTH_IN, y0 / height, (WIDTH_IN - 1.95) / WIDTH_IN, panel_h / height))
        processes = [p for p in PROCESSES if any(_field(e, "process") == p for e in events)]
        labels = []
        for row, process in enumerate(processes):
            shown = [(k, e) for k, e in enumerate(events) if _field(e, "process") == process
                     and _field(e, "end_s") > start and _field(e, "start_s") < end]
            for k, e in shown:
                s, f = max(_field(e, "start_s"), start), min(_field(e, "end_s"), end)
                ax.add_patch(Rectangle((s, row - 0.35), f - s, 0.7, facecolor=PHASE_COLORS[_field(e, "phase")],
                                       edgecolor="none", gid=f"event:{name}:{process}:{k}"))
            idle = window_idle_share(events, process, start, end)
            labels.append(f"{process}\nidle {idle:.0%}")
            ax.text(-0.02, row, labels[-1], transform=ax.get_yaxis_transform(), ha="right", va="center",
                    fontsize=FONT_PT, gid=f"idle:{name}:{process}:{idle!r}")
        ax.set(xlim=(start, end), ylim=(len(processes) - 0.5, -0.5), yticks=[])
        ax.set_title(name, fontsize=FONT_PT + 1, loc="left")
        ax.tick_params(labelsize=FONT_PT)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        if n == len(runs) - 1:
            ax.set_xlabel("seconds since the run began", fontsize=FONT_PT)
    handles = [Patch(facecolor=PHASE_COLORS[p], label=p) for p in PHASES]
    figure.legend(handles=handles, loc="lower center", ncol=len(PHASES), fontsize=FONT_PT, frameon=False,
                  bbox_to_anchor=(0.5, 0.0), handlelength=1.4, columnspacing=1.2)
    figure.suptitle(title, fontsize=TITLE_PT, y=1 - 0.08 / height, va="top")
    return figure
