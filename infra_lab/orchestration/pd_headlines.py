"""The two papers' headlines, in the simulator at approximations of their settings (chapter 06).

DistServe (Zhong et al., OSDI 2024, abstract): "7.4x more requests or 12.6x tighter SLO" than
vLLM with over 90% of requests within their latency objectives. Approximated here with its
chatbot application: OPT-13B on ShareGPT-like lengths, TTFT 0.25 s and TPOT 0.1 s (its Table 1,
as we read it), A100s, at the efficiencies fitted to its Figure 1 (pd_claims). The paper's best
ratios come from other models and workloads too; this is one setting, not its maximum.

Splitwise (Patel et al., ISCA 2024, abstract): "1.4x higher throughput at 20% lower cost" than
current designs, with its Splitwise-HA cluster: DGX-H100 machines for prompts, DGX-A100 machines
for tokens. Approximated with LLaMA-2-70B on 8-GPU machines (tensor parallelism 8), the median
lengths of its two traces, objectives at its P90 slowdowns over a request served alone on a
DGX-A100 (3x for TTFT, 1.5x for the time between tokens, as we read its SLO table; over the A100,
so that Baseline-A100 can meet them), and its machines' prices and power: a DGX-H100 costs 2.16x
a DGX-A100 and draws 1.75x the power (Splitwise's hardware table). 1.4x the throughput at 0.8x the
cost is 1.75x the throughput per dollar.
"""
from __future__ import annotations

import time

from infra_lab import hardware
from infra_lab.orchestration.pd_claims import FIGURE1_MBU, FIGURE1_MFU
from infra_lab.roofline import preset
from infra_lab.serving.goodput import Bisection, decode_goodput, goodput, prefill_goodput, tightest_slo_scale
from infra_lab.serving.links import NETWORK_200G
from infra_lab.serving.pd_fleet import (SLO, Colocated, FixedLengths, Instances, Serving, ShareGPTLengths,
                                        step_time_model)
from infra_lab.serving.placement import PhaseGoodputs, best_colocated, best_placement, phase_goodputs

DISTSERVE_PAPER = {"more_requests": 7.4, "tighter_slo": 12.6}  # the abstract, best over its settings
DISTSERVE_CHATBOT = {"model": "opt-13b", "lengths": ShareGPTLengths(2048), "slo": SLO(ttft_s=0.25, tpot_s=0.1)}
HEADLINE_BISECTION = Bisection(n=400, seeds=(0,), rel_tol=0.05, max_runs=10)

SPLITWISE_PAPER = {"throughput": 1.4, "cost": 0.8, "throughput_per_cost": 1.4 / 0.8}
SPLITWISE_WORKLOADS = {"coding": FixedLengths(1500, 13), "conversation": FixedLengths(1020, 129)}  # medians
H100_MACHINE_COST = 2.16  # a DGX-H100's price over a DGX-A100's (Splitwise's hardware table)
H100_MACHINE_POWER = 1.75  # its power over a DGX-A100's (the same table)
SPLITWISE_SLOWDOWN = {"ttft": 3.0, "tpot": 1.5}  # P90 objectives over a request alone (Splitwise's SLO table)
MACHINE_GPUS = 8


def distserve_headline(bisection: Bisection = HEADLINE_BISECTION, budget_gpus: int = 8, tps: tuple[int, ...] = (1, 2),
                       mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU) -> dict:
    """More requests: the best disaggregated placement's goodput per GPU (Algorithm 1 within
    `budget_gpus`, then the chosen placement simulated as a fleet) over the best colocated one's
    (vLLM of 2023, prefill-first). Tighter SLO: at the colocated goodput per GPU, the smallest SLO
    scale each meets 90% at; the colocated one's over the disaggregated one's."""
    started, a100 = time.perf_counter(), hardware.get("A100 SXM 80GB")
    serving = Serving(preset(DISTSERVE_CHATBOT["model"]), "fp16", compute_efficiency=mfu, memory_efficiency=mbu)
    lengths, slo = DISTSERVE_CHATBOT["lengths"], DISTSERVE_CHATBOT["slo"]
    colocated = best_colocated(serving, lengths, slo, a100, budget_gpus, tps, bisection)
    table, _ = phase_goodputs(serving, lengths, slo, a100, a100, tps, bisection)
    chosen = best_placement(table, budget_gpus)
    placement = chosen.placement(a100, a100)
    simulated = goodput(placement, serving, lengths, slo, bisection, chosen.rate_req_s)
    rate_per_gpu = colocated.rate_per_cost
    one_replica = Colocated(Instances(1, a100, colocated.tp))
    colocated_scale = tightest_slo_scale(one_replica, serving, lengths, slo, rate_per_gpu * colocated.tp, bisection)
    split_scale = tightest_slo_scale(placement, serving, lengths, slo, rate_per_gpu * placement.gpus, bisection)
    return {"settings": {"model": DISTSERVE_CHATBOT["model"], "lengths": lengths.label, "ttft_slo_s": slo.ttft_s,
                         "tpot_slo_s": slo.tpot_s, "budget_gpus": budget_gpus, "tps": list(tps), "mfu": mfu,
                         "mbu": mbu, "requests_per_rate": bisection.n},
            "colocated": {"tp": colocated.tp, "per_gpu": rate_per_gpu},
            "phases": {"prefill": table.prefill, "decode": table.decode},
            "disaggregated": {"placement": placement.label, "predicted_per_gpu": chosen.rate_per_cost,
                              "simulated_per_gpu": simulated.per_gpu},
            "more_requests": simulated.per_gpu / rate_per_gpu, "tighter_slo": colocated_scale / split_scale,
            "slo_scales": {"colocated": colocated_scale, "disaggregated": split_scale},
            "paper": DISTSERVE_PAPER, "seconds": time.perf_counter() - started}


