"""Prefill/decode disaggregation's published claims, in the simulator (chapter 06): DistServe's
Figure 1 and headline (Zhong et al., OSDI 2024), Splitwise's headline (Patel et al., ISCA 2024)
and vLLM's documentation ("Disaggregated Prefilling (experimental)"). Each function returns plain
dicts, the simulator's figure beside the paper's, for the chapter's tables.

The simulator's roofline is an ideal: every kernel at its roof. With it, one A100 serves OPT-13B's
prefill and decode about four times faster than DistServe measured. So the figures here use two
stated efficiencies, the share of peak FLOP/s (MFU) and of peak bandwidth (MBU) the kernels reach,
fitted (`fit_figure1_efficiencies`) to the paper's two single-phase figures: 5.6 req/s of prefill
alone within the TTFT objective, 10 req/s of decode alone within the TPOT one. Every other figure
(colocated, two prefill GPUs with one decode GPU, the ratio) is then the simulator's prediction.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from infra_lab import hardware
from infra_lab.roofline import preset
from infra_lab.serving.goodput import Bisection, decode_goodput, goodput, prefill_goodput
from infra_lab.serving.links import kv_transfer_bill
from infra_lab.serving.pd_fleet import (SLO, Colocated, Disaggregated, FixedLengths, Instances, Serving, poisson,
                                        step_time_model)
from infra_lab.serving.pd_fleet_loop import simulate

# DistServe, Figure 1 and Section 1: OPT-13B (the paper's "13B model"), 512 tokens in and 64 out,
# one A100 80GB; the objectives as the paper states them (P90 TTFT 0.4 s, P90 TPOT 0.04 s), met
# here as DistServe's goodput is: 90% of requests within both.
FIGURE1_MODEL, FIGURE1_DEVICE = "opt-13b", "A100 SXM 80GB"
FIGURE1_LENGTHS = FixedLengths(512, 64)
FIGURE1_SLO = SLO(ttft_s=0.4, tpot_s=0.04)
FIGURE1_PAPER = {"colocated": 1.6, "prefill_only": 5.6, "decode_only": 10.0, "two_prefill_one_decode": 10.0,
                 "two_prefill_one_decode_per_gpu": 3.3, "ratio": 2.1}  # req/s; the ratio is per GPU
# fit_figure1_efficiencies() with FIGURE1_BISECTION (seeds 0-2, 200 requests a rate) gave these:
FIGURE1_MFU = 0.391  # (0.3910, in 88 s here): prefill alone serves 5.6 req/s within 0.4 s TTFT
FIGURE1_MBU = 0.485  # (0.4855): decode alone serves 10 req/s within 0.04 s TPOT
FIGURE1_BISECTION = Bisection(n=200, seeds=(0, 1, 2), rel_tol=0.03, max_runs=10)


def figure1_serving(mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU) -> Serving:
    """OPT-13B in fp16 served as the vLLM of 2023 served it (prefill-first steps, its defaults)."""
    return Serving(preset(FIGURE1_MODEL), "fp16", compute_efficiency=mfu, memory_efficiency=mbu)


def fit_efficiency(goodput_at: Callable[[float], float], target_req_s: float, low: float = 0.05,
                   high: float = 1.0, rel_tol: float = 0.01) -> float:
    """The efficiency at which `goodput_at(efficiency)` (req/s, rising with it) reaches
    `target_req_s`, by bisection on its log within [low, high]."""
    if not 0 < low < high <= 1:
        raise ValueError(f"need 0 < low < high <= 1; got {low}, {high}")
    if goodput_at(high) < target_req_s:
        raise ValueError(f"even at efficiency {high} the goodput stays below {target_req_s} req/s")
    while high / low > 1 + rel_tol:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if goodput_at(middle) < target_req_s else (low, middle)
    return math.sqrt(low * high)


def fit_figure1_efficiencies(bisection: Bisection = FIGURE1_BISECTION, rel_tol: float = 0.01) -> dict:
    """MFU and MBU fitted to DistServe's single-phase figures: the MFU at which prefill alone on one
    A100 serves 5.6 req/s within 0.4 s TTFT, the MBU at which decode alone serves 10 req/s within
    0.04 s TPOT. (A prompt of 512 tokens is compute-bound and a decode batch memory-bound, so each
    figure fixes one of the two.) Takes a minute or two."""
    started, one = time.perf_counter(), Instances(1, hardware.get(FIGURE1_DEVICE))
    mfu = fit_efficiency(lambda e: prefill_goodput(one, figure1_serving(mfu=e), FIGURE1_LENGTHS, FIGURE1_SLO.ttft_s,
                                                   bisection).rate_req_s, FIGURE1_PAPER["prefill_only"],
                         rel_tol=rel_tol)
    mbu = fit_efficiency(lambda e: decode_goodput(one, figure1_serving(mbu=e), FIGURE1_LENGTHS, FIGURE1_SLO.tpot_s,
                                                  bisection).rate_req_s, FIGURE1_PAPER["decode_only"],
                         rel_tol=rel_tol)
    return {"mfu": mfu, "mbu": mbu, "seconds": time.perf_counter() - started}


def figure1_ratio(bisection: Bisection = FIGURE1_BISECTION, mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU,
                  guesses: bool = True) -> dict:
    """Figure 1's argument in two goodputs: one A100 colocated against two prefill A100s and one
    decode A100 (NVLink between them), per GPU, and their ratio. With `guesses`, each search
    starts from the paper's figure, which only saves runs."""
    serving, a100 = figure1_serving(mfu, mbu), hardware.get(FIGURE1_DEVICE)
    colocated = goodput(Colocated(Instances(1, a100)), serving, FIGURE1_LENGTHS, FIGURE1_SLO, bisection,
                        FIGURE1_PAPER["colocated"] if guesses else None)
    split = goodput(Disaggregated(Instances(2, a100), Instances(1, a100)), serving, FIGURE1_LENGTHS, FIGURE1_SLO,
                    bisection, FIGURE1_PAPER["two_prefill_one_decode"] if guesses else None)
    return {"colocated": colocated, "two_prefill_one_decode": split, "ratio": split.per_gpu / colocated.per_gpu}


