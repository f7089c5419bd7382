"""Chapter 09, mixture of experts: the articles' memory, balance and utilization claims, and the published
parameter counts, losses and placements beside ours."""
from __future__ import annotations

import numpy as np

from infra_lab import measured, roofline, verdict
from infra_lab.claims.entry import Entry, Figure, committed, computed, judged, section_of
from infra_lab.model.config import ModelConfig
from infra_lab.moe import placement, published, routing

SWITCH = "https://arxiv.org/abs/2101.03961"
MIXTRAL = "https://arxiv.org/abs/2401.04088"
DEEPSEEK_V3 = "https://arxiv.org/abs/2412.19437"
LOSS_FREE = "https://arxiv.org/abs/2408.15664"
BALANCE = verdict.Claim(
    "an auxiliary loss keeps the experts' loads \"within 15% of each other\" (busiest "
    "expert over the mean, worst layer, validation text; the aux loss at its better "
    "weight)", "A", 1.15, "at most", digits=3)
# deepseek-ai/EPLB's README example: 2 layers of 12 experts' loads, placed as 16 replicas
EPLB_LOADS = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


def balancing_runs() -> tuple[dict, dict] | None:
    results = measured.load("moe_balancing")
    return results and (results, results["runs"])


def balance() -> Figure | None:
    found = balancing_runs()
    if found is None:
        return None
    results, runs = found
    worst = {name: max(run["max_over_mean_per_layer"]) for name, run in runs.items()}
    aux = min((name for name in runs if name.startswith("aux")), key=worst.get)
    return judged(BALANCE, verdict.one_run(results, worst[aux]),
                  "the busiest expert over the mean, worst layer, validation text, the aux loss at its better weight")


def claimed_model() -> ModelConfig:
    """Mixtral's layers, width and attention with 64 experts, 4 per token, and the expert width that
    brings its bf16 weights nearest 200 GB (chapter 09's reading of the article)."""
    def model(d_ff: int) -> ModelConfig:
        return ModelConfig("64 experts, 4 active", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=d_ff,
                           vocab=32000, n_experts=64, experts_per_token=4)
    return model(min(range(128, 16384, 128), key=lambda f: abs(2 * model(f).total_params - 200e9)))


def sparse_memory() -> Figure:
    claimed = claimed_model()
    share = claimed.active_params / claimed.total_params
    return computed(f"all {2 * claimed.total_params / 1e9:.0f} GB of bf16 weights stay resident: no memory saved; "
                    f"each token multiplies {share:.0%} of the parameters, {1 - share:.0%} fewer FLOPs")


def utilization(shares) -> np.ndarray:
    shares = np.asarray(shares)  # (layers, experts)
    return shares.mean(1) / shares.max(1)  # per layer: the mean load over the busiest expert's


def gate_utilization() -> Figure | None:
    found = balancing_runs()
    if found is None or not {"none", "bias"} <= set(found[1]):
        return None
    results, runs = found
    before, after = (utilization(runs[m]["validation_loads_fp16"]).mean() for m in ("none", "bias"))
    return committed(results, None, f"{before:.0%} to {after:.0%} with the bias (mean load over the busiest "
                     f"expert's): {after / before:.2f}×; the article's own numbers give {0.92 / 0.78:.2f}×")


def exposed(row: dict, chunks: int) -> float:
    return row[f"chunks {chunks}"]["exposed_share"]["median"]


def moe_overlap() -> Figure | None:
    found = section_of("moe", "overlap")
    if found is None:
        return None
    rows = {name: row for name, row in found[1].items() if isinstance(row, dict) and "chunks 1" in row}
    return committed(found[0], "overlap", "exposed communication " + "; ".join(
        f"{exposed(row, 1):.0%} whole, {exposed(row, 4):.0%} in 4 chunks ({name})" for name, row in rows.items())
        + ", on one machine's shared memory")


def switch_loss() -> Figure:
    experts, k = 8, 2  # the shipped MoE model's
    tokens = experts * 64
    probs = np.full((tokens, experts), 1 / experts, np.float32)
    chosen = np.stack([(np.arange(tokens) + j) % experts for j in range(k)], 1)
    return computed(f"routing.switch_aux_loss gives {routing.switch_aux_loss(probs, chosen):.3f} at uniform routing "
                    f"(top-{k} of {experts})")


def mixtral_params() -> Figure:
    mixtral = roofline.preset("mixtral-8x7b")
    return computed(f"{mixtral.total_params / 1e9:.1f} B and {mixtral.active_params / 1e9:.1f} B per token, counted "
                    "from its config")