def splitwise_slo(serving: Serving, lengths: FixedLengths) -> SLO:
    """Splitwise's P90 objectives as slowdowns over one request served alone on a DGX-A100."""
    alone = step_time_model(serving, hardware.get("A100 SXM 80GB"), MACHINE_GPUS)
    ttft = alone.seconds([(0, lengths.prompt)])
    tpot = alone.seconds([(lengths.prompt + lengths.output // 2, 1)])
    return SLO(SPLITWISE_SLOWDOWN["ttft"] * ttft, SPLITWISE_SLOWDOWN["tpot"] * tpot)


def splitwise_headline(workload: str = "conversation", bisection: Bisection = HEADLINE_BISECTION,
                       budget_h100_machines: int = 4, mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU) -> dict:
    """Throughput per dollar and per watt of Splitwise-HA (H100 prompt machines, A100 token
    machines, 200 Gb/s InfiniBand per GPU between them) and of Baseline-A100, each over
    Baseline-H100 (colocated H100 machines, mixed continuous batching), within the price of
    `budget_h100_machines` DGX-H100s. A machine is one instance of 8 GPUs (tensor parallelism 8)."""
    if workload not in SPLITWISE_WORKLOADS:
        raise KeyError(f"unknown workload {workload!r}; Splitwise's traces: {', '.join(SPLITWISE_WORKLOADS)}")
    started, lengths = time.perf_counter(), SPLITWISE_WORKLOADS[workload]
    h100, a100 = hardware.get("H100 SXM"), hardware.get("A100 SXM 80GB")
    serving = Serving(preset("llama-2-70b"), "fp16", compute_efficiency=mfu, memory_efficiency=mbu, policy="continuous")
    slo = splitwise_slo(serving, lengths)
    machine_goodput = {name: goodput(Colocated(Instances(1, device, MACHINE_GPUS)), serving, lengths, slo,
                                     bisection).rate_req_s for name, device in (("H100", h100), ("A100", a100))}
    prompt_h100 = prefill_goodput(Instances(1, h100, MACHINE_GPUS), serving, lengths, slo.ttft_s, bisection).rate_req_s
    token_a100 = decode_goodput(Instances(1, a100, MACHINE_GPUS), serving, lengths, slo.tpot_s, bisection).rate_req_s
    table = PhaseGoodputs({MACHINE_GPUS: prompt_h100}, {MACHINE_GPUS: token_a100},
                          prefill_gpu_cost=H100_MACHINE_COST, decode_gpu_cost=1.0)
    chosen = best_placement(table, budget_h100_machines * MACHINE_GPUS * H100_MACHINE_COST)
    placement = chosen.placement(h100, a100, NETWORK_200G)
    simulated = goodput(placement, serving, lengths, slo, bisection, chosen.rate_req_s)
    per_cost = {"Baseline-H100": machine_goodput["H100"] / H100_MACHINE_COST, "Baseline-A100": machine_goodput["A100"],
                "Splitwise-HA": simulated.rate_req_s / (chosen.cost / MACHINE_GPUS)}
    power = chosen.prefill_count * H100_MACHINE_POWER + chosen.decode_count
    per_power = {"Baseline-H100": machine_goodput["H100"] / H100_MACHINE_POWER,
                 "Baseline-A100": machine_goodput["A100"], "Splitwise-HA": simulated.rate_req_s / power}
    base = "Baseline-H100"
    return {"settings": {"workload": workload, "lengths": lengths.label, "ttft_slo_s": slo.ttft_s,
                         "tpot_slo_s": slo.tpot_s, "model": "llama-2-70b", "mfu": mfu, "mbu": mbu,
                         "requests_per_rate": bisection.n},
            "machine_goodput": machine_goodput, "phases": {"prompt_h100": prompt_h100, "token_a100": token_a100},
            "splitwise_ha": {"prompt_machines": chosen.prefill_count, "token_machines": chosen.decode_count,
                             "predicted_req_s": chosen.rate_req_s, "simulated_req_s": simulated.rate_req_s},
            "throughput_per_cost_vs_h100": {k: v / per_cost[base] for k, v in per_cost.items()},
            "throughput_per_power_vs_h100": {k: v / per_power[base] for k, v in per_power.items()},
            "paper": SPLITWISE_PAPER, "seconds": time.perf_counter() - started}
