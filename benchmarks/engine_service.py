"""The engine as a service (serving.engine_loop), on the real model (the shipped target) with the
numba backend on the CPU. Sections:

- loop_overhead: 64 requests at once (prompts of 32 tokens from the validation text, 64 greedy
  tokens each), served by stepping the engine directly (Engine.generate) and through the loop
  (EngineLoop.submit from one thread, then every handle's result), each round on the same
  engine and the same loop, as a service runs; output tokens/s of each.
  The loop must lose at most 5% of the direct throughput: the median of the rounds' own
  ratios (loop over direct), with a 95% interval for that median. Both give the same tokens.
- weight_updates: 32 requests stream through the loop (48 tokens each, half sampled) while the
  caller updates the weights 20 times (two weight sets in turn, in_flight "continue"). For each
  update: the time to check and lay out the weights (the caller's thread), the swap in the
  loop's thread, and the pause it put between two steps (the gap between the step before and the
  step after, beside the median gap between other steps). The pause must stay under 10 ms.
- n_samples: one 256-token prompt, 8 samples of 32 sampled tokens: as one request with n = 8
  (the prompt computed once, its blocks shared) and as 8 requests (8 prefills, 8 copies). Blocks
  in use after the first decode, and output tokens/s, the median of rounds.
- logprobs: the loop_overhead batch directly, with and without logprobs=5 (the chosen token's
  log-probability and 5 rivals for every token): tokens/s of each, the median of rounds.
- move: a request of 510 tokens exported (K and V to host arrays) and imported into another
  engine, against a plain copy of the same bytes (numpy): bytes (= 2 x layers x KV heads x head
  size x tokens x 4) and GB/s of each, the best of rounds.

Each round runs the two in a new order, so the machine's drift falls on both.

    python benchmarks/engine_service.py [--quick] [--rounds N] [--json PATH]

Without --quick the figures go to benchmarks/results/engine_service.json; --quick (small sizes,
under a minute) writes nothing unless --json is given.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from infra_lab import model
from infra_lab.model import corpus
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.engine_loop import EngineLoop
from infra_lab.serving.request import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "engine_service.json"
SECTIONS = ("loop_overhead", "weight_updates", "n_samples", "logprobs", "move")
FULL = {"requests": 64, "prompt": 32, "new_tokens": 64, "rounds": 21, "updates": 20, "streams": 32,
        "stream_tokens": 48, "samples": 8, "sample_prompt": 256, "sample_tokens": 32, "move_tokens": 510}
QUICK = {"requests": 16, "prompt": 16, "new_tokens": 8, "rounds": 3, "updates": 4, "streams": 8,
         "stream_tokens": 16, "samples": 4, "sample_prompt": 64, "sample_tokens": 8, "move_tokens": 63}
LOSS_BAR = 0.05  # the loop may cost at most 5% of the direct throughput
PAUSE_BAR_S = 0.010  # a weight update may pause the engine at most 10 ms between two steps


def loop_overhead(sizes: dict, rounds: int) -> dict:
    target = model.load("target")
    _, validation = corpus.load()
    n, length = sizes["requests"], sizes["prompt"]
    prompts = [validation[i * 1000: i * 1000 + length].astype(np.int64).tolist() for i in range(n)]
    params = SamplingParams(max_tokens=sizes["new_tokens"])
    config = EngineConfig(policy="continuous", max_batch=n, token_budget=max(512, n * length),
                          num_blocks=n * -(-(length + sizes["new_tokens"]) // 16) + 8, block_size=16)

    # a service's loop lives long: one engine each, one loop, over every round (a thread that
    # is new each round would pay for starting itself and its numba thread team every time)
    engine, loop = Engine(target, config), EngineLoop(Engine(target, config), max_waiting=n)

    def direct():
        return engine.generate(prompts, params)

    def through_loop():
        handles = [loop.submit(p, params) for p in prompts]
        return [h.result(600) for h in handles]

    runs = {"direct": direct, "loop": through_loop}
    try:
        assert direct() == through_loop(), "the loop changed the tokens"  # and both are warm
        seconds = {name: [] for name in runs}
        rng = np.random.default_rng(0)
        for _ in range(rounds):
            for name in rng.permutation(list(runs)):
                started = time.perf_counter()
                runs[name]()
                seconds[name].append(time.perf_counter() - started)
    finally:
        loop.shutdown()
    tokens = n * sizes["new_tokens"]
    ratios = [d / l for d, l in zip(seconds["direct"], seconds["loop"])]  # loop throughput / direct
    ratio = statistics.median(ratios)
    low, high = median_interval(ratios)
    return {"tokens_per_s": {name: tokens / statistics.median(s) for name, s in seconds.items()},
            "loop_over_direct": ratio, "loop_over_direct_95": [low, high], "rounds": rounds,
            "bar": f"loop throughput >= {1 - LOSS_BAR:.2f}x direct", "passed": ratio >= 1 - LOSS_BAR}


def weight_updates(sizes: dict) -> dict:
    target = model.load("target")
    served = model.Transformer(target.config, target.w)
    rng = np.random.default_rng(1)
    moved = {name: (w + 0.3 * w.std() * rng.standard_normal(w.shape)).astype(np.float32)
             for name, w in target.w.items()}
    states = [dict(target.w), moved]
    n, new = sizes["streams"], sizes["stream_tokens"]
    config = EngineConfig(policy="chunked", max_batch=n, num_blocks=n * -(-(40 + new) // 16) + 8, block_size=16)
    prepare_s = []
    with EngineLoop(Engine(served, config)) as loop:
        handles = [loop.submit(rng.integers(32, 127, int(rng.integers(8, 40))).tolist(),
                               SamplingParams(temperature=0.8 * (k % 2), seed=k, max_tokens=new)) for k in range(n)]
        for version in range(1, sizes["updates"] + 1):
            started = time.perf_counter()
            prepared = served.prepare_weights(states[version % 2], version)
            prepare_s.append(time.perf_counter() - started)
            loop._between_steps("weights", prepared, "continue")
            time.sleep(0.02)  # a few steps between updates
        for handle in handles:
            handle.result(600)
        log, swaps = loop.engine.log, list(loop.weight_swaps)
    assert all(h.finish_reason == "length" for h in handles), "a request failed under the updates"
    ends, starts = np.array([r.end_s for r in log]), np.array([r.start_s for r in log])
    gaps = starts[1:] - ends[:-1]  # (steps - 1,) idle time between consecutive steps
    paused = []
    for began, _ in swaps:
        after = int(np.searchsorted(starts, began))  # the first step that starts after the swap
        if 0 < after < len(starts):
            paused.append(float(starts[after] - ends[after - 1]))
    others = np.delete(gaps, [int(np.searchsorted(starts, b)) - 1 for b, _ in swaps
                              if 0 < np.searchsorted(starts, b) < len(starts)])
    worst = max(paused)
    return {"updates": len(swaps), "prepare_ms_median": 1e3 * statistics.median(prepare_s),
            "swap_ms_median": 1e3 * statistics.median(s for _, s in swaps),
            "swap_ms_max": 1e3 * max(s for _, s in swaps),
            "pause_ms_median": 1e3 * statistics.median(paused), "pause_ms_max": 1e3 * worst,
            "other_gaps_ms_median": 1e3 * float(np.median(others)), "steps": len(log),
            "bar": f"pause <= {1e3 * PAUSE_BAR_S:.0f} ms", "passed": worst <= PAUSE_BAR_S}


def n_samples(sizes: dict, rounds: int) -> dict:
    target = model.load("target")
    _, validation = corpus.load()
    prompt = validation[:sizes["sample_prompt"]].astype(np.int64).tolist()
    k, new = sizes["samples"], sizes["sample_tokens"]
    config = EngineConfig(policy="chunked", max_batch=k, token_budget=max(512, k * len(prompt)),
                          num_blocks=k * -(-(len(prompt) + new) // 16) + 8, block_size=16)
    engine = Engine(target, config)
    shared = SamplingParams(temperature=0.8, seed=3, max_tokens=new, n=k)
    apart = [shared.for_sample(i) for i in range(k)]

    def as_n():
        rid = engine.add_request(prompt, shared)
        engine.step(), engine.step()
        used = config.num_blocks - engine.blocks.pool.num_free
        while engine.has_unfinished:
            engine.step()
        return [r.output for r in engine.group(rid)], used

    def as_requests():
        ids = [engine.add_request(prompt, p) for p in apart]
        engine.step(), engine.step()
        used = config.num_blocks - engine.blocks.pool.num_free
        while engine.has_unfinished:
            engine.step()
        return [engine.requests[i].output for i in ids], used

    (tokens_n, blocks_n), (tokens_apart, blocks_apart) = as_n(), as_requests()
    assert tokens_n == tokens_apart, "n samples drew other tokens than their seeds alone"
    seconds = {"n": [], "requests": []}
    for _ in range(rounds):
        for name, run in (("n", as_n), ("requests", as_requests)):
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    rate = {name: k * new / statistics.median(s) for name, s in seconds.items()}
    return {"blocks_after_first_decode": {"n": blocks_n, "requests": blocks_apart},
            "prompt_blocks": -(-len(prompt) // 16), "tokens_per_s": rate, "speedup": rate["n"] / rate["requests"],
            "rounds": rounds}


def logprobs_cost(sizes: dict, rounds: int) -> dict:
    target = model.load("target")
    _, validation = corpus.load()
    n, length = sizes["requests"], sizes["prompt"]
    prompts = [validation[i * 1000: i * 1000 + length].astype(np.int64).tolist() for i in range(n)]
    config = EngineConfig(policy="continuous", max_batch=n, token_budget=max(512, n * length),
                          num_blocks=n * -(-(length + sizes["new_tokens"]) // 16) + 8, block_size=16)
    engine = Engine(target, config)
    plain, listed = SamplingParams(max_tokens=sizes["new_tokens"]), SamplingParams(max_tokens=sizes["new_tokens"],
                                                                                  logprobs=5)
    assert engine.generate(prompts, plain) == engine.generate(prompts, listed)
    seconds = {"without": [], "with_5": []}
    for _ in range(rounds):
        for name, params in (("without", plain), ("with_5", listed)):
            started = time.perf_counter()
            engine.generate(prompts, params)
            seconds[name].append(time.perf_counter() - started)
    rate = {name: n * sizes["new_tokens"] / statistics.median(s) for name, s in seconds.items()}
    return {"tokens_per_s": rate, "with_over_without": rate["with_5"] / rate["without"], "rounds": rounds}


def move(sizes: dict, rounds: int) -> dict:
    target = model.load("target")
    _, validation = corpus.load()
    length = sizes["move_tokens"]
    config = EngineConfig(policy="chunked", num_blocks=-(-(length + 2) // 16) + 4, block_size=16)
    source, sink = Engine(target, config), Engine(target, config)
    prompt = validation[:length].astype(np.int64).tolist()
    rid = source.add_request(prompt, SamplingParams(max_tokens=2))
    source.step()
    pool, seq = source.blocks.pool, source.requests[rid].seq
    c = target.config
    expected = 2 * c.n_layers * c.n_kv_heads * c.head_dim * length * 4
    export_s, import_s, copy_s = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        kv = pool.export_sequence(seq)
        export_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        moved = sink.blocks.pool.import_sequence(kv)
        import_s.append(time.perf_counter() - started)
        sink.blocks.pool.free(moved)
        target_array = np.empty_like(kv.data)
        started = time.perf_counter()
        np.copyto(target_array, kv.data)
        copy_s.append(time.perf_counter() - started)
    assert kv.nbytes == expected, (kv.nbytes, expected)
    gbps = lambda s: kv.nbytes / min(s) / 1e9  # noqa: E731
    return {"tokens": length, "bytes": kv.nbytes, "bytes_formula": "2 x layers x KV heads x head dim x tokens x 4",
            "export_GBps": gbps(export_s), "import_GBps": gbps(import_s), "memory_copy_GBps": gbps(copy_s),
            "export_over_copy": min(copy_s) / min(export_s), "import_over_copy": min(copy_s) / min(import_s),
            "rounds": rounds}


def headline(name: str, figures: dict) -> str:
    if name == "weight_updates":
        f = figures
        return (f"{f['updates']} updates: prepare {f['prepare_ms_median']:.2f} ms (caller), "
                f"swap {f['swap_ms_median']:.3f} ms median; pause between steps median {f['pause_ms_median']:.2f} ms, max {f['pause_ms_max']:.2f} ms "
                f"(other gaps {f['other_gaps_ms_median']:.3f} ms) ({f['bar']}: {'met' if f['passed'] else 'missed'})")
    if name == "n_samples":
        b = figures["blocks_after_first_decode"]
        return (f"blocks {b['n']} as n vs {b['requests']} as requests; "
                f"{figures['tokens_per_s']['n']:,.0f} vs {figures['tokens_per_s']['requests']:,.0f} tokens/s "
                f"({figures['speedup']:.2f}x)")
    if name == "logprobs":
        rates = figures["tokens_per_s"]
        return (f"{rates['without']:,.0f} tokens/s without, {rates['with_5']:,.0f} with 5 log-probabilities "
                f"({figures['with_over_without']:.3f}x)")
    if name == "move":
        return (f"{figures['bytes']:,} bytes: export {figures['export_GBps']:.2f} GB/s, import "
                f"{figures['import_GBps']:.2f} GB/s, memory copy {figures['memory_copy_GBps']:.2f} GB/s")
    rates = ", ".join(f"{k} {v:,.0f} tokens/s" for k, v in figures["tokens_per_s"].items())
    low, high = figures["loop_over_direct_95"]
    return (f"{rates}; loop / direct {figures['loop_over_direct']:.3f}x, 95% interval {low:.3f}-{high:.3f} "
            f"({figures['bar']}: {'met' if figures['passed'] else 'missed'})")


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    run_sections("benchmarks/engine_service.py", SECTIONS,
                 {"loop_overhead": lambda _: loop_overhead(sizes, rounds),
                  "weight_updates": lambda _: weight_updates(sizes),
                  "n_samples": lambda _: n_samples(sizes, rounds),
                  "logprobs": lambda _: logprobs_cost(sizes, rounds),
                  "move": lambda _: move(sizes, 5 * rounds)},
                 args, headline, RESULTS, {"quick": args.quick, "sizes": sizes})


if __name__ == "__main__":
    main()
