"""Chapter 11, RL post-training: the chapter's verdicts on GRPO, the weight sync and the layouts, the
article's claims on idle GPUs, and DeepSeekMath's, verl's and slime's figures beside ours."""
from __future__ import annotations

import statistics

from infra_lab import measured, verdict
from infra_lab.claims.entry import Entry, Figure, committed, judged

DEEPSEEKMATH = "https://arxiv.org/abs/2402.03300"
SLIME_SYNC = "https://hebiao064.github.io/rl-weight-sync"
MINUTES, PASS_TARGET = 10.0, 0.85  # chapter 11's target for its RL loop
SYNC = verdict.Claim(
    "an in-process weight sync of the shipped model into a serving engine (state copy "
    "or buckets, whichever is slower) takes at most 20 ms",
    "this book's target for its weight sync", 20.0, "at most", unit=" ms", digits=1)
LAYOUT = verdict.Claim(
    "the disaggregated layout's final pass@1 is within 10% of the colocated layout's, "
    "same runs and number of steps", "this book's target for its layouts", 0.90, "at least", unit="×", digits=3)


def learns_claim(shipped_pass: float) -> verdict.Claim:
    """Chapter 11's claim, with the shipped warm start's pass@1 in it."""
    return verdict.Claim(
        f"GRPO from the shipped warm start (greedy pass@1 {shipped_pass:.2f}) "
        f"takes pass@1 on the held-out problems to at least {PASS_TARGET} within "
        f"{MINUTES:.0f} minutes of training on a 2-core CPU, in each of 3 runs",
        "this book's target for its RL loop", PASS_TARGET, "at least", unit="", digits=3)


def shipped_pass() -> float:
    from infra_lab.rl import warm_start  # imports torch: only when the figure is asked for

    return warm_start.load_warm().figures["pass_at_1"]


def stored(section: str) -> tuple[dict, dict] | None:
    results = measured.load("rl")
    found = (results or {}).get("sections", {}).get(section)
    return found and (results, found)


def within_target(run: dict) -> float:
    """The best pass@1 measured within MINUTES of training (step s: s step times)."""
    per_step = run["wall_s"] / len(run["reward"])
    return max(p for s, p in run["evals"] if s * per_step <= 60 * MINUTES)


def learns() -> Figure | None:
    found = stored("learns")
    if found is None or not found[1].get("runs"):
        return None
    results, runs = found[0], found[1]["runs"]
    best = sorted(within_target(run) for run in runs.values())
    evidence = verdict.Evidence(float(statistics.median(best)), best[0], best[-1],
                                **measured.run_of(results, "learns"), confidence=verdict.median_coverage(len(best)))
    return judged(learns_claim(shipped_pass()), evidence)


def sync() -> Figure | None:
    found = stored("sync")
    return found and judged(SYNC, verdict.one_run(found[0], found[1]["in_process_s"] * 1e3, "sync"))


def layouts() -> Figure | None:
    found = stored("layouts")
    if found is None:
        return None
    ratios = found[1]["final_pass_ratio"]
    evidence = verdict.Evidence(float(statistics.median(ratios)), min(ratios), max(ratios),
                                **measured.run_of(found[0], "layouts"),
                                confidence=verdict.median_coverage(len(ratios)))
    return judged(LAYOUT, evidence)


def grpo_gain() -> Figure | None:
    found = stored("learns")
    if found is None or not found[1].get("runs"):
        return None
    finals = [run["final_pass"] for run in found[1]["runs"].values()]
    start = shipped_pass()
    return committed(found[0], "learns", f"pass@1 {start:.3f} to {statistics.mean(finals):.3f} on average over "
                     f"{len(finals)} runs, {statistics.mean(finals) / start:.1f}× (two-digit addition, not GSM8K; "
                     f"DeepSeekMath's GSM8K gain is {88.2 / 82.9:.2f}×, verl's {56.7 / 36.4:.2f}×)")


