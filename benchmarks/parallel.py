"""The figures behind chapter 10's data, tensor and pipeline parallelism, on gloo processes (one
thread each). Each section is one function:

- training: the shipped target model trained 50 steps (AdamW, 8 windows of 64 bytes a step) by
  every method of parallel.runs on 2 and 4 processes, against one process: the largest relative
  loss gap and absolute weight gap, each rank's parameter, gradient and optimizer-state bytes
  against the memory model, the bytes each collective sent per step against ZeRO's volumes, and
  each method's step time over plain data parallelism's;
- overlap: a data-parallel step with its bucketed all-reduce launched from gradient hooks during
  backward, and launched after backward: the exposed communication as a share of the all-reduce
  alone, and as a share of the step, and what overlap leaves of the latter (the ratio of the
  rounds' medians; the article's 40% -> 15% leaves 37.5%), with its interval;
- tensor: tensor-parallel MLP and block against one process on the same shapes, and exactness;
- pipeline: the measured idle share of a 2-stage pipeline with balanced stages against
  (p - 1) / (m + p - 1) for m from 1 to 16, GPipe and 1F1B, with one run's logs kept for drawing;
- checkpointing: the bytes autograd saves for backward and the time of a forward and backward of
  the target model, with and without recomputing each block;
- cuda: the memory model against torch.cuda.max_memory_allocated for one process (only with a GPU).

Ratios come from runs in this one invocation; variants take turns, and a ratio is the median of
the rounds' own ratios with a 95% interval for that median.

    python benchmarks/parallel.py [--quick] [--only SECTION ...] [--rounds N] [--json PATH]
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from infra_lab.parallel import runs
from infra_lab.processes import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "parallel.json"
SECTIONS = ("training", "overlap", "tensor", "pipeline", "checkpointing", "cuda")
FULL = {"steps": 50, "worlds": (2, 4), "rounds": 15, "overlap_batches": (8, 32), "micro_batches": tuple(range(1, 17)),
        "tensor_batch": 8, "tensor_tokens": 128, "checkpoint_batch": 8,
        "pipeline_repeats": 7}
QUICK = {"steps": 4, "worlds": (2,), "rounds": 3, "overlap_batches": (8,), "micro_batches": (1, 4),
         "tensor_batch": 2, "tensor_tokens": 32, "checkpoint_batch": 2,
         "pipeline_repeats": 2}


def interval(values: list[float]) -> dict:
    low, high = median_interval(values)
    return {"median": statistics.median(values), "low": low, "high": high}


def training(sizes: dict) -> dict:
    settings = runs.Settings(steps=sizes["steps"])
    reference = runs.single_process(settings)
    out = {"settings": asdict(settings), "worlds": {}}
    for world in sizes["worlds"]:
        ranks = run_on_ranks(runs.compare_rank, world, list(runs.METHODS), settings, timeout_s=1800)
        methods = {}
        for i, method in enumerate(runs.METHODS):
            results = [rank[i] for rank in ranks]
            losses = np.mean([r["losses"] for r in results], axis=0)
            weights = results[0]["weights"]
            methods[method] = {
                "loss_gap_relative": float(np.max(np.abs(losses - reference["losses"]) / np.abs(reference["losses"]))),
                "weight_gap": max(float(np.max(np.abs(weights[n] - v))) for n, v in reference["weights"].items()),
                "held": [r["held"] for r in results], "modelled": results[0]["modelled"],
                "held_equals_model": all(r["held"] == r["modelled"] for r in results),
                "sent_per_step": results[0]["sent_per_step"][-1], "volume_modelled": results[0]["volume_modelled"],
                "bytes_equal_model": all(s["volume"] == r["volume_modelled"] for r in results
                                         for s in r["sent_per_step"]) if method in runs.OURS else None,
                "step_seconds": max(r["step_seconds"] for r in results)}
        for method in methods.values():
            method["step_over_ddp"] = method["step_seconds"] / methods["ddp"]["step_seconds"]
        out["worlds"][str(world)] = methods
    out["first_loss"], out["last_loss"] = reference["losses"][0], reference["losses"][-1]
    return out


def overhead_rounds(ranks: list[dict], case: str) -> list[float]:
    """Each round's exposed communication as a share of the step, on the rank where it was larger
    (the step ends when the slower rank does)."""
    return [max((r["rounds"][case][i] - r["rounds"]["compute"][i]) / r["rounds"][case][i] for r in ranks)
            for i in range(len(ranks[0]["rounds"][case]))]


def ratio_of_medians(numerators: list[float], denominators: list[float], resamples: int = 2000,
                     seed: int = 0) -> dict:
    """median(numerators) / median(denominators), with a 95% interval from a paired bootstrap
    over the rounds (percentiles 2.5 and 97.5 of 2,000 resamples). A per-round ratio of two
    small, noisy shares swings wildly (a share near zero in the denominator); the ratio of
    medians does not."""
    num, den = np.asarray(numerators), np.asarray(denominators)
    picks = np.random.default_rng(seed).integers(0, len(num), (resamples, len(num)))
    ratios = np.median(num[picks], axis=1) / np.median(den[picks], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    value = float(np.median(num) / np.median(den))
    return {"median": value, "low": float(min(low, value)), "high": float(max(high, value)),
            "method": "ratio of the rounds' medians; 95% paired bootstrap interval, 2,000 resamples"}


def overlap(sizes: dict, rounds: int) -> dict:
    """Per batch: exposed shares and overheads (the medians' maxima over ranks), each round's
    overhead with and without overlap, and `remaining`: what overlap leaves of the exposed
    communication, the overlapped overhead's median over the after-backward one's, with its 95%
    interval (the article's 40% -> 15% leaves 0.375)."""
    out = {}
    for batch in sizes["overlap_batches"]:
        ranks = run_on_ranks(runs.overlap_rank, 2, runs.Settings(batch=batch, window=128), rounds, timeout_s=1800)
        hidden, after = overhead_rounds(ranks, "overlapped"), overhead_rounds(ranks, "after backward")
        out[f"batch {batch}"] = {"ranks": ranks, "exposed share": {
            case: max(r["exposed share"][case] for r in ranks) for case in ("overlapped", "after backward")},
            "overhead": {case: max(r["overhead"][case] for r in ranks) for case in ("overlapped", "after backward")},
            "overhead_rounds": {"overlapped": hidden, "after backward": after},
            "remaining": ratio_of_medians(hidden, after),
            "window": 128, "processes": 2}
    return out


def tensor(sizes: dict, rounds: int) -> dict:
    from infra_lab.parallel import tensor as tp

    out = {}
    for world in sizes["worlds"]:
        config = "target" if world == 2 else {"name": "tp4", "n_layers": 2, "d_model": 128, "n_heads": 4,
                                              "n_kv_heads": 4, "d_ff": 512}
        exact = run_on_ranks(tp.exactness_rank, world, 0, config, 2, 32, timeout_s=600)
        timing = run_on_ranks(tp.timing_rank, world, 0, config, sizes["tensor_batch"], sizes["tensor_tokens"],
                              rounds, timeout_s=1800)
        out[str(world)] = {"config": config, "exactness": exact[0] | {"bytes": float(exact[0]["bytes"])},
                           "bytes_modelled": float(tp.bytes_per_block(2, 32, exact[0]["d_model"], world)
                                                   * exact[0]["n_layers"]), "timing": timing[0]}
    return out


def pipeline_bubble(sizes: dict, rounds: int) -> dict:
    from infra_lab.parallel import pipeline_runs

    repeats = min(rounds, sizes["pipeline_repeats"])
    rows = pipeline_runs.measure_bubble(2, sizes["micro_batches"], repeats=repeats, timeout_s=3000)
    return {"stages": 2, "repeats": repeats, "sizes": {"d": 128, "blocks": 2, "micro_batch": 8, "tokens": 128},
            "rows": rows, "worst_relative_gap": max(abs(r["measured"] / r["formula"] - 1) for r in rows)}


def checkpointing(sizes: dict, rounds: int) -> dict:
    from infra_lab.parallel import checkpointing as recompute

    model = runs.shipped_model()
    tokens, _ = runs.batches(runs.Settings(steps=1, batch=sizes["checkpoint_batch"], window=512))[0]
    compared = recompute.compare(model, tokens, repeats=rounds)
    return {"batch": sizes["checkpoint_batch"], "window": 512,
            **{("with" if flag else "without"): c._asdict() for flag, c in compared.items()}}


def cuda(sizes: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from infra_lab.model.config import CONFIGS
    from infra_lab.model.torch_model import TorchTransformer
    from infra_lab.parallel import memory

    model = TorchTransformer(CONFIGS["target"]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 512), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        model(x).float().square().mean().backward()
        optimizer.step()
    psi = sum(p.numel() for p in model.parameters())
    modelled = sum(memory.state_bytes(psi, 1, 0, memory.FP32).values())
    held = torch.cuda.memory_allocated()
    return {"device": torch.cuda.get_device_name(), "params": psi, "states_modelled": modelled,
            "allocated_after_steps": held, "weights_before_steps": before,
            "max_allocated": torch.cuda.max_memory_allocated()}


def headline(name: str, s: dict) -> str:
    if "skipped" in s:
        return f"skipped ({s['skipped']})"
    if name == "training":
        return "; ".join(f"{w} processes: loss gap <= {max(m['loss_gap_relative'] for m in ms.values()):.1e}, "
                         f"weights <= {max(m['weight_gap'] for m in ms.values()):.1e}, memory as modelled: "
                         f"{all(m['held_equals_model'] for k, m in ms.items() if k in runs.OURS)}"
                         for w, ms in s["worlds"].items())
    if name == "overlap":
        return "; ".join(f"{b}: exposed {v['exposed share']['after backward']:.0%} -> {v['exposed share']['overlapped']:.0%}, "
                         f"overlap leaves {v['remaining']['median']:.0%} ({v['remaining']['low']:.0%}-"
                         f"{v['remaining']['high']:.0%}) of the exposed share of the step"
                         for b, v in s.items() if isinstance(v, dict))
    if name == "tensor":
        return "; ".join(f"{w}: MLP {v['timing']['mlp_ratio']:.2f}x, block {v['timing']['block_ratio']:.2f}x one process"
                         for w, v in s.items() if isinstance(v, dict))
    if name == "pipeline":
        return (f"worst gap to (p - 1)/(m + p - 1): {s['worst_relative_gap']:.1%}; "
                + ", ".join(f"{r['kind']} m={r['micro_batches']}: {r['measured']:.3f}/{r['formula']:.3f}"
                            for r in s["rows"] if r["micro_batches"] in (1, 4, 16)))
    if name == "checkpointing":
        return (f"saved {s['without']['saved_bytes'] / 1e6:.0f} -> {s['with']['saved_bytes'] / 1e6:.0f} MB, "
                f"step {s['with']['seconds'] / s['without']['seconds']:.2f}x")
    return ""


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    sections = {"training": lambda _: training(sizes), "overlap": lambda _: overlap(sizes, rounds),
                "tensor": lambda _: tensor(sizes, rounds), "pipeline": lambda _: pipeline_bubble(sizes, rounds),
                "checkpointing": lambda _: checkpointing(sizes, rounds), "cuda": lambda _: cuda(sizes)}
    run_sections("benchmarks/parallel.py", SECTIONS, sections, args, headline, RESULTS,
                 {"quick": args.quick, "seed": args.seed, "sizes": {k: list(v) if isinstance(v, tuple) else v
                                                                    for k, v in sizes.items()}})


if __name__ == "__main__":
    main()