def deepseek_params() -> Figure:
    counted = published.deepseek_v3_params()
    return computed(f"{counted.total / 1e9:.1f} B and {counted.active / 1e9:.1f} B per token, counted from its "
                    "config (moe.published)")


def loss_free() -> Figure | None:
    found = balancing_runs()
    if found is None or not {"aux", "bias"} <= set(found[1]):
        return None
    results, runs = found
    a, b = runs["aux"], runs["bias"]
    return committed(results, None, f"one run each: the bias ends at {b['validation_bits_per_byte']:.3f} bits per "
                     f"byte, worst layer {max(b['max_over_mean_per_layer']):.3f}× the mean load; the aux loss "
                     f"{a['validation_bits_per_byte']:.3f} and {max(a['max_over_mean_per_layer']):.3f}×")


def eplb_example() -> Figure:
    loads = np.array(EPLB_LOADS, float)
    placed = placement.gpu_loads(loads, placement.place(loads, replicas=16, groups=4, nodes=2, gpus=8), 8)
    plain = placement.contiguous_loads(loads, 4)  # 12 experts, 3 to each of 4 GPUs
    busiest = lambda per_gpu: (per_gpu.max(1) / per_gpu.mean(1)).max()  # noqa: E731
    return computed(f"the README's placement, slot for slot (tests/test_moe_placement.py): the busiest GPU carries "
                    f"{busiest(placed):.2f}× the mean load, against {busiest(plain):.2f}× with 3 experts per GPU "
                    "and no replicas")


ENTRIES = [
    Entry("09.balance-15", "09", "an auxiliary loss keeps the experts' loads within 15% of each other", "A",
          "within 15%", balance),
    Entry("09.sparse-memory", "09",
          "an MoE with 64 experts that activates 4 still loads every parameter, 200 GB; sparse activation cuts "
          "memory use by over 90%", "A", "200 GB; over 90%", sparse_memory),
    Entry("09.gate-78-92", "09", "a better gate took expert utilization from 78% to 92%, and throughput up 1.8×",
          "A", "78% to 92%; 1.8×", gate_utilization),
    Entry("09.overlap-40-15", "09",
          "overlapping computation and communication took communication from 40% to 15% of step time", "A",
          "40% to 15%", moe_overlap),
    Entry("09.expert-parallel-30-to-7", "09",
          "expert-parallel training cut a 100B-scale model's training from 30 days to 7", "A", "30 days to 7",
          not_here="the article names no model, cluster or baseline; expert parallelism here runs on 2 to 4 "
                   "processes of one CPU"),
    Entry("09.switch-aux-loss", "09",
          "the Switch Transformer's auxiliary loss E Σ f_i P_i is smallest under uniform routing, where it is 1",
          "Fedus et al., JMLR 2022, Section 2.2, eq. 4", "1", switch_loss, links=(SWITCH,)),
    Entry("09.switch-7x", "09",
          "Switch Transformers reach up to 7× the pre-training speed of T5-Base and T5-Large with the same "
          "computational resources", "Fedus et al., JMLR 2022, abstract", "up to 7×",
          not_here="pre-training T5-sized models takes accelerators this book does not have", links=(SWITCH,)),
    Entry("09.mixtral-params", "09", "Mixtral 8x7B has 47B parameters, 13B of them active per token",
          "Jiang et al., 2024, abstract", "47B and 13B", mixtral_params, links=(MIXTRAL,)),
    Entry("09.deepseek-v3-params", "09", "DeepSeek-V3 has 671B total parameters with 37B activated for each token",
          "DeepSeek-AI, 2024, abstract", "671B and 37B", deepseek_params, links=(DEEPSEEK_V3,)),
    Entry("09.loss-free-balancing", "09",
          "auxiliary-loss-free balancing beats the auxiliary loss on most benchmarks, at both scales tried",
          "DeepSeek-AI, 2024, Section 4.5.2 and Table 5; Wang et al., 2024", "better on most benchmarks", loss_free,
          links=(DEEPSEEK_V3, LOSS_FREE)),
    Entry("09.eplb", "09",
          "EPLB replicates heavy experts and packs the replicas so that each GPU gets about the same load (a worked "
          "example: 2 layers of 12 experts, 16 replicas, 2 nodes of 4 GPUs)", "deepseek-ai/EPLB, README",
          "its example's placement", eplb_example),
]