def _row(figure: str, simulator: float, paper: float | None, seeds=None) -> dict:
    return {"figure": figure, "simulator": simulator, "paper": paper, "per_seed": list(seeds) if seeds else None}


def figure1(bisection: Bisection = FIGURE1_BISECTION, mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU,
            ideal: bool = True) -> dict:
    """DistServe's Figure 1, simulated: goodput (req/s) of one A100 colocated, of prefill alone
    (TTFT objective only) and decode alone (TPOT objective only), of two prefill A100s with one
    decode A100 per GPU (simulated as a fleet, and as Algorithm 1 composes it from the phases:
    min(2 x prefill, decode) / 3), and the ratio; each beside the paper's. With `ideal`, the
    colocated and 2P1D goodputs and their ratio again on the ideal roofline (MFU = MBU = 1), to
    show what the efficiencies change. Several minutes at the default resolution."""
    started, one = time.perf_counter(), Instances(1, hardware.get(FIGURE1_DEVICE))
    serving, paper = figure1_serving(mfu, mbu), FIGURE1_PAPER
    pair = figure1_ratio(bisection, mfu, mbu)
    prefill = prefill_goodput(one, serving, FIGURE1_LENGTHS, FIGURE1_SLO.ttft_s, bisection, paper["prefill_only"])
    decode = decode_goodput(one, serving, FIGURE1_LENGTHS, FIGURE1_SLO.tpot_s, bisection, paper["decode_only"])
    colocated, split = pair["colocated"], pair["two_prefill_one_decode"]
    rows = [_row("colocated, one A100 (req/s)", colocated.rate_req_s, paper["colocated"], colocated.per_seed),
            _row("prefill alone, one A100, TTFT objective only", prefill.rate_req_s, paper["prefill_only"],
                 prefill.per_seed),
            _row("decode alone, one A100, TPOT objective only", decode.rate_req_s, paper["decode_only"],
                 decode.per_seed),
            _row("2 prefill + 1 decode A100s, per GPU (the fleet simulated)", split.per_gpu,
                 paper["two_prefill_one_decode_per_gpu"], [r / 3 for r in split.per_seed]),
            _row("2 prefill + 1 decode A100s, per GPU: min(2 x prefill, decode) / 3",
                 min(2 * prefill.rate_req_s, decode.rate_req_s) / 3, paper["two_prefill_one_decode_per_gpu"]),
            _row("disaggregated / colocated, per GPU", pair["ratio"], paper["ratio"])]
    if ideal:
        roof = figure1_ratio(bisection, 1.0, 1.0, guesses=False)
        rows += [_row("ideal roofline: colocated, one A100 (req/s)", roof["colocated"].rate_req_s, None),
                 _row("ideal roofline: 2 prefill + 1 decode, per GPU", roof["two_prefill_one_decode"].per_gpu, None),
                 _row("ideal roofline: disaggregated / colocated, per GPU", roof["ratio"], None)]
    searches = [colocated, split, prefill, decode]
    return {"settings": {"model": FIGURE1_MODEL, "device": FIGURE1_DEVICE, "prompt": FIGURE1_LENGTHS.prompt,
                         "output": FIGURE1_LENGTHS.output, "ttft_slo_s": FIGURE1_SLO.ttft_s,
                         "tpot_slo_s": FIGURE1_SLO.tpot_s, "attainment": bisection.target, "mfu": mfu, "mbu": mbu,
                         "requests_per_rate": bisection.n, "seeds": list(bisection.seeds)},
            "rows": rows, "seconds": time.perf_counter() - started,
            "steps_per_s": sum(g.steps for g in searches) / sum(g.sim_s for g in searches)}


