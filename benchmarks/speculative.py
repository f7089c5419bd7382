"""Issue 16's bars for chapter 07's speculative decoding, on the shipped target and draft models
with the numba backend on the CPU (torch on a CUDA GPU when there is one). Each section is one
function and one bar:

- exact: greedy speculative output equals the target's greedy output, token for token, for γ
  from 1 to 8, both drafters, on numba and on torch, alone (speculative_generate) and batched
  in the engine;
- sampling: at three fixed contexts, the first emitted token and the first two under speculative
  sampling in the engine against the target's exact probabilities: Pearson's chi-square over
  20,000 samples (sparse bins merged) must give p >= 0.01, and the same test must reject a rule
  that keeps every draft with p < 1e-6; total variation distances beside;
- theory: with the draft model, the mean tokens per target forward must be within 5% of
  (1 - α^(γ+1)) / (1 - α), α measured on the same run; α per position and per drafter beside;
- speed: greedy decoding of one sequence at a time, wall clock: speculative over plain for both
  drafters and γ from 1 to 8, with the measured c (a drafted token's cost over a target decode's)
  and the theory's prediction; the better drafter at its best γ must reach >= 1.5x;
- engine: the engine's output tokens/s with speculation over without, at batch 1 to 64 (every
  request arrives at once), with the batch from which on it stays below 1 and each step's
  time against its tokens (the roofline's reason);
- cuda: the speed and engine tables on a CUDA GPU (only when one is present).

Ratios come from runs in this one invocation; variants take turns in a new order each round,
and a ratio is the median of the rounds' own ratios with a 95% interval for that median. numpy's
BLAS runs one thread (--blas-threads, default 1): the model's matmuls are small, and on two cores
BLAS threads fight numba's.

    python benchmarks/speculative.py [--quick] [--only SECTION ...] [--rounds N] [--json PATH]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from infra_lab import backend, model
from infra_lab.model import tokenizer
from infra_lab.model.generate import generate, generate_many
from infra_lab.serving import exactness, traffic
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import ModelDrafter, PromptLookupDrafter
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.speculative import accept_all, best_gamma, expected_tokens, speculative_generate, speedup

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402  (one helper for the intervals of every benchmark)

RESULTS = Path(__file__).parent / "results" / "speculative.json"
GAMMAS = (1, 2, 3, 4, 5, 6, 8)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = ("    def close(self):\n        ", "import os\nimport sys\n\n\ndef ", "        for i in range(")
SECTIONS = ("exact", "sampling", "theory", "speed", "engine", "cuda")
FULL = {"prompts": 6, "prompt_len": 64, "new_tokens": 192, "rounds": 3, "samples": 20_000,
        "engine_new": 128, "exact_tokens": 64}
QUICK = {"prompts": 2, "prompt_len": 48, "new_tokens": 48, "rounds": 1, "samples": 2_000,
         "engine_new": 32, "exact_tokens": 24}


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    values = [a / b for a, b in zip(numerators, denominators)]
    low, high = median_interval(values)
    return {"median": statistics.median(values), "low": low, "high": high, "rounds": values}


class Bench:
    def __init__(self, sizes: dict, chosen: backend.Backend, seed: int = 0):
        self.sizes, self.backend = sizes, chosen
        self.target, self.draft = model.load("target"), model.load("draft")
        self.prompts = traffic.stdlib_prompts([sizes["prompt_len"]] * sizes["prompts"], seed=seed)
        self.order = np.random.default_rng(seed)

    def drafters(self) -> dict:
        return {"draft model": ModelDrafter(self.draft, self.backend),
                "prompt lookup": PromptLookupDrafter(self.target.config.vocab)}


# ---- exact --------------------------------------------------------------------------------------

def exact(bench: Bench) -> dict:
    n = bench.sizes["exact_tokens"]
    equal = {}
    for name in ("numba", "torch"):
        try:
            chosen = backend.resolve(name)
        except Exception as error:  # torch missing: say so, do not fail the run
            equal[name] = f"skipped: {error}"
            continue
        prompts = bench.prompts[:4]
        reference = generate_many(bench.target, prompts, n, backend=chosen)
        for drafter_name, drafter in {"draft model": ModelDrafter(bench.draft, chosen),
                                      "prompt lookup": PromptLookupDrafter(256)}.items():
            for gamma in range(1, 9):
                alone = [speculative_generate(bench.target, drafter, p, gamma, n, backend=chosen).new_tokens
                         for p in prompts]
                engine = Engine(bench.target, EngineConfig(policy="chunked", max_batch=4, token_budget=512,
                                                           num_speculative_tokens=gamma), chosen, drafter=drafter)
                batched = engine.generate(prompts, SamplingParams(max_tokens=n))
                equal[f"{name}/{drafter_name}/gamma {gamma}/alone"] = alone == reference
                equal[f"{name}/{drafter_name}/gamma {gamma}/engine"] = batched == reference
    checked = [v for v in equal.values() if isinstance(v, bool)]
    return {"equal": equal, "tokens": n, "prompts": 4, "passed": all(checked) and len(checked) >= 56}


# ---- sampling -----------------------------------------------------------------------------------

def sampling(bench: Bench) -> dict:
    params, gamma, samples = SamplingParams(temperature=1.0), 3, bench.sizes["samples"]
    rows, passed = {}, True
    for text in CONTEXTS:
        prompt = list(tokenizer.encode(text))
        for rule_name, rule in (("speculative sampling", None), ("accept every draft", accept_all)):
            started = time.perf_counter()
            first, two = exactness.test_first_two(bench.target, ModelDrafter(bench.draft, bench.backend), prompt,
                                                  gamma, params, samples, rule, bench.backend)
            rows[f"{text!r} / {rule_name}"] = {"first": first.__dict__, "first_two": two.__dict__,
                                               "seconds": time.perf_counter() - started}
            ok = min(first.p_value, two.p_value) >= 0.01 if rule is None else max(first.p_value, two.p_value) < 1e-6
            passed = passed and ok
    return {"tests": rows, "gamma": gamma, "temperature": 1.0, "samples": samples, "passed": passed}


# ---- theory and speed ------------------------------------------------------------------------------

def plain_decode(bench: Bench, which, prompt, n: int) -> float:
    """Seconds per token of plain greedy decoding (the prompt's prefill left out)."""
    short = generate(which, prompt, 1, temperature=0, backend=bench.backend).seconds
    full = generate(which, prompt, n, temperature=0, backend=bench.backend).seconds
    return (full - short) / (n - 1)


def theory(bench: Bench) -> dict:
    n, drafters, rows = bench.sizes["new_tokens"], bench.drafters(), {}
    for name, drafter in drafters.items():
        for gamma in GAMMAS:
            runs = [speculative_generate(bench.target, drafter, p, gamma, n, backend=bench.backend)
                    for p in bench.prompts]
            full = [r for run in runs for r in run.rounds[:-1] if len(r.drafted) == gamma]  # whole rounds only
            kept = sum(r.accepted for r in full)
            checked = sum(min(r.accepted + 1, gamma) for r in full)
            alpha = kept / checked
            measured = float(np.mean([len(r.emitted) for r in full]))
            by_position = np.sum([run.tally.kept for run in runs], 0) / np.maximum(
                np.sum([run.tally.reached for run in runs], 0), 1)
            drafted = [len(r.drafted) for run in runs for r in run.rounds]
            rows[f"{name}/gamma {gamma}"] = {
                "alpha": alpha, "alpha_by_position": by_position.tolist(), "tokens_per_forward": measured,
                "formula": expected_tokens(alpha, gamma),
                "relative_error": measured / expected_tokens(alpha, gamma) - 1,
                "whole_rounds": len(full), "rounds": len(drafted),
                "rounds_without_draft": sum(d == 0 for d in drafted), "mean_drafted": float(np.mean(drafted))}
    model_rows = [v for k, v in rows.items() if k.startswith("draft model")]
    return {"runs": rows, "new_tokens": n, "prompts": len(bench.prompts),
            "passed": all(abs(v["relative_error"]) <= 0.05 for v in model_rows)}


def speed(bench: Bench, rounds: int) -> dict:
    n, drafters = bench.sizes["new_tokens"], bench.drafters()
    variants = [("plain", None, 0)] + [(name, d, g) for name, d in drafters.items() for g in GAMMAS]
    seconds = {f"{name}/gamma {g}" if d else name: [] for name, d, g in variants}
    for variant in variants:  # warm: every kernel compiled, every drafter's pool touched
        run_variant(bench, variant, bench.prompts[0], 16)
    alphas, draft_s, forwards = {k: [] for k in seconds}, {k: 0.0 for k in seconds}, {k: 0 for k in seconds}
    for _ in range(rounds):
        for i in bench.order.permutation(len(variants)):
            name, drafter, gamma = variants[i]
            key = f"{name}/gamma {gamma}" if drafter else name
            total = 0.0
            for prompt in bench.prompts:
                result = run_variant(bench, variants[i], prompt, n)
                total += result.seconds
                if drafter:
                    alphas[key].append(result.tally.alpha)
                    draft_s[key] += result.draft_s
                    forwards[key] += len([r for r in result.rounds if r.drafted])
            seconds[key].append(total)
    target_step = statistics.median(plain_decode(bench, bench.target, p, n) for p in bench.prompts)
    draft_step = statistics.median(plain_decode(bench, bench.draft, p, n) for p in bench.prompts)
    rows = {}
    for name, drafter, gamma in variants[1:]:
        key = f"{name}/gamma {gamma}"
        alpha = float(np.nanmean(alphas[key]))
        c = draft_s[key] / max(forwards[key], 1) / gamma / target_step  # a drafted token against a target decode
        rows[key] = {"speedup": ratio(seconds["plain"], seconds[key]), "alpha": alpha, "c": c,
                     "predicted": speedup(alpha, gamma, c)}
    best = {name: max((v["speedup"]["median"], k) for k, v in rows.items() if k.startswith(name))
            for name in drafters}
    winner = max(best.values())
    return {"runs": rows, "plain_tokens_per_s": len(bench.prompts) * n / statistics.median(seconds["plain"]),
            "target_decode_ms": 1e3 * target_step, "draft_decode_ms": 1e3 * draft_step,
            "c_draft_model_plain": draft_step / target_step,
            "best": {name: {"variant": k, "speedup": s} for name, (s, k) in best.items()},
            "best_gamma_by_theory": {name: best_gamma(rows[f"{name}/gamma 4"]["alpha"], rows[f"{name}/gamma 4"]["c"])
                                     for name in drafters},
            "new_tokens": n, "prompts": len(bench.prompts), "passed": winner[0] >= 1.5}


def run_variant(bench: Bench, variant, prompt, n: int):
    name, drafter, gamma = variant
    if drafter is None:
        return generate(bench.target, prompt, n, temperature=0, backend=bench.backend)
    return speculative_generate(bench.target, drafter, prompt, gamma, n, backend=bench.backend)


# ---- the engine -----------------------------------------------------------------------------------

def engine_section(bench: Bench, rounds: int, drafter_name: str | None = None, gamma: int | None = None) -> dict:
    """Output tokens/s with and without speculation at each batch size; the engine's steps."""
    n = bench.sizes["engine_new"]
    drafter_name = drafter_name or "prompt lookup"
    gammas = (gamma,) if gamma else (2, 4)
    prompts = traffic.stdlib_prompts([bench.sizes["prompt_len"]] * max(BATCHES), seed=7)
    rows, steps = {}, {}
    for batch in BATCHES:
        work = prompts[:batch]
        variants = [None, *gammas]
        seconds = {v: [] for v in variants}
        for v in variants:  # warm
            serve(bench, work[:2], 8, drafter_name, v)
        for _ in range(rounds):
            for i in bench.order.permutation(len(variants)):
                engine, took = serve(bench, work, n, drafter_name, variants[i])
                seconds[variants[i]].append(took)
                if batch in (1, 8, 32) and variants[i] in (None, gammas[-1]):
                    steps[f"batch {batch}/{'plain' if variants[i] is None else f'gamma {variants[i]}'}"] = [
                        (s.forward_tokens, s.forward_s) for s in engine.log]
        rows[f"batch {batch}"] = {f"gamma {g}": ratio(seconds[None], seconds[g]) for g in gammas} | {
            "plain_tokens_per_s": batch * n / statistics.median(seconds[None])}
    below = {f"gamma {g}": stays_below_1(BATCHES, [rows[f"batch {b}"][f"gamma {g}"]["median"] for b in BATCHES])
             for g in gammas}
    return {"drafter": drafter_name, "new_tokens": n, "batches": rows, "below_1_from_batch": below,
            "step_tokens_and_forward_s": steps, "passed": None, "bar": "figures: batch 1, 8, 32 and where it ends"}


def stays_below_1(batches, speedups) -> int | None:
    """The smallest batch from which on every measured speed-up is below 1 (None: the largest
    is not): a single noisy dip at a small batch is not where speculation stops paying."""
    start = None
    for batch, value in zip(batches, speedups):
        start = (start or batch) if value < 1 else None
    return start


def serve(bench: Bench, prompts, n: int, drafter_name: str, gamma):
    drafter = bench.drafters()[drafter_name] if gamma else None
    config = EngineConfig(policy="chunked", max_batch=64, token_budget=2048, num_blocks=1024,
                          num_speculative_tokens=gamma or 0)
    engine = Engine(bench.target, config, bench.backend, drafter=drafter)
    started = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=n))
    return engine, time.perf_counter() - started


