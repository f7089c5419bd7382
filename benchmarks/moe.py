"""Issue 18's bars for chapter 09's mixture of experts, on the CPU (torch on a CUDA GPU when there
is one). Each section is one function:

- layer: one MoE layer at 4,096 tokens with the MoE model's shapes (d 128, 8 experts of width 256,
  top-2): the numba layer (route, permute, the experts' grouped GEMMs, combine) as a share of
  this machine's measured fp32 BLAS peak, counted on the experts' FLOPs (2 x 3 d f per token and
  expert), against a torch layer in the style of Hugging Face's Mixtral block (a loop over the
  experts with masks and index_add_); the numba layer's time split between routing and
  permutation, the experts, and the combine;
- overlap: the expert-parallel layer on 2 and 4 gloo processes, the same tokens per process,
  with its two exchanges whole and in chunks that overlap the experts' work: each rank's time
  blocked on an exchange (the exposed communication) as a share of its layer time, and the
  bytes each rank sent against the count from its routing;
- cuda: the MoE layer in bf16 as a share of the measured bf16 matmul peak (only with a GPU).

Ratios come from runs in this one invocation; variants take turns, and a ratio is the median of
the rounds' own ratios with a 95% interval for that median.

    python benchmarks/moe.py [--quick] [--only SECTION ...] [--rounds N] [--json PATH]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from infra_lab import hardware
from infra_lab.moe import numba_layer as numba_layer_face
from infra_lab.moe import torch_moe
from infra_lab.moe.experts import ExpertWeights, experts_numba

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "moe.json"
SECTIONS = ("layer", "overlap", "cuda")
FULL = {"tokens": 4096, "d": 128, "f": 256, "experts": 8, "k": 2, "rounds": 7, "call_s": 0.5,
        "worlds": (2, 4), "chunks": 4, "ep_tokens_per_rank": 4096}
QUICK = {"tokens": 512, "d": 64, "f": 128, "experts": 8, "k": 2, "rounds": 2, "call_s": 0.05,
         "worlds": (2,), "chunks": 2, "ep_tokens_per_rank": 256}


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    values = [a / b for a, b in zip(numerators, denominators)]
    low, high = median_interval(values)
    return {"median": statistics.median(values), "low": low, "high": high, "rounds": values}


def problem(sizes: dict, seed: int = 0):
    """Tokens (T, d), a router (d, E) and experts, float32, with the router's scale giving the
    spread of a trained one (no expert starves)."""
    rng = np.random.default_rng(seed)
    d, f, e = sizes["d"], sizes["f"], sizes["experts"]
    x = rng.standard_normal((sizes["tokens"], d)).astype(np.float32)
    router = (rng.standard_normal((d, e)) / np.sqrt(d)).astype(np.float32)
    weights = ExpertWeights(*((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
                              for s in ((e, d, f), (e, d, f), (e, f, d))))
    return x, router, weights


def expert_flops(sizes: dict) -> float:
    return 2.0 * sizes["tokens"] * sizes["k"] * 3 * sizes["d"] * sizes["f"]


# ---- layer ---------------------------------------------------------------------------------------

def numba_layer(x, router, weights, k, split: dict | None = None):
    """The MoE layer on numba (moe.numba_layer), each stage timed into `split` when given."""
    t0 = time.perf_counter()
    routing, _ = numba_layer_face.route(x, router, k)
    plan = numba_layer_face.plan(routing, weights.n_experts)
    x_sorted = numba_layer_face.permute(x, plan.tokens)
    t1 = time.perf_counter()
    out_sorted = experts_numba(x_sorted, plan.offsets, weights)
    t2 = time.perf_counter()
    y = numba_layer_face.combine(out_sorted, plan.slot_of, plan.weights)
    t3 = time.perf_counter()
    if split is not None:
        for name, seconds in (("route and permute", t1 - t0), ("experts", t2 - t1), ("combine", t3 - t2)):
            split.setdefault(name, []).append(seconds)
    return y


def seconds_per_call(run, budget_s: float) -> float:
    run()
    started, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - started < budget_s:
        run()
        calls += 1
    return (time.perf_counter() - started) / calls


def layer(sizes: dict, rounds: int, seed: int) -> dict:
    import torch

    x, router, weights = problem(sizes, seed)
    k = sizes["k"]
    tx, trouter = torch.from_numpy(x), torch.from_numpy(router)
    tweights = [torch.from_numpy(w) for w in weights]
    reference = numba_layer(x, router, weights, k)
    with torch.no_grad():
        peer = torch_moe.mixtral_block(tx, trouter, *tweights, k).numpy()
    if not np.allclose(reference, peer, atol=1e-4):
        raise AssertionError("the numba layer and the Mixtral-style torch layer disagree")
    runs = {"numba": lambda: numba_layer(x, router, weights, k),
            "torch (Mixtral-style loop)": lambda: torch_moe.mixtral_block(tx, trouter, *tweights, k)}
    seconds = {name: [] for name in runs}
    order = np.random.default_rng(seed)
    peak_rounds = []
    with torch.no_grad():
        for _ in range(rounds):
            for name in order.permutation(list(runs)):
                seconds[name].append(seconds_per_call(runs[name], sizes["call_s"]))
            peak_rounds.append(hardware.blas_flops("fp32"))
    split: dict = {}
    for _ in range(max(3, rounds)):
        numba_layer(x, router, weights, k, split)
    flops = expert_flops(sizes)
    out = {"flops": flops, "blas_peak_GFLOPs": {"median": statistics.median(peak_rounds) / 1e9,
                                                "rounds": [p / 1e9 for p in peak_rounds]}}
    for name, values in seconds.items():
        out[name] = {"ms": statistics.median(values) * 1e3, "GFLOPs": flops / statistics.median(values) / 1e9,
                     "share_of_blas_peak": ratio([flops / s for s in values], peak_rounds)}
    out["numba_over_torch"] = ratio(seconds["torch (Mixtral-style loop)"], seconds["numba"])
    total = sum(statistics.median(v) for v in split.values())
    out["split_ms"] = {name: statistics.median(v) * 1e3 for name, v in split.items()}
    out["split_share"] = {name: statistics.median(v) / total for name, v in split.items()}
    share = out["numba"]["share_of_blas_peak"]["median"]
    out["bars"] = {"share_of_blas_peak": {"need": 0.5, "got": share},
                   "numba_over_torch": {"need": 1.0, "got": out["numba_over_torch"]["median"]}}
    out["passed"] = all(b["got"] >= b["need"] for b in out["bars"].values())
    return out


# ---- overlap -------------------------------------------------------------------------------------

def overlap(sizes: dict, rounds: int, seed: int) -> dict:
    from infra_lab.moe import ep_runs
    from infra_lab.processes import run_on_ranks

    out = {}
    for world in sizes["worlds"]:
        ranks = run_on_ranks(ep_runs.overlap_rank, world, sizes, rounds, seed, timeout_s=600)
        row = {"bytes_equal_formula": all(r["bytes_to_others"] == r["bytes_by_formula"] for r in ranks),
               "bytes_to_others": [r["bytes_to_others"] for r in ranks],
               "same_output": all(r["same_output"] for r in ranks)}
        for chunks in (1, sizes["chunks"]):
            # per round, the mean over ranks of each rank's exposed share
            shares = [statistics.mean(r["timings"][chunks][i]["waiting_s"] / r["timings"][chunks][i]["total_s"]
                                      for r in ranks) for i in range(rounds)]
            totals = [max(r["timings"][chunks][i]["total_s"] for r in ranks) for i in range(rounds)]
            low, high = median_interval(shares)
            row[f"chunks {chunks}"] = {"exposed_share": {"median": statistics.median(shares), "low": low,
                                                         "high": high, "rounds": shares},
                                       "layer_ms": statistics.median(totals) * 1e3}
        out[f"{world} processes"] = row
    out["passed"] = all(r["bytes_equal_formula"] and r["same_output"] for r in out.values() if isinstance(r, dict))
    return out


# ---- cuda ----------------------------------------------------------------------------------------

def cuda(sizes: dict, rounds: int, seed: int) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on this machine"}
    from infra_lab.moe import torch_moe

    big = dict(sizes, tokens=16384, d=4096, f=14336 // 8)  # Mixtral-8x7B's widths, experts narrowed 8x
    x, router, weights = problem(big, seed)
    to = lambda a: torch.from_numpy(a).cuda().to(torch.bfloat16)  # noqa: E731
    tx, trouter, tw = to(x), to(router), [to(w) for w in weights]
    run = lambda: torch_moe.moe_forward(tx, trouter, *tw, big["k"])  # noqa: E731
    seconds = hardware.cuda_seconds(torch, run, max(3, rounds))
    peak = hardware._cuda_matmul_flops(torch, "bf16")
    flops = expert_flops(big)
    return {"shapes": big, "ms": seconds * 1e3, "TFLOPs": flops / seconds / 1e12,
            "share_of_bf16_peak": flops / seconds / peak if peak else None}


def headline(name: str, s: dict) -> str:
    if "skipped" in s:
        return f"skipped ({s['skipped']})"
    if name == "layer":
        return (f"numba {s['numba']['share_of_blas_peak']['median']:.0%} of the BLAS peak, "
                f"{s['numba_over_torch']['median']:.2f}x the Mixtral-style torch loop; split "
                + ", ".join(f"{k} {v:.0%}" for k, v in s["split_share"].items()))
    if name == "overlap":
        return "; ".join(f"{w}: exposed {r['chunks 1']['exposed_share']['median']:.0%} whole, "
                         + ", ".join(f"{v['exposed_share']['median']:.0%} in {c}" for c, v in r.items()
                                     if c.startswith("chunks") and c != "chunks 1")
                         for w, r in s.items() if isinstance(r, dict))
    return ""


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    runs = {"layer": lambda _: layer(sizes, rounds, args.seed), "overlap": lambda _: overlap(sizes, rounds, args.seed),
            "cuda": lambda _: cuda(sizes, rounds, args.seed)}
    run_sections("benchmarks/moe.py", SECTIONS, runs, args, headline, RESULTS,
                 {"quick": args.quick, "seed": args.seed, "sizes": sizes})


if __name__ == "__main__":
    main()
