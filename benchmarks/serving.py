"""Issue 15's bars for chapter 05's serving engine, on the real model (the shipped target) with
the numba backend on the CPU. Each section is one function and one bar:

- throughput: every request of a ShareGPT-like stream arrives at t = 0; continuous batching
  (policies "continuous" and "chunked") must reach >= 2.5x the output tokens/s of static
  batching at the same max_batch (64), next to the ceiling traffic.static_ceiling gives. The
  continuous policy runs with a budget of 576 tokens (64 decodes + the longest prompt); at the
  default 512 a long prompt waits at the head of the queue, and everything behind it, until
  enough running requests finish (reported beside, outside the bar);
- weight_bound: the same comparison on a model whose decode step reads mostly weights
  (SmolLM2-135M-Instruct, model.pretrained: 538 MB of float32 weights a token, its prompts cut
  from the same text in its own tokens), at the largest batch whose decode step this CPU's
  roofline puts under the ridge; continuous must reach >= 2.5x static, next to the ceiling at
  that batch;
- chunked: long prompts arrive while a batch decodes (traffic.long_prompts_among_decodes, its
  arrivals set from the engine's measured step time); with chunked prefill the p99 time between
  tokens must be <= half of that without, for at most 10% less throughput;
- overhead: at a batch of 64 decodes, everything but the model's forward (scheduling, metadata,
  sampling, the log) must take <= 10% of a step; the split is profiled;
- overload: 3x the saturating request rate, with a queue cap and a pool small enough to preempt
  (by recompute, then by swap): the run must end, every request finish or be rejected with a
  reason, and the pool and the host pool be empty afterwards;
- simulator: the step-time model fitted on this machine (simulator.time_steps) must predict the
  real engine's throughput and median time between tokens within 25% at 30%, 60% and 90% of
  the saturating rate;
- exact: greedy requests through the engine give the tokens each gives alone, for every policy
  on numba and on torch (CPU);
- cuda: decode tokens/s through the engine at batch 1, 64 and 256 (only with a CUDA GPU).

Every ratio comes from runs in this one invocation; where a section runs several rounds, the
variants take turns in a new order each round, and a ratio is the median of the rounds' own
ratios with a 95% interval for that median (order statistics, as in engine_core.py).

    python benchmarks/serving.py [--quick] [--only SECTION ...] [--rounds N] [--blas-threads N] [--json PATH]

Without --quick the figures go to benchmarks/results/serving.json (with --only, into the
sections of that file, the others kept); --quick (small sizes, under 2 minutes) writes nothing
unless --json is given.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import math
import os
import pstats
import signal
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from infra_lab import backend, hardware, model, roofline
from infra_lab.model import cost
from infra_lab.model import pretrained
from infra_lab.model.generate import generate
from infra_lab.serving import metrics, simulator, steplog, traffic
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import RequestState, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval  # noqa: E402  (one helper for the intervals of every benchmark)

RESULTS = Path(__file__).parent / "results" / "serving.json"
MAX_BATCH, MAX_LEN, BLOCK = 64, 512, 16
STATIC_BLOCKS = MAX_BATCH * MAX_LEN // BLOCK  # 2048: a static batch of 64 worst-case requests fits


@dataclass(frozen=True)
class Sizes:
    throughput_requests: int  # ShareGPT-like requests, all at t = 0
    weight_bound_requests: int  # weight_bound: ShareGPT-like requests of up to WEIGHT_BOUND_MAX_LEN tokens, at t = 0
    rounds: int  # rounds of the throughput, weight_bound and chunked sections
    n_decodes: int  # chunked: requests decoding while the long prompts arrive
    decode_output: int  # chunked: tokens each of them generates
    n_long: int  # chunked: long prompts
    overhead_tokens: int  # overhead: tokens each of the 64 requests generates
    overhead_runs: int
    rate_requests: int  # requests of the short run that measures the saturating rate
    overload_s: float  # overload: seconds of arrivals
    overload_queue: int  # overload: max_waiting, the queue cap
    simulator_s: float  # simulator: seconds of arrivals per rate
    calibration_repeats: int
    cuda_tokens: int  # cuda: tokens each request generates


FULL = Sizes(throughput_requests=512, weight_bound_requests=64, rounds=3, n_decodes=16, decode_output=384, n_long=12,
             overhead_tokens=64, overhead_runs=3, rate_requests=256, overload_s=60.0, overload_queue=128,
             simulator_s=25.0, calibration_repeats=5, cuda_tokens=128)
QUICK = Sizes(throughput_requests=80, weight_bound_requests=16, rounds=1, n_decodes=8, decode_output=96, n_long=4,
              overhead_tokens=12, overhead_runs=1, rate_requests=80, overload_s=10.0, overload_queue=32,
              simulator_s=4.0, calibration_repeats=2, cuda_tokens=32)
QUICK_CALIBRATION = (  # (new tokens, context) per sequence, as simulator.CALIBRATION_STEPS, fewer and smaller
    [(1, 0)], [(1, 100)] * 8, [(1, 50)] * 32, [(64, 0)], [(256, 0)], [(64, 128)] * 2, [(1, 100)] * 16 + [(128, 0)],
)


class Bench:
    """What the sections share: the model, the backend, the sizes, and the saturating rate once
    one section has measured it."""

    def __init__(self, sizes: Sizes, seed: int):
        self.sizes, self.seed = sizes, seed
        self.target = model.load("target")
        self.numba = backend.resolve("numba", "cpu")
        self.saturating_req_s: float | None = None
        self.saturating_source = ""
        Engine(self.target, EngineConfig(num_blocks=64), self.numba).generate(  # compile before any timing
            [b"def f(x):\n", b"import os\n" * 20], SamplingParams(max_tokens=4))

    def serve(self, config: EngineConfig, workload, chosen=None):
        engine = Engine(self.target, config, chosen or self.numba)
        served = engine.serve(workload)
        return engine, served, metrics.summarize(served, engine.log, config.max_batch)

    def saturating_rate(self) -> float:
        """Requests/s that continuous batching completes when every request waits from t = 0:
        from the throughput section if it ran, else from a short run of its own."""
        if self.saturating_req_s is None:
            workload = traffic.sharegpt_like(self.sizes.rate_requests, math.inf, self.seed + 1, MAX_LEN)
            _, served, _ = self.serve(CONFIGS["continuous"], workload)
            self.saturating_req_s = saturated_req_s(served)
            self.saturating_source = f"a run of {len(workload)} requests at t = 0, policy continuous"
        return self.saturating_req_s


CONFIGS = {  # the throughput section's policies, all with max_batch 64 and a pool for 64 worst cases
    "static": EngineConfig(policy="static", max_batch=MAX_BATCH, num_blocks=STATIC_BLOCKS),
    # a budget of max_batch + max_len: a whole prompt (up to 511 tokens) fits next to 64 decodes
    "continuous": EngineConfig(policy="continuous", max_batch=MAX_BATCH, token_budget=MAX_BATCH + MAX_LEN,
                               num_blocks=STATIC_BLOCKS),
    "chunked": EngineConfig(policy="chunked", max_batch=MAX_BATCH, token_budget=512, num_blocks=STATIC_BLOCKS),
    # not in the bar: the default budget of 512, where a prompt longer than 512 - running waits at
    # the head of the queue until enough requests finish, and every request behind it waits too
    "continuous_budget_512": EngineConfig(policy="continuous", max_batch=MAX_BATCH, token_budget=512,
                                          num_blocks=STATIC_BLOCKS),
}


def saturated_req_s(served) -> float:
    """Requests finished per second while requests still waited (from the first arrival to the
    last admission): the rate of a saturated engine, without the run's tail, when fewer than
    max_batch remain. Falls back to the whole run when too few finished before the last admission."""
    start = min(r.arrival_s for r in served)
    last_admitted = max(r.admitted_s for r in served)
    done = sum(r.finish_s is not None and r.finish_s <= last_admitted for r in served)
    if done >= 8 and last_admitted > start:
        return done / (last_admitted - start)
    return len(served) / (max(r.finish_s for r in served) - start)


def summary_figures(summary: metrics.Summary) -> dict:
    return {"throughput_tok_s": summary.throughput_tok_s, "seconds": summary.seconds, "steps": summary.steps,
            "slot_utilization": summary.slot_utilization, "ttft_s": summary.ttft_s, "tpot_s": summary.tpot_s,
            "preemptions": summary.preemptions, "forward_share": summary.forward_share,
            "n_finished": summary.n_finished, "n_rejected": summary.n_rejected}


def decode_step_ms_by_batch(log, width: int = 8) -> dict[str, dict]:
    """Median ms of the decode-only steps, by how many requests decode (in bins of `width`), and
    per token: a step whose cost is mostly fixed (a GPU's) gains from a full batch, one whose
    cost grows with the batch (a small model on a CPU) gains little."""
    bins = {}
    for record in log:
        if record.work and record.decode_tokens == record.n_tokens:
            low = (len(record.work) - 1) // width * width + 1
            bins.setdefault(low, []).append((record.seconds, len(record.work)))
    return {f"{low}-{low + width - 1}": {"steps": len(v), "step_ms": 1e3 * statistics.median(t for t, _ in v),
                                          "ms_per_token": 1e3 * statistics.median(t / n for t, n in v)}
            for low, v in sorted(bins.items())}


def ratio_figures(per_round: list[float]) -> dict:
    return {"median": statistics.median(per_round), "interval_95": median_interval(per_round),
            "per_round": per_round}


# ---- 1. throughput ---------------------------------------------------------------------------------

def throughput(bench: Bench, rounds: int) -> dict:
    """Static against continuous batching at saturation, in turns each round."""
    workload = traffic.sharegpt_like(bench.sizes.throughput_requests, math.inf, bench.seed, MAX_LEN)
    outputs = [r.max_tokens for r in workload]
    runs = {name: [] for name in CONFIGS}
    order = np.random.default_rng(bench.seed)
    for _ in range(rounds):
        for name in order.permutation(list(CONFIGS)):
            engine, served, summary = bench.serve(CONFIGS[name], workload)
            by_batch = decode_step_ms_by_batch(engine.log)
            runs[name].append(summary_figures(summary) | {"saturated_req_s": saturated_req_s(served),
                                                          "decode_step_ms_by_batch": by_batch})
    rates = {name: [r["throughput_tok_s"] for r in done] for name, done in runs.items()}
    ratios = {name: ratio_figures([p / s for p, s in zip(rates[name], rates["static"])])
              for name in ("continuous", "chunked", "continuous_budget_512")}
    bench.saturating_req_s = statistics.median(r["saturated_req_s"] for r in runs["continuous"])
    bench.saturating_source = "the throughput section's continuous runs"
    passed = ratios["continuous"]["median"] >= 2.5 and ratios["chunked"]["median"] >= 2.5
    ideal = roofline_ratio(bench, workload)
    return {
        "bar": "continuous and chunked >= 2.5x static's output tokens/s (max_batch 64, all requests at t = 0)",
        "passed": passed, "requests": len(workload), "rounds": rounds,
        "mean_prompt_tokens": float(np.mean([len(r.prompt) for r in workload])),
        "mean_output_tokens": float(np.mean(outputs)), "max_output_tokens": int(max(outputs)),
        "static_ceiling": traffic.static_ceiling(outputs, MAX_BATCH),
        "configs": {name: asdict(config) for name, config in CONFIGS.items()},
        "tokens_per_s": {name: statistics.median(r) for name, r in rates.items()},
        "slot_utilization": {name: statistics.median(r["slot_utilization"] for r in done)
                             for name, done in runs.items()},
        "over_static": ratios, "saturated_req_s": bench.saturating_req_s, "runs": runs,
        "roofline_ideal": ideal,
    }


def roofline_ratio(bench: Bench, workload) -> dict:
    """What separates the measured ratio from the ceiling: the same workload through the simulator
    at this CPU's ideal roofline (no overheads, every kernel at the roof). The ceiling assumes a
    step costs the same whatever its batch; the roofline says how much a decode step's K and V
    reads (one set per sequence) add to its weight reads (one set per step)."""
    cpu = hardware.measure("cpu", progress=False)
    ideal = simulator.StepTimeModel.on(bench.target.config, cpu, "fp32")
    rates = {}
    for name in ("static", "continuous"):
        engine = simulator.simulated_engine(ideal, CONFIGS[name])
        served = engine.serve(workload)
        rates[name] = metrics.summarize(served, engine.log, MAX_BATCH).throughput_tok_s
    config = bench.target.config
    weights = cost.step_cost(config, 1, 1, 0, "fp32").bytes - cost.kv_bytes_per_token(config, "fp32")
    context = float(np.mean([len(r.prompt) + r.max_tokens / 2 for r in workload]))
    kv = MAX_BATCH * context * cost.kv_bytes_per_token(config, "fp32")
    return {"continuous_over_static": rates["continuous"] / rates["static"], "tokens_per_s": rates,
            "weight_bytes": weights, "kv_bytes_at_full_batch": kv, "mean_context_tokens": context,
            "note": "the simulator at this CPU's measured roofline with no overheads; a decode step of "
                    f"{MAX_BATCH} sequences reads their K and V ({kv / 1e6:.1f} MB) besides the weights "
                    f"({weights / 1e6:.1f} MB), so its cost grows with the batch and a static batch's "
                    "lone last members cost little"}


# ---- 1b. a model whose decode step reads its weights ---------------------------------------------

WEIGHT_BOUND_MODEL = "smollm2-135m"
WEIGHT_BOUND_MAX_LEN = 256  # prompt + output: a token of its prefills costs 130x the target's, so shorter requests


def weight_bound_workload(n: int, seed: int, encode) -> list[traffic.TimedRequest]:
    """`n` ShareGPT-like requests at t = 0 of up to WEIGHT_BOUND_MAX_LEN tokens, their prompts in
    the pretrained model's own tokens (traffic.tokenized_prompts)."""
    shaped = traffic.sharegpt_like(n, math.inf, seed, WEIGHT_BOUND_MAX_LEN)
    prompts = traffic.tokenized_prompts([len(r.prompt) for r in shaped], encode, seed)
    return [traffic.TimedRequest(r.arrival_s, p, r.max_tokens) for r, p in zip(shaped, prompts)]


def weight_bound(bench: Bench, rounds: int) -> dict:
    """Static against continuous batching on the pretrained model, all requests at t = 0, in turns."""
    pretrained.pull(WEIGHT_BOUND_MODEL, quiet=True)
    served, tokenizer = pretrained.load(WEIGHT_BOUND_MODEL)
    config = served.config
    cpu = hardware.measure("cpu", progress=False)
    context = WEIGHT_BOUND_MAX_LEN // 3  # about the workload's mean context, prompt and half the output
    batch = roofline.weight_bound_batch(config, cpu, "fp32", context, MAX_BATCH)  # its step reads mostly weights
    critical = roofline.critical_batch(config, cpu, "fp32", context)
    blocks = batch * WEIGHT_BOUND_MAX_LEN // BLOCK  # a batch of worst cases fits
    configs = {"static": EngineConfig(policy="static", max_batch=batch, num_blocks=blocks),
               "continuous": EngineConfig(policy="continuous", max_batch=batch, num_blocks=blocks,
                                          token_budget=batch + WEIGHT_BOUND_MAX_LEN)}
    workload = weight_bound_workload(bench.sizes.weight_bound_requests, bench.seed, tokenizer.encode)
    outputs = [r.max_tokens for r in workload]
    Engine(served, configs["static"], bench.numba).generate([workload[0].prompt], SamplingParams(max_tokens=2))
    runs = {name: [] for name in configs}
    order = np.random.default_rng(bench.seed)
    for _ in range(rounds):
        for name in order.permutation(list(configs)):
            engine = Engine(served, configs[name], bench.numba)
            summary = metrics.summarize(engine.serve(workload), engine.log, batch)
            runs[name].append(summary_figures(summary) | {
                "decode_step_ms_by_batch": decode_step_ms_by_batch(engine.log, width=max(1, batch // 4))})
    rates = {name: [r["throughput_tok_s"] for r in done] for name, done in runs.items()}
    ratio = ratio_figures([c / s for c, s in zip(rates["continuous"], rates["static"])])
    ideal = simulator.StepTimeModel.on(config, cpu, "fp32")

    def ideal_rates(requests) -> dict[str, float]:  # the simulator at the roofline, no overheads
        rates = {}
        for name, engine_config in configs.items():
            engine = simulator.simulated_engine(ideal, engine_config)
            rates[name] = metrics.summarize(engine.serve(requests), engine.log, batch).throughput_tok_s
        return rates

    at_roof = ideal_rates(workload)
    longer = {}  # the same lengths' distribution over longer streams: the run's tail matters less
    for n in (4 * len(workload), 16 * len(workload)):
        stream = traffic.sharegpt_like(n, math.inf, bench.seed, WEIGHT_BOUND_MAX_LEN)
        long_rates = ideal_rates(stream)
        longer[str(n)] = {"continuous_over_static": long_rates["continuous"] / long_rates["static"],
                          "static_ceiling": traffic.static_ceiling([r.max_tokens for r in stream], batch)}
    weights = cost.step_cost(config, 1, 1, 0, "fp32").bytes - cost.kv_bytes_per_token(config, "fp32")
    mean_context = float(np.mean([len(r.prompt) + r.max_tokens / 2 for r in workload]))
    return {
        "bar": f"continuous >= 2.5x static's output tokens/s on {WEIGHT_BOUND_MODEL} (max_batch {batch}, all at t = 0)",
        "model": WEIGHT_BOUND_MODEL,
        "passed": ratio["median"] >= 2.5, "requests": len(workload), "rounds": rounds, "max_batch": batch,
        "critical_batch": critical, "cpu_flops_fp32": cpu.flops("fp32"), "cpu_bandwidth": cpu.memory_bandwidth,
        "mean_prompt_tokens": float(np.mean([len(r.prompt) for r in workload])),
        "mean_output_tokens": float(np.mean(outputs)), "static_ceiling": traffic.static_ceiling(outputs, batch),
        "weight_bytes": weights, "mean_context_tokens": mean_context,
        "kv_bytes_at_full_batch": batch * mean_context * cost.kv_bytes_per_token(config, "fp32"),
        "configs": {name: asdict(config) for name, config in configs.items()},
        "tokens_per_s": {name: statistics.median(r) for name, r in rates.items()},
        "slot_utilization": {name: statistics.median(r["slot_utilization"] for r in done)
                             for name, done in runs.items()},
        "over_static": ratio, "runs": runs,
        "roofline_ideal": {"tokens_per_s": at_roof,
                           "continuous_over_static": at_roof["continuous"] / at_roof["static"],
                           "longer_streams": longer},
    }


# ---- 2. chunked prefill ---------------------------------------------------------------------------

def decode_step_s(bench: Bench, n_decodes: int, steps: int = 48) -> float:
    """Seconds of a fast step of `n_decodes` decodes (the first quartile, so that a busy moment
    does not stretch it), from a short run of them alone at short context."""
    prompts = traffic.stdlib_prompts([32] * n_decodes, bench.seed + 2)
    engine, _, _ = bench.serve(EngineConfig(policy="continuous", max_batch=n_decodes, num_blocks=1024),
                               [traffic.TimedRequest(0.0, p, steps) for p in prompts])
    seconds = [s.seconds for s in engine.log if s.decode_tokens == n_decodes == s.n_tokens]
    return float(np.percentile(seconds, 25))


def chunked(bench: Bench, rounds: int) -> dict:
    """Long prompts among decodes, with and without chunked prefill, in turns each round."""
    s = bench.sizes
    step_s = decode_step_s(bench, s.n_decodes)
    decoding_s = s.decode_output * step_s  # at least how long the decodes run: their context grows, steps slow
    long_output = s.n_decodes + 16  # so a long prompt (max_len - long_output) fits 512 next to every decode
    first_s, period_s = 0.1 * decoding_s, 0.5 * decoding_s / s.n_long  # all in the first 60% of that
    workload = traffic.long_prompts_among_decodes(s.n_decodes, 32, s.decode_output, s.n_long, long_output,
                                                  first_s, period_s, bench.seed, MAX_LEN)
    configs = {"continuous": EngineConfig(policy="continuous", max_batch=MAX_BATCH, token_budget=512, num_blocks=1024),
               "chunked": EngineConfig(policy="chunked", max_batch=MAX_BATCH, token_budget=128, chunk_size=64,
                                       num_blocks=1024)}
    runs = {name: [] for name in configs}
    for round_ in range(rounds):
        for name in list(configs)[:: 1 if round_ % 2 else -1]:
            _, served, summary = bench.serve(configs[name], workload)
            decodes_end = max(r.finish_s for r in served[: s.n_decodes])
            among = sum(r.arrival_s < decodes_end for r in served[s.n_decodes:])
            runs[name].append(summary_figures(summary) | {"long_prompts_among_decodes": among})
    among_all = all(r["long_prompts_among_decodes"] == s.n_long for done in runs.values() for r in done)
    p99 = {name: [r["tpot_s"]["p99"] for r in done] for name, done in runs.items()}
    rates = {name: [r["throughput_tok_s"] for r in done] for name, done in runs.items()}
    p99_ratio = ratio_figures([c / w for c, w in zip(p99["chunked"], p99["continuous"])])
    rate_ratio = ratio_figures([c / w for c, w in zip(rates["chunked"], rates["continuous"])])
    return {
        "bar": "p99 TPOT with chunking <= 0.5x without, throughput >= 0.9x",
        "passed": p99_ratio["median"] <= 0.5 and rate_ratio["median"] >= 0.9 and among_all,
        "every_long_prompt_arrived_among_decodes": among_all,
        "workload": {"n_decodes": s.n_decodes, "decode_prompt": 32, "decode_output": s.decode_output,
                     "n_long": s.n_long, "long_prompt": MAX_LEN - long_output, "long_output": long_output,
                     "decode_step_s": step_s, "first_long_s": first_s, "period_s": period_s},
        "configs": {name: asdict(config) for name, config in configs.items()}, "rounds": rounds,
        "tpot_p99_s": {name: statistics.median(v) for name, v in p99.items()},
        "tokens_per_s": {name: statistics.median(v) for name, v in rates.items()},
        "p99_chunked_over_continuous": p99_ratio, "throughput_chunked_over_continuous": rate_ratio, "runs": runs,
    }


# ---- 3. overhead --------------------------------------------------------------------------------------

def decode_steps_at(engine: Engine, batch: int) -> list[int]:
    return [i for i, s in enumerate(engine.log) if len(s.work) == batch == s.decode_tokens == s.n_tokens]


def timed_parts(engine: Engine) -> list[dict]:
    """Wrap the engine's parts with timers; returns a list that gets, for each logged step, the
    seconds in each part and in the whole step."""
    per_step, current = [], {}
    runner, pool = engine.runner, engine.runner.pool

    def timer(name, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - started
        return timed

    engine.scheduler.schedule = timer("schedule", engine.scheduler.schedule)
    pool.reserve_all = timer("reserve", pool.reserve_all)
    pool.step_metadata = timer("metadata", pool.step_metadata)
    runner._forward = timer("forward", runner._forward)
    runner._sample = timer("sample", runner._sample)
    pool.commit = timer("commit", pool.commit)
    step = engine.step

    def timed_step():
        current.clear()
        logged, started = len(engine.log), time.perf_counter()
        outputs = step()
        if len(engine.log) > logged:
            per_step.append(dict(current, step=time.perf_counter() - started))
        return outputs

    engine.step = timed_step
    return per_step


def overhead(bench: Bench) -> dict:
    """Share of a batch-64 decode step outside the model's forward, from the engine's log; then
    the split, from timers around each part, and a cProfile of one run."""
    s = bench.sizes
    prompts = traffic.stdlib_prompts([128] * MAX_BATCH, bench.seed + 3)
    config = EngineConfig(policy="continuous", max_batch=MAX_BATCH, token_budget=MAX_BATCH * 128,  # all in one step
                          num_blocks=MAX_BATCH * -(-(128 + s.overhead_tokens) // BLOCK) + MAX_BATCH)
    params = SamplingParams(max_tokens=s.overhead_tokens)
    shares, step_s = [], []
    for _ in range(s.overhead_runs):
        engine = Engine(bench.target, config, bench.numba)
        engine.generate(prompts, params)
        for i in decode_steps_at(engine, MAX_BATCH):
            record = engine.log[i]
            shares.append(1 - record.forward_s / record.seconds)
            step_s.append(record.seconds)
    engine = Engine(bench.target, config, bench.numba)
    per_step = timed_parts(engine)
    engine.generate(prompts, params)
    chosen = [per_step[i] for i in decode_steps_at(engine, MAX_BATCH)]
    parts = ("schedule", "reserve", "metadata", "forward", "sample", "commit")
    split = {name: statistics.median(p.get(name, 0.0) for p in chosen) for name in parts}
    split["rest"] = statistics.median(p["step"] - sum(p.get(name, 0.0) for name in parts) for p in chosen)
    step_median = statistics.median(p["step"] for p in chosen)
    profiler = cProfile.Profile()
    engine = Engine(bench.target, config, bench.numba)
    profiler.runcall(engine.generate, prompts, params)
    stats = pstats.Stats(profiler)
    by_own_time = sorted(stats.stats.items(), key=lambda item: -item[1][2])
    outside_model = [item for item in by_own_time if not any(f"{os.sep}{part}{os.sep}" in item[0][0]
                                                              for part in ("model", "kernels"))]

    def listed(items):
        return [{"function": f"{Path(f).name}:{line}({name})", "calls": calls, "own_s": own, "cumulative_s": total}
                for (f, line, name), (_, calls, own, total, _) in items[:15]]

    share = statistics.median(shares)
    return {
        "bar": "at a batch of 64 decodes, 1 - forward_s / step seconds <= 10% (median over steps)",
        "passed": share <= 0.10, "overhead_share": share, "overhead_share_95": median_interval(shares),
        "steps": len(shares), "step_ms": 1e3 * statistics.median(step_s), "prompt_tokens": 128,
        "generated_tokens": s.overhead_tokens, "config": asdict(config),
        "split_ms": {name: 1e3 * seconds for name, seconds in split.items()},
        "split_share": {name: seconds / step_median for name, seconds in split.items()},
        "split_note": "medians per part over the batch-64 decode steps of a timed run; 'rest' is the engine's "
                      "step outside the timed parts (plan checks, next_tokens, building the log record)",
        "profile_top_own_time": listed(by_own_time), "profile_top_outside_model": listed(outside_model),
        "profile_total_s": stats.total_tt, "profile_note": "cProfile of a whole generate() of the 64 requests, "
                                                          "prefill steps included; outside_model leaves out "
                                                          "infra_lab/model and infra_lab/kernels",
    }


# ---- 4. overload --------------------------------------------------------------------------------------

class Stuck(Exception):
    pass


@contextmanager
def watchdog(seconds: float):
    """Raise Stuck in the main thread if the block runs longer than `seconds` (a deadlock)."""
    def expire(signum, frame):
        raise Stuck(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, math.ceil(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


OVERLOAD_BLOCKS, OVERLOAD_HOST_BLOCKS = 320, 640  # 5,120 tokens: about a third of what 64 requests hold


def overload(bench: Bench) -> dict:
    s = bench.sizes
    rate = bench.saturating_rate()
    offered = 3 * rate
    workload = traffic.sharegpt_like(max(1, math.ceil(offered * s.overload_s)), offered, bench.seed + 4, MAX_LEN)
    results = {}
    for preemption in ("recompute", "swap"):
        config = EngineConfig(policy="chunked", max_batch=MAX_BATCH, token_budget=512, num_blocks=OVERLOAD_BLOCKS,
                              max_waiting=s.overload_queue, preemption=preemption,
                              host_blocks=OVERLOAD_HOST_BLOCKS if preemption == "swap" else 0)
        engine = Engine(bench.target, config, bench.numba)
        started, error = time.perf_counter(), None
        try:
            with watchdog(5 * s.overload_s + 600):  # far longer than any drain: only a hang reaches it
                engine.serve(workload)
        except Exception as failure:  # a crash or a hang fails the bar; the other sections still run
            error = f"{type(failure).__name__}: {failure}"
        wall_s = time.perf_counter() - started
        requests = list(engine.requests.values())
        states = {state.value: sum(r.state is state for r in requests) for state in RequestState}
        rejected = {r.request_id for r in requests
                    if r.state is RequestState.ABORTED and (r.finish_reason or "").startswith("rejected")}
        unaccounted = [r.request_id for r in requests if not (
            r.state is RequestState.FINISHED and r.finish_reason in ("length", "stop") or r.request_id in rejected)]
        host = engine.blocks.host
        checks = {
            "ended_without_error": error is None,
            "every_request_added": len(requests) == len(workload),
            "every_request_finished_or_rejected_with_reason": not unaccounted,
            "pool_empty": engine.blocks.pool.num_free == config.num_blocks,
            "host_pool_empty": host is None or (host.num_free == config.host_blocks and not engine.blocks.swapped),
            "queues_empty": not engine.scheduler.has_work,
        }
        finished = [r for r in requests if r.state is RequestState.FINISHED]
        summary = metrics.summarize(finished, engine.log, MAX_BATCH) if finished else None
        exercised = {"preemption": any(r.preempted for r in engine.log), "queue_cap": bool(rejected)}
        results[preemption] = {
            "passed": all(checks.values()) and all(exercised.values()), "checks": checks, "exercised": exercised,
            "error": error, "wall_s": wall_s,
            "requests": len(workload), "states": states, "rejected": len(rejected),
            "unaccounted_ids": unaccounted[:20], "preemptions": sum(len(r.preempted) for r in engine.log),
            "swapped_out": sum(len(r.swapped_out) for r in engine.log),
            "swapped_in": sum(len(r.swapped_in) for r in engine.log),
            "max_waiting_seen": max((r.waiting for r in engine.log), default=0),
            "free_blocks_min": min((r.free_blocks for r in engine.log), default=config.num_blocks),
            "config": asdict(config), "summary": summary_figures(summary) if summary else None,
        }
    return {
        "bar": "3x the saturating rate with a queue cap and a small pool: the run ends, every request finishes or is "
               "rejected with a reason, pool and host pool empty afterwards (and the run did preempt and reject)",
        "passed": all(r["passed"] for r in results.values()),
        "saturating_req_s": rate, "saturating_source": bench.saturating_source, "offered_req_s": offered,
        "arrivals_s": s.overload_s, "runs": results,
    }


# ---- 5. simulator ------------------------------------------------------------------------------------

def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def simulator_section(bench: Bench, quick: bool) -> dict:
    s = bench.sizes
    steps = QUICK_CALIBRATION if quick else simulator.CALIBRATION_STEPS
    started = time.perf_counter()
    samples = simulator.time_steps(bench.target, bench.numba, steps, s.calibration_repeats)
    calibration_s = time.perf_counter() - started
    cpu = hardware.measure("cpu", progress=False)
    fitted = simulator.StepTimeModel.on(bench.target.config, cpu, "fp32").fit(samples)
    fit_errors = [relative_error(fitted.seconds(seqs), seconds) for seqs, seconds in samples]
    rate = bench.saturating_rate()
    config = EngineConfig(policy="chunked", max_batch=MAX_BATCH, token_budget=512, num_blocks=STATIC_BLOCKS)
    loads = {}
    for k, share in enumerate((0.3, 0.6, 0.9)):
        workload = traffic.sharegpt_like(max(8, round(share * rate * s.simulator_s)), share * rate,
                                         bench.seed + 10 + k, MAX_LEN)
        real_engine, _, real = bench.serve(config, workload)
        predicted_s = [fitted.seconds(seqs) for seqs in steplog.step_sequences(real_engine.log)]
        real_s = [r.seconds for r in real_engine.log]
        step_errors = [relative_error(p, r) for p, r in zip(predicted_s, real_s)]
        engine = simulator.simulated_engine(fitted, config)
        predicted = metrics.summarize(engine.serve(workload), engine.log, MAX_BATCH)
        errors = {"throughput": relative_error(predicted.throughput_tok_s, real.throughput_tok_s),
                  "tpot_p50": relative_error(predicted.tpot_s["p50"], real.tpot_s["p50"])}
        loads[f"{share:.0%}"] = {
            "rate_req_s": share * rate, "requests": len(workload), "relative_error": errors,
            "real_steps_predicted": {"relative_error_median": statistics.median(step_errors),
                                     "predicted_over_real_total": sum(predicted_s) / sum(real_s),
                                     "note": "the fitted model applied to each step the real engine ran"},
            "passed": max(errors.values()) <= 0.25,
            "real": {"throughput_tok_s": real.throughput_tok_s, "tpot_p50_s": real.tpot_s["p50"],
                     "ttft_p50_s": real.ttft_s["p50"], "steps": real.steps},
            "simulated": {"throughput_tok_s": predicted.throughput_tok_s, "tpot_p50_s": predicted.tpot_s["p50"],
                          "ttft_p50_s": predicted.ttft_s["p50"], "steps": predicted.steps},
        }
    return {
        "bar": "simulated throughput and median TPOT within 25% of the real engine's at 30%, 60%, 90% of saturation",
        "passed": all(load["passed"] for load in loads.values()),
        "fitted": {"step_s": fitted.step_s, "sequence_s": fitted.sequence_s, "efficiency": fitted.efficiency,
                   "calibration_steps": len(samples), "calibration_s": calibration_s,
                   "fit_relative_error_median": statistics.median(fit_errors),
                   "fit_relative_error_max": max(fit_errors)},
        "device": {"name": cpu.name, "peak_flops_fp32": cpu.flops("fp32"), "memory_bandwidth": cpu.memory_bandwidth},
        "saturating_req_s": rate, "saturating_source": bench.saturating_source, "config": asdict(config),
        "loads": loads,
    }


# ---- 6. exact ----------------------------------------------------------------------------------------

EXACT_LENGTHS, EXACT_TOKENS = (20, 75, 140, 230, 9, 48), (16, 9, 24, 12, 30, 5)


def exact_configs() -> dict[str, EngineConfig]:
    """Every policy with max_batch 4 for 6 requests (so requests join and leave), and, outside
    the bar, pools of 16 blocks (the longest request's worth) that make the engine preempt, by
    recompute or by swap."""
    tight = dict(max_batch=6, num_blocks=16)
    return {
        "static": EngineConfig(policy="static", max_batch=4, num_blocks=64),
        "dynamic": EngineConfig(policy="dynamic", max_batch=4, num_blocks=64, max_len=320),
        "continuous": EngineConfig(policy="continuous", max_batch=4, token_budget=256, num_blocks=64),
        "chunked": EngineConfig(policy="chunked", max_batch=4, token_budget=48, chunk_size=32, num_blocks=64),
        "continuous, preempt by recompute": EngineConfig(policy="continuous", token_budget=256, **tight),
        "chunked, preempt by recompute": EngineConfig(policy="chunked", token_budget=64, chunk_size=32, **tight),
        "chunked, preempt by swap": EngineConfig(policy="chunked", token_budget=64, chunk_size=32,
                                                 preemption="swap", host_blocks=64, **tight),
    }


def exact(bench: Bench) -> dict:
    prompts = traffic.stdlib_prompts(list(EXACT_LENGTHS), bench.seed + 5)
    params = [SamplingParams(max_tokens=n) for n in EXACT_TOKENS]
    combos, preemptions = {}, {}
    names = [n for n in ("numba", "torch") if n in backend.available()]
    alone_by_backend = {}
    for name in names:
        chosen = backend.resolve(name, "cpu")
        alone = [generate(bench.target, p, n, temperature=0.0, backend=chosen).new_tokens
                 for p, n in zip(prompts, EXACT_TOKENS)]
        alone_by_backend[name] = alone
        for label, config in exact_configs().items():
            engine = Engine(bench.target, config, chosen)
            combos[f"{label} / {name}"] = engine.generate(prompts, params) == alone
            preemptions[f"{label} / {name}"] = sum(len(s.preempted) for s in engine.log)
    in_bar = [key for key in combos if "preempt" not in key.split(" / ")[0]]
    return {
        "bar": "greedy tokens through the engine equal each request run alone, every policy, numba and torch (CPU)",
        "passed": all(combos[key] for key in in_bar) and len(names) == 2, "backends": names,
        "requests": len(prompts), "prompt_tokens": list(EXACT_LENGTHS), "max_tokens": list(EXACT_TOKENS),
        "equal": combos, "preemptions": preemptions,
        "numba_alone_equals_torch_alone": len(names) == 2 and alone_by_backend["numba"] == alone_by_backend["torch"],
    }


# ---- 7. cuda ------------------------------------------------------------------------------------------

def cuda(bench: Bench) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed", "passed": None}
    if not torch.cuda.is_available():
        return {"skipped": "no GPU", "passed": None}
    gpu = backend.resolve("torch", "cuda")
    tokens, prompt_tokens = bench.sizes.cuda_tokens, 64
    Engine(bench.target, EngineConfig(num_blocks=64), gpu).generate([b"def f(x):\n"], SamplingParams(max_tokens=4))
    figures = {"device": torch.cuda.get_device_name(0), "prompt_tokens": prompt_tokens, "generated_tokens": tokens}
    for batch in (1, 64, 256):
        prompts = traffic.stdlib_prompts([prompt_tokens] * batch, bench.seed + 6)
        config = EngineConfig(policy="chunked", max_batch=batch, token_budget=batch * (prompt_tokens + 1),  # one step
                              num_blocks=batch * -(-(prompt_tokens + tokens) // BLOCK) + batch)
        engine = Engine(bench.target, config, gpu)
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens))
        seconds = time.perf_counter() - started
        steps = decode_steps_at(engine, batch)
        decode_s = sum(engine.log[i].seconds for i in steps)
        figures[f"batch_{batch}"] = {"decode_tokens_per_s": batch * len(steps) / decode_s if steps else None,
                                     "run_tokens_per_s": batch * tokens / seconds, "decode_steps": len(steps),
                                     "forward_share": sum(engine.log[i].forward_s for i in steps) / decode_s
                                     if steps else None}
    return figures | {"passed": None, "bar": "none: figures only"}


# ---- the run ---------------------------------------------------------------------------------------

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
SECTIONS = ("throughput", "weight_bound", "chunked", "overhead", "overload", "simulator", "exact", "cuda")


def headline(name: str, figures: dict) -> str:
    """One line of the closing table: the section's main figure against its bar."""
    if "skipped" in figures:
        return f"skipped ({figures['skipped']})"
    if name == "throughput":
        over = figures["over_static"]
        slots = figures["slot_utilization"]
        return (f"continuous {over['continuous']['median']:.2f}x, chunked {over['chunked']['median']:.2f}x static "
                f"(ceiling {figures['static_ceiling']:.2f}x; continuous at budget 512: "
                f"{over['continuous_budget_512']['median']:.2f}x); slots {slots['static']:.0%} static, "
                f"{slots['continuous']:.0%} continuous")
    if name == "weight_bound":
        return (f"continuous {figures['over_static']['median']:.2f}x static at max_batch {figures['max_batch']} "
                f"(ceiling {figures['static_ceiling']:.2f}x, "
                f"roofline {figures['roofline_ideal']['continuous_over_static']:.2f}x)")
    if name == "chunked":
        p99 = figures["tpot_p99_s"]
        return (f"p99 TPOT {1e3 * p99['chunked']:.1f} vs {1e3 * p99['continuous']:.1f} ms "
                f"({figures['p99_chunked_over_continuous']['median']:.2f}x), throughput "
                f"{figures['throughput_chunked_over_continuous']['median']:.2f}x")
    if name == "overhead":
        return f"{figures['overhead_share']:.1%} of a {figures['step_ms']:.1f} ms step outside the forward"
    if name == "overload":
        return "; ".join(f"{mode}: {run['states']['finished']} finished, {run['rejected']} rejected, "
                         f"{run['preemptions']} preemptions" + (f", {run['error']}" if run["error"] else "")
                         for mode, run in figures["runs"].items())
    if name == "simulator":
        return ", ".join(f"{load}: throughput off {v['relative_error']['throughput']:.0%}, "
                         f"TPOT p50 off {v['relative_error']['tpot_p50']:.0%}" for load, v in figures["loads"].items())
    if name == "exact":
        failed = [k for k, v in figures["equal"].items() if not v]
        equal = f"{sum(figures['equal'].values())}/{len(figures['equal'])} equal"
        return equal + (f"; differ: {failed}" if failed else "")
    if name == "cuda":
        return ", ".join(f"{k}: {v['decode_tokens_per_s'] or float('nan'):.0f} decode tokens/s"
                         for k, v in figures.items() if k.startswith("batch"))
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test (under 2 minutes)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run this section (repeatable)")
    parser.add_argument("--rounds", type=int, help="rounds of the throughput, weight_bound and chunked sections")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blas-threads", type=int, help="limit numpy's BLAS to this many threads (default: as is); "
                        "the model's matmuls are small, and its threads can fight numba's on a busy machine")
    parser.add_argument("--json", help=f"write the figures here (default without --quick: {RESULTS})")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = sizes.rounds if args.rounds is None else args.rounds
    if rounds < 1:
        parser.error(f"--rounds must be at least 1; got {rounds}")
    chosen = [name for name in SECTIONS if name in (args.only or SECTIONS)]
    out = Path(args.json) if args.json else (None if args.quick else RESULTS)
    if args.blas_threads is not None:
        if args.blas_threads < 1:
            parser.error(f"--blas-threads must be at least 1; got {args.blas_threads}")
        from threadpoolctl import threadpool_limits

        blas_limit = threadpool_limits(limits=args.blas_threads, user_api="blas")  # noqa: F841  held for the run
    print(backend.describe(), flush=True)
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    bench = Bench(sizes, args.seed)
    runs = {"throughput": lambda: throughput(bench, rounds), "weight_bound": lambda: weight_bound(bench, rounds),
            "chunked": lambda: chunked(bench, rounds),
            "overhead": lambda: overhead(bench), "overload": lambda: overload(bench),
            "simulator": lambda: simulator_section(bench, args.quick), "exact": lambda: exact(bench),
            "cuda": lambda: cuda(bench)}
    sections = {}
    for name in chosen:
        started = time.perf_counter()
        sections[name] = runs[name]() | {"section_s": time.perf_counter() - started}
        print(f"{name} ({sections[name]['section_s']:.0f} s): {headline(name, sections[name])}", flush=True)
    figures = {
        "machine": backend.machine(),
        "measured_on": datetime.date.today().isoformat(),
        "command": "python " + " ".join(["benchmarks/serving.py"] + sys.argv[1:]),
        "backend": backend.describe(), "quick": args.quick, "seed": args.seed, "sizes": asdict(sizes),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "thread_settings": {name: os.environ.get(name) for name in THREAD_VARIABLES} | {
            "blas_threads_flag": args.blas_threads},
        "seconds": time.perf_counter() - began, "sections": sections,
    }
    if out is not None:
        if args.only and out.is_file():  # keep the sections this run did not measure, from the earlier run
            earlier = json.loads(out.read_text())
            kept = {name: s for name, s in earlier.get("sections", {}).items() if name not in sections}
            figures["sections"] = {name: (sections | kept)[name] for name in SECTIONS if name in sections | kept}
            origin = earlier.get("kept_from_earlier", {})  # a section kept twice names the run that measured it
            figures["kept_from_earlier"] = {name: origin.get(name) or earlier.get("command") for name in kept}
            # where and when each kept section ran: this run's machine and date may be others
            figures["kept_runs"] = {name: earlier.get("kept_runs", {}).get(name) or
                                    {"machine": earlier["machine"], "measured_on": earlier["measured_on"],
                                     "command": figures["kept_from_earlier"][name]} for name in kept}
        figures["bars_passed"] = {name: s.get("passed") for name, s in figures["sections"].items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"\n{'section':<11} {'bar':<6} figures")
    for name, section in sections.items():
        passed = {True: "pass", False: "FAIL", None: "-"}[section.get("passed")]
        print(f"{name:<11} {passed:<6} {headline(name, section)}")
    print(f"({figures['seconds']:.0f} s in all; load average {load_before:.1f} before, "
          f"{figures['load_average_1min']['after']:.1f} after)")


if __name__ == "__main__":
    main()