# ---- vLLM's documentation: no more throughput, but TTFT and ITL tuned apart ---------------------------

VLLM_CLAIM = ("Disaggregated prefill DOES NOT improve throughput", "tune time-to-first-token (TTFT) and "
              "inter-token-latency (ITL) separately")  # docs.vllm.ai, "Disaggregated Prefilling (experimental)"


def _p90(values) -> float:
    return float(np.percentile(values, 90))


def vllm_claim(figure: dict | None = None, n: int = 200, seeds: tuple[int, ...] = (0, 1, 2),
               rates_per_gpu: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0), mfu: float = FIGURE1_MFU,
               mbu: float = FIGURE1_MBU, bisection: Bisection = FIGURE1_BISECTION) -> dict:
    """When each half of vLLM's statement holds, at Figure 1's settings. Throughput with no SLO:
    `n` requests arriving at once, requests per second per GPU until the last finishes (the mean
    over `seeds`), colocated against three disaggregated placements. Goodput per GPU under
    Figure 1's SLO: from `figure` (figure1_ratio's result) or computed. And TTFT and TPOT apart:
    the P90 of each, at each rate per GPU, colocated and 2P1D."""
    started, a100, serving = time.perf_counter(), hardware.get(FIGURE1_DEVICE), figure1_serving(mfu, mbu)
    one, two = Instances(1, a100), Instances(2, a100)
    placements = {"colocated, 1 GPU": Colocated(one), "1 prefill + 1 decode": Disaggregated(one, one),
                  "2 prefill + 1 decode": Disaggregated(two, one), "1 prefill + 2 decode": Disaggregated(one, two)}
    throughput = {}
    for name, placement in placements.items():
        runs = [simulate(placement, serving, poisson(math.inf, n, FIGURE1_LENGTHS, seed)) for seed in seeds]
        throughput[name] = sum(r.throughput_req_s for r in runs) / len(runs) / placement.gpus
    pair = figure or figure1_ratio(bisection, mfu, mbu)
    latencies = []
    for rate in rates_per_gpu:
        for name in ("colocated, 1 GPU", "2 prefill + 1 decode"):
            placement = placements[name]
            run = simulate(placement, serving, poisson(rate * placement.gpus, n, FIGURE1_LENGTHS, seeds[0]))
            latencies.append({"placement": name, "rate_per_gpu": rate, "ttft_p90_s": _p90(run.ttft_s),
                              "tpot_p90_s": _p90(run.tpot_s)})
    best_split = max(v for k, v in throughput.items() if k != "colocated, 1 GPU")
    return {"claim": VLLM_CLAIM, "throughput_per_gpu": throughput,
            "goodput_per_gpu": {"colocated, 1 GPU": pair["colocated"].per_gpu,
                                "2 prefill + 1 decode": pair["two_prefill_one_decode"].per_gpu},
            "latencies": latencies,
            "throughput_colocated_over_best_disaggregated": throughput["colocated, 1 GPU"] / best_split,
            "goodput_disaggregated_over_colocated": pair["ratio"], "seconds": time.perf_counter() - started}


# ---- the KV transfer bill -----------------------------------------------------------------------------

KV_BILL_PAPER_GB = 1.13  # DistServe: the K and V of one 512-token OPT-66B request


def kv_bill(model: str = "opt-66b", prompt: int = 512, output: int = 64, decode_device: str = FIGURE1_DEVICE,
            decode_tp: int = 4, batch: int = 32, mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU) -> dict:
    """One request's K and V in fp16 (bytes, GiB, beside DistServe's 1.13 GB), and on each link its
    transfer time against one decode step of a `batch`-request batch on `decode_tp` GPUs of
    `decode_device` (at the fitted efficiencies) and against the request's whole decode; and how
    many requests per second one link carries."""
    serving = Serving(preset(model), "fp16", compute_efficiency=mfu, memory_efficiency=mbu)
    step_s = step_time_model(serving, hardware.get(decode_device), decode_tp).seconds(
        [(prompt + output // 2, 1)] * batch)
    rows = kv_transfer_bill(serving.model, prompt, output, step_s)
    for row in rows:
        row["requests_per_s"] = 1 / row["transfer_s"]
    return {"model": model, "prompt": prompt, "bytes": rows[0]["bytes"], "gib": rows[0]["gib"],
            "paper_gb": KV_BILL_PAPER_GB, "decode": f"{batch} requests on {decode_tp} x {decode_device}",
            "decode_step_s": step_s, "links": rows}
