"""Chapter 05, continuous batching: the chapter's verdicts, the articles' utilization figures, and Orca's
and vLLM's headlines beside the simulator."""
from __future__ import annotations

import functools

from infra_lab import hardware, roofline, verdict
from infra_lab.claims.entry import Entry, Figure, committed, computed, judged, section_of
from infra_lab.serving import metrics, simulator, traffic
from infra_lab.serving.config import EngineConfig

ORCA = "https://www.usenix.org/conference/osdi22/presentation/yu"
VLLM = "https://arxiv.org/abs/2309.06180"
ENGINE = "this book's target for its engine"
CHUNKED = "this book's target for chunked prefill"

FILLS_THE_BATCH = verdict.Claim(
    "continuous batching serves at least 2.5× the output tokens per second of static "
    "batching (512 requests at once, batches of at most 64)", ENGINE, 2.5, "at least")
WEIGHT_BOUND = verdict.Claim(
    "continuous batching serves at least 2.5× the output tokens per second of static "
    "batching where a decode step reads mostly weights (SmolLM2-135M, 64 requests "
    "at once)", ENGINE, 2.5, "at least")
HALVES_THE_TAIL = verdict.Claim(
    "chunked prefill cuts the 99th percentile of the time between tokens to half or "
    "less when long prompts arrive among decodes (16 decoding requests, 12 prompts "
    "of 480 tokens)", CHUNKED, 0.5, "at most")
KEEPS_THE_RATE = verdict.Claim(
    "chunked prefill keeps at least 90% of the output tokens per second", CHUNKED, 0.9, "at least", unit="×")
SIMULATOR = verdict.Claim(
    "the simulator predicts the engine's throughput and median time between tokens "
    "within 25% (the worst of both, at 30%, 60% and 90% of the engine's saturating "
    "arrival rate)", "this book's target for its simulator", 0.25, "at most", unit="%", digits=1)


def throughput() -> Figure | None:
    found = section_of("serving", "throughput")
    return found and judged(FILLS_THE_BATCH, verdict.evidence(found[0], found[1]["over_static"]["continuous"],
                                                              "throughput"))


def weight_bound() -> Figure | None:
    found = section_of("serving", "weight_bound")
    if found is None or found[1].get("model") != "smollm2-135m":  # another model's run says nothing here
        return None
    return judged(WEIGHT_BOUND, verdict.evidence(found[0], found[1]["over_static"], "weight_bound"))


def chunked(claim: verdict.Claim, key: str):
    def figure() -> Figure | None:
        found = section_of("serving", "chunked")
        return found and judged(claim, verdict.evidence(found[0], found[1][key], "chunked"))
    return figure


def simulator_error() -> Figure | None:
    found = section_of("serving", "simulator")
    if found is None:
        return None
    worst = max(abs(error) for load in found[1]["loads"].values() for error in load["relative_error"].values())
    return judged(SIMULATOR, verdict.one_run(found[0], worst, "simulator"))


def slot_utilization() -> Figure | None:
    found = section_of("serving", "throughput")
    if found is None:
        return None
    results, section = found
    used = section["slot_utilization"]
    return committed(results, "throughput", f"slot utilization {used['static']:.0%} static, "
                     f"{used['continuous']:.0%} continuous ({section['requests']} requests at once, batches of "
                     "64; the benchmark runs no dynamic policy)")


@functools.cache
def at_scale() -> dict:
    """Chapter 05's reproduction: LLaMA-2-7B in bf16 on a simulated H100 at the roofline, 200
    ShareGPT-like requests at once, each reserving 2,048 tokens (Orca) or paged (vLLM)."""
    h100, llama2 = hardware.get("H100 SXM"), roofline.preset("llama-2-7b")
    ideal = simulator.StepTimeModel.on(llama2, h100, "bf16")
    blocks = simulator.pool_blocks(llama2, h100)
    reserved = blocks * 16 // 2048  # requests that fit, each reserving 2,048 tokens
    crowd = [traffic.TimedRequest(0.0, [7] * p, o)
             for p, o in traffic.sharegpt_lengths(200, seed=1, max_len=2048, scale=1.0)]
    setups = {"static": EngineConfig(policy="static", max_batch=reserved, token_budget=2048, num_blocks=blocks),
              "orca": EngineConfig(policy="continuous", max_batch=reserved, token_budget=2048, num_blocks=blocks),
              "vllm": EngineConfig(policy="continuous", max_batch=256, token_budget=2048, num_blocks=blocks)}
    rates = {}
    for name, config in setups.items():
        engine = simulator.simulated_engine(ideal, config)
        rates[name] = metrics.summarize(engine.serve(crowd), engine.log, config.max_batch).throughput_tok_s
    return rates


def orca_gain() -> Figure:
    rates = at_scale()
    return computed(f"{rates['orca'] / rates['static']:.2f}× continuous over static, both reserving 2,048 tokens "
                    "(simulated: LLaMA-2-7B on an H100 at the roofline, throughput at saturation)")


def vllm_gain() -> Figure:
    rates = at_scale()
    return computed(f"{rates['vllm'] / rates['orca']:.2f}× paged over reserved, both continuous (simulated: "
                    "LLaMA-2-7B on an H100 at the roofline, throughput at saturation)")


ENTRIES = [
    Entry("05.fills-the-batch", "05", FILLS_THE_BATCH.statement, ENGINE, "2.5× (a target)", throughput),
    Entry("05.weight-bound", "05", WEIGHT_BOUND.statement, ENGINE, "2.5× (a target)", weight_bound),
    Entry("05.chunked-tail", "05", HALVES_THE_TAIL.statement, CHUNKED, "0.5× (a target)",
          chunked(HALVES_THE_TAIL, "p99_chunked_over_continuous")),
    Entry("05.chunked-rate", "05", KEEPS_THE_RATE.statement, CHUNKED, "0.9× (a target)",
          chunked(KEEPS_THE_RATE, "throughput_chunked_over_continuous")),
    Entry("05.simulator", "05", SIMULATOR.statement, SIMULATOR.source, "25% (a target)", simulator_error),
    Entry("05.dynamic-35-78", "05", "dynamic batching raised GPU utilization from 35% to 78%", "A",
          "35% to 78%", slot_utilization),
    Entry("05.continuous-30-90", "05",
          "continuous batching raises GPU utilization from static batching's 30% to above 90%", "B",
          "30% to above 90%", slot_utilization),
    Entry("05.ttft-qps", "05",
          "TTFT can exceed 1 s, and one card often serves under 10 QPS", "B", "over 1 s; under 10 QPS",
          not_here="the article names no model, GPU, prompt length or load; chapter 05 measures TTFT on its "
                   "own streams instead"),
    Entry("05.orca-36.9x", "05",
          "Orca reaches up to 36.9× the throughput of NVIDIA FasterTransformer at the same latency, on GPT-3 "
          "175B", "Yu et al., OSDI 2022", "up to 36.9×", orca_gain, links=(ORCA,)),
    Entry("05.vllm-2-4x", "05",
          "vLLM improves throughput by 2 to 4× over Orca and FasterTransformer at the same latency, on OPT and "
          "LLaMA models with ShareGPT and Alpaca traces", "Kwon et al., SOSP 2023", "2 to 4×", vllm_gain,
          links=(VLLM,)),
]
