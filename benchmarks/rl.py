"""Chapter 11: GRPO on reversed two-digit addition with the book's engine doing the rollouts and a
torch trainer, on this machine. Sections:

- warm_start: the shipped warm start's supervised run (pass@1 at each check), and a cold start:
  the target model, which never answers right, trained with GRPO: every reward 0, nothing learnt.
- learns: from the warm start, GRPO (DeepSeekMath's loss, G = 8, 32 prompts a step) colocated,
  for 3 seeds: pass@1 on the 500 held-out problems along the way, and the wall time to 0.85. The
  target: at least 0.85 within 10 minutes, for 3 seeds of 3.
- layouts: the same runs disaggregated (two processes, the rollout one step behind), for the same
  seeds: the idle share of each process in both layouts, wall times, and the disaggregated final
  pass@1 over the colocated one (target: within 10%).
- sync: the weight-sync ladder (infra_lab.rl.sync.measure_ladder) in GB/s against a memory copy.
- mismatch: the engine's log-probabilities against the trainer's for the same tokens and weights,
  with the engine serving fp32, fp16, int8 and int4 weights; then training with an int8 engine,
  and with an int4 one without and with truncated importance sampling (C = 2).
- losses: Dr. GRPO and REINFORCE with a group baseline beside GRPO, same seed and steps.
- pass_at_k: pass@k for k = 1 to 16 (16 samples a problem) before and after GRPO.
- explorer: final pass@1 and wall time over group size x learning rate x KL weight x layout, at
  a shorter length.

    python benchmarks/rl.py [--quick] [--only SECTION] [--json PATH]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "rl.json"
SECTIONS = ("warm_start", "learns", "layouts", "sync", "mismatch", "losses", "pass_at_k", "explorer")
FULL = {"steps": 150, "seeds": 3, "eval_every": 10, "cold_steps": 20, "mismatch_steps": 100, "repeats": 9,
        "explorer_steps": 30, "explorer_eval": 200, "groups": (4, 8, 16), "lrs": (1e-4, 3e-4),
        "kls": (0.0, 0.04), "layouts": ("colocated", "disaggregated"), "samples": 16}
QUICK = {"steps": 6, "seeds": 1, "eval_every": 3, "cold_steps": 2, "mismatch_steps": 3, "repeats": 2,
         "explorer_steps": 2, "explorer_eval": 20, "groups": (4,), "lrs": (1e-4,), "kls": (0.04,),
         "layouts": ("colocated",), "samples": 4}
PASS_TARGET, MINUTES_TARGET, LAYOUT_TARGET, TIS_C = 0.85, 10.0, 0.10, 2.0
_trained: dict = {}  # seed -> the colocated run's final weights, for pass_at_k


def _run(layout: str, **settings):
    from infra_lab.rl import layouts, warm_start
    from infra_lab.rl.loop import RunConfig

    config = RunConfig(**settings)
    start = warm_start.load_warm()
    return layouts.colocated(start, config) if layout == "colocated" else layouts.disaggregated(start, config)


def _summary(history) -> dict:
    evals = history.evals
    reached = next((step for step, passed in evals if passed >= PASS_TARGET), None)
    per_step = history.wall_s / history.config.steps
    return {"evals": evals, "final_pass": evals[-1][1], "wall_s": history.wall_s,
            "steps_to_target": reached, "seconds_to_target": None if reached is None else reached * per_step,
            "idle_share": {p: history.idle_share(p) for p in ("rollout", "trainer")},
            "phase_s": _phases(history), "reward": [s["reward"] for s in history.steps],
            "kl": [s["kl"] for s in history.steps], "events": [e.__dict__ for e in history.events[:400]]}


def _phases(history) -> dict:
    out: dict = {}
    for e in history.events:
        out.setdefault(e.process, {}).setdefault(e.phase, 0.0)
        out[e.process][e.phase] += e.end_s - e.start_s
    return out


def warm_start(sizes: dict) -> dict:
    from infra_lab.model.transformer import load
    from infra_lab.rl import layouts, task, warm_start as warm
    from infra_lab.rl.loop import RunConfig

    shipped = warm.load_warm()
    cold = layouts.colocated(load("target"), RunConfig(steps=sizes["cold_steps"], eval_every=sizes["cold_steps"]))
    held = task.split()[1]
    return {"shipped": shipped.figures, "cold": {"evals": cold.evals, "reward": [s["reward"] for s in cold.steps],
                                                 "loss": [s["loss"] for s in cold.steps]},
            "eval_problems": len(held)}


def learns(sizes: dict) -> dict:
    runs = {}
    for seed in range(sizes["seeds"]):
        history = _run("colocated", steps=sizes["steps"], eval_every=sizes["eval_every"], seed=seed)
        _trained[seed] = history.final_state
        runs[seed] = _summary(history)
    met = [r["seconds_to_target"] is not None and r["seconds_to_target"] <= 60 * MINUTES_TARGET
           for r in runs.values()]
    return {"runs": runs, "target": f"pass@1 >= {PASS_TARGET} within {MINUTES_TARGET:g} minutes, every seed",
            "met": sum(met), "passed": all(met) and len(met) == 3}


def _learnt(sections: dict, sizes: dict) -> dict:
    """The learns section's runs: this run's, or the results file's (seeds as strings there), or new ones."""
    if "learns" in sections:
        return sections["learns"]["runs"]
    if RESULTS.is_file() and sizes is not QUICK:
        stored = json.loads(RESULTS.read_text()).get("sections", {}).get("learns")
        if stored:
            return {int(seed): run for seed, run in stored["runs"].items()}
    return learns(sizes)["runs"]