def cuda(bench: Bench, rounds: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on this machine", "passed": None}
    gpu = Bench(bench.sizes, backend.resolve("torch", "cuda"))
    return {"device": torch.cuda.get_device_name(), "speed": speed(gpu, rounds),
            "engine": engine_section(gpu, rounds), "passed": None}


# ---- the run -----------------------------------------------------------------------------------------

def headline(name: str, s: dict) -> str:
    if "skipped" in s:
        return f"skipped ({s['skipped']})"
    if name == "exact":
        flags = [v for v in s["equal"].values() if isinstance(v, bool)]
        return f"{sum(flags)}/{len(flags)} equal"
    if name == "sampling":
        return "; ".join(f"{k}: p {v['first']['p_value']:.2g} / {v['first_two']['p_value']:.2g}, "
                         f"TV {v['first']['total_variation']:.3f}" for k, v in s["tests"].items())
    if name == "theory":
        return ", ".join(f"{k}: {v['tokens_per_forward']:.2f} vs {v['formula']:.2f} (α {v['alpha']:.2f})"
                         for k, v in s["runs"].items() if k.startswith("draft model"))
    if name == "speed":
        return ", ".join(f"{d}: {b['speedup']:.2f}x at {b['variant']}" for d, b in s["best"].items())
    if name == "engine":
        return ", ".join(f"{b}: " + "/".join(f"{v['median']:.2f}x" for k, v in row.items() if k.startswith("gamma"))
                         for b, row in s["batches"].items()) + f"; below 1 from batch {s['below_1_from_batch']} on"
    return ""


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    parser.add_argument("--blas-threads", type=int, default=1, help="numpy's BLAS threads (default 1)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    if args.blas_threads < 1:
        parser.error(f"--blas-threads must be at least 1; got {args.blas_threads}")
    from threadpoolctl import threadpool_limits

    blas_limit = threadpool_limits(limits=args.blas_threads, user_api="blas")  # noqa: F841  held for the run
    bench = Bench(sizes, backend.current(), args.seed)
    runs = {"exact": lambda _: exact(bench), "sampling": lambda _: sampling(bench), "theory": lambda _: theory(bench),
            "speed": lambda _: speed(bench, rounds), "engine": lambda _: engine_section(bench, rounds),
            "cuda": lambda _: cuda(bench, rounds)}
    run_sections("benchmarks/speculative.py", SECTIONS, runs, args, headline, RESULTS,
                 {"quick": args.quick, "seed": args.seed, "sizes": sizes, "blas_threads": args.blas_threads})


if __name__ == "__main__":
    main()