def idle_shares() -> Figure | None:
    found = stored("layouts")
    if found is None:
        return None
    shares = {(name, process): statistics.mean(run["idle_share"][process] for run in found[1][name].values())
              for name in ("colocated", "disaggregated") for process in ("rollout", "trainer")}
    return committed(found[0], "layouts", "idle shares of the run: colocated, rollout "
                     f"{shares['colocated', 'rollout']:.0%} and trainer {shares['colocated', 'trainer']:.0%}; "
                     f"disaggregated, {shares['disaggregated', 'rollout']:.0%} and "
                     f"{shares['disaggregated', 'trainer']:.0%} (2 cores)")


def rollout_share() -> Figure | None:
    found = stored("learns")
    if found is None or not found[1].get("runs"):
        return None
    runs = found[1]["runs"]
    first = runs[min(runs)]
    share = first["phase_s"]["rollout"]["rollout"] / first["wall_s"]
    train = first["phase_s"]["trainer"]["train"] / first["wall_s"]
    return committed(found[0], "learns", f"sampling took {share:.0%} of a colocated run's wall time and training "
                     f"{train:.0%} (the first of the stored runs)")


def sync_time() -> Figure | None:
    found = stored("sync")
    if found is None:
        return None
    return committed(found[0], "sync", f"{found[1]['in_process_s'] * 1e3:.1f} ms for the shipped model, in one "
                     "process; a few megabytes, so fixed costs more than bandwidth")


ENTRIES = [
    Entry("11.grpo-learns", "11", "GRPO from the shipped warm start takes pass@1 on held-out problems to at least "
          f"{PASS_TARGET} within {MINUTES:.0f} minutes on a 2-core CPU, in each of 3 runs",
          "this book's target for its RL loop", f"{PASS_TARGET} (a target)", learns),
    Entry("11.weight-sync", "11", SYNC.statement, SYNC.source, "20 ms (a target)", sync),
    Entry("11.layouts", "11", LAYOUT.statement, LAYOUT.source, "0.9× (a target)", layouts),
    Entry("11.rl-mixes-phases", "11",
          "RL post-training mixes inference, evaluation and parameter updates; on a training framework GPUs fight "
          "over resources and wait on each other; Miles (with SGLang) runs training and inference in one system",
          "C", "no figure given", idle_shares),
    Entry("11.cluster-below-30", "11",
          "GPU clusters' real utilization is often under 30% (waiting on communication, data, recovery)", "B",
          "under 30%", idle_shares),
    Entry("11.deepseekmath-grpo", "11",
          "GRPO took DeepSeekMath-Instruct 7B from 82.9% to 88.2% on GSM8K and from 46.8% to 51.7% on MATH",
          "Shao et al., 2024, Section 4.2", "82.9% to 88.2%; 46.8% to 51.7%", grpo_gain, links=(DEEPSEEKMATH,)),
    Entry("11.verl-baseline", "11", "Qwen2.5-0.5B-Instruct scores 36.4 on GSM8K, and 56.7 after PPO",
          "verl's documentation, Algorithm Baselines", "36.4 to 56.7", grpo_gain),
    Entry("11.verl-rollout-70", "11",
          "in verl's DAPO run on a 32B model the rollout phase accounts for approximately 70% of the total time",
          "verl's One Step Off Policy Async Trainer recipe, 2025", "about 70%", rollout_share),
    Entry("11.verl-sync", "11", "a Qwen2.5-7B weight sync takes 13.5 s over gloo against 0.79 s over NCCL",
          "verl's documentation", "13.5 s and 0.79 s", sync_time),
    Entry("11.slime-sync", "11",
          "slime cut the weight sync of Qwen3-30B-A3B in its colocated mode from 60 s to 7 s with buckets handed "
          "over as CUDA IPC handles", "He, Zhu and Li, Efficient RL Training: Optimizing Weight Sync in slime, 2025",
          "60 s to 7 s", sync_time, links=(SLIME_SYNC,)),
]