def layouts_section(sections: dict, sizes: dict) -> dict:
    colocated = _learnt(sections, sizes)
    disaggregated = {seed: _summary(_run("disaggregated", steps=sizes["steps"], eval_every=sizes["eval_every"],
                                         seed=seed)) for seed in range(sizes["seeds"])}
    ratios = [disaggregated[s]["final_pass"] / colocated[s]["final_pass"] for s in disaggregated]
    return {"colocated": colocated, "disaggregated": disaggregated, "final_pass_ratio": ratios,
            "wall_ratio": [disaggregated[s]["wall_s"] / colocated[s]["wall_s"] for s in disaggregated],
            "target": f"disaggregated final pass@1 within {LAYOUT_TARGET:.0%} of colocated",
            "passed": all(r >= 1 - LAYOUT_TARGET for r in ratios)}


def sync_section(sizes: dict) -> dict:
    from infra_lab.rl import sync, warm_start as warm

    rows = sync.measure_ladder(warm.load_warm(), repeats=sizes["repeats"])
    in_process = max(r.seconds for r in rows if r.rung in ("state copy", "bucketed"))
    return {"rows": [r.__dict__ for r in rows], "in_process_s": in_process, "target_s": 0.020,
            "passed": in_process <= 0.020}


def mismatch(sizes: dict) -> dict:
    from infra_lab.rl import loop, rollout as rollouts, task, warm_start as warm
    from infra_lab.rl.trainer import Trainer, lay_out, token_logprobs

    import torch

    start = warm.load_warm()
    config = loop.RunConfig()
    trainer = Trainer(start, config.loss_config())
    problems = task.split()[0][:config.prompts]
    gaps = {}
    for weights in loop.ENGINE_WEIGHTS:
        engine = loop.rollout_engine(loop.serving_model(start.w, 0, start, weights), config, 6)
        batch = rollouts.rollout(engine, problems, config.group, task.max_answer_tokens(), seed=1)
        scored = lay_out(batch)
        with torch.no_grad():
            trainer_logp = token_logprobs(trainer.policy, scored)
        diff = (scored.rollout_logp - trainer_logp)[scored.mask].double().numpy()  # engine - trainer, nats
        ratio = np.exp(-diff)  # pi_train / pi_rollout per token
        gaps[weights] = {"tokens": int(diff.size), "abs_mean": float(np.abs(diff).mean()),
                         "abs_quantiles": {q: float(np.quantile(np.abs(diff), q)) for q in (0.5, 0.9, 0.99, 1.0)},
                         "ratio_quantiles": {q: float(np.quantile(ratio, q)) for q in (0.01, 0.5, 0.99)},
                         "truncated_at_c": float((ratio > TIS_C).mean()), "histogram": np.histogram(
                             diff, bins=40)[0].tolist(), "edges": np.histogram(diff, bins=40)[1].tolist()}
    runs = {}
    for name, weights, c in (("int8", "int8", None), ("int4", "int4", None), ("int4 + TIS", "int4", TIS_C)):
        history = _run("colocated", steps=sizes["mismatch_steps"], eval_every=sizes["eval_every"],
                       engine_weights=weights, truncate_c=c)
        runs[name] = {"evals": history.evals, "final_pass": history.evals[-1][1],
                      "mismatch_abs_mean": [s["mismatch_abs_mean"] for s in history.steps],
                      "tis_truncated_fraction": [s["tis_truncated_fraction"] for s in history.steps]}
    return {"gaps": gaps, "runs": runs, "c": TIS_C}


