"""The engine as a service (serving.engine_loop), on the real model (the shipped target) with the
numba backend on the CPU. Sections:

- loop_overhead: 64 requests at once (prompts of 32 tokens from the validation text, 64 greedy
  tokens each), served by stepping the engine directly (Engine.generate) and through the loop
  (EngineLoop.submit from one thread, then every handle's result), each round on the same
  engine and the same loop, as a service runs; output tokens/s of each.
  The loop must lose at most 5% of the direct throughput: the median of the rounds' own
  ratios (loop over direct), with a 95% interval for that median. Both give the same tokens.

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
SECTIONS = ("loop_overhead",)
FULL = {"requests": 64, "prompt": 32, "new_tokens": 64, "rounds": 21}
QUICK = {"requests": 16, "prompt": 16, "new_tokens": 8, "rounds": 3}
LOSS_BAR = 0.05  # the loop may cost at most 5% of the direct throughput


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


def headline(name: str, figures: dict) -> str:
    rates = ", ".join(f"{k} {v:,.0f} tokens/s" for k, v in figures["tokens_per_s"].items())
    low, high = figures["loop_over_direct_95"]
    return (f"{rates}; loop / direct {figures['loop_over_direct']:.3f}x, 95% interval {low:.3f}-{high:.3f} "
            f"({figures['bar']}: {'met' if figures['passed'] else 'missed'})")


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    run_sections("benchmarks/engine_service.py", SECTIONS, {"loop_overhead": lambda _: loop_overhead(sizes, rounds)},
                 args, headline, RESULTS, {"quick": args.quick, "sizes": sizes})


if __name__ == "__main__":
    main()