def losses(sections: dict, sizes: dict) -> dict:
    runs = {"grpo": _learnt(sections, sizes).get(0)}
    for loss in ("grpo", "dr_grpo", "reinforce"):
        if runs.get(loss) is None:
            kl = 0.0 if loss != "grpo" else 0.04
            runs[loss] = _summary(_run("colocated", steps=sizes["steps"], eval_every=sizes["eval_every"], loss=loss,
                                       kl_weight=kl))
    return {"runs": {k: {key: v for key, v in r.items() if key != "events"} for k, r in runs.items()}}


def pass_at_k(sizes: dict) -> dict:
    from infra_lab.model.transformer import Transformer
    from infra_lab.rl import evaluate, loop, task, warm_start as warm

    start = warm.load_warm()
    if 0 not in _trained:
        _trained[0] = _run("colocated", steps=sizes["steps"], eval_every=sizes["steps"], seed=0).final_state
    held = task.split()[1]
    ks = tuple(k for k in (1, 2, 4, 8, 16) if k <= sizes["samples"])
    out = {}
    for name, model in (("warm start", start), ("after GRPO", Transformer(start.config, _trained[0]))):
        engine = loop.evaluation_engine(model, loop.RunConfig())
        out[name] = {"pass_at_k": evaluate.pass_at_k(engine, held, ks, sizes["samples"], seed=3),
                     "greedy": evaluate.pass_at_1(engine, held)}
    return {"n": sizes["samples"], "ks": ks, "models": out}


def explorer(sizes: dict) -> dict:
    rows = []
    for layout in sizes["layouts"]:
        for group in sizes["groups"]:
            for lr in sizes["lrs"]:
                for kl in sizes["kls"]:
                    history = _run(layout, steps=sizes["explorer_steps"], eval_every=sizes["explorer_steps"],
                                   group=group, lr=lr, kl_weight=kl, eval_problems=sizes["explorer_eval"],
                                   prompts=max(4, 256 // group))
                    rows.append({"layout": layout, "group": group, "lr": lr, "kl_weight": kl,
                                 "final_pass": history.evals[-1][1], "start_pass": history.evals[0][1],
                                 "wall_s": history.wall_s})
    return {"rows": rows, "steps": sizes["explorer_steps"], "eval_problems": sizes["explorer_eval"],
            "samples_per_step": 256}


def headline(name: str, figures: dict) -> str:
    if name == "warm_start":
        return (f"shipped: {figures['shipped']['steps']} steps to pass@1 {figures['shipped']['pass_at_1']:.3f}; "
                f"cold GRPO rewards {max(figures['cold']['reward']):.2f} at most, pass@1 {figures['cold']['evals']}")
    if name == "learns":
        return "; ".join(f"seed {s}: {r['final_pass']:.3f} after {r['wall_s']:.0f} s, 0.85 at "
                         f"{r['seconds_to_target'] and round(r['seconds_to_target'])} s"
                         for s, r in figures["runs"].items())
    if name == "layouts":
        idle = {s: r["idle_share"] for s, r in figures["disaggregated"].items()}
        return f"final pass ratios {[round(r, 3) for r in figures['final_pass_ratio']]}; idle {idle}"
    if name == "sync":
        return "; ".join(f"{r['rung']}: {r['seconds'] * 1e3:.1f} ms, {r['gbps']:.2f} GB/s" for r in figures["rows"])
    if name == "mismatch":
        gaps = "; ".join(f"{w}: |d| mean {g['abs_mean']:.2e}" for w, g in figures["gaps"].items())
        return gaps + "; " + "; ".join(f"{n}: {r['final_pass']:.3f}" for n, r in figures["runs"].items())
    if name == "losses":
        return "; ".join(f"{n}: {r['final_pass']:.3f}" for n, r in figures["runs"].items())
    if name == "pass_at_k":
        return "; ".join(f"{n}: {m['pass_at_k']}" for n, m in figures["models"].items())
    return f"{len(figures['rows'])} settings, best {max(r['final_pass'] for r in figures['rows']):.3f}"


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    run_sections("benchmarks/rl.py", SECTIONS,
                 {"warm_start": lambda _: warm_start(sizes), "learns": lambda _: learns(sizes),
                  "layouts": lambda s: layouts_section(s, sizes), "sync": lambda _: sync_section(sizes),
                  "mismatch": lambda _: mismatch(sizes), "losses": lambda s: losses(s, sizes),
                  "pass_at_k": lambda _: pass_at_k(sizes), "explorer": lambda _: explorer(sizes)},
                 args, headline, RESULTS, {"quick": args.quick, "sizes": sizes})


if __name__ == "__main__":
    main()
