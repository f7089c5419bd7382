"""Issue 14's bars for the engine core, in one run of the real model (the shipped target):

- decode: 32 sequences at 256 tokens of context, one batched step from the paged pool (blocks of
  16), the same batch from contiguous caches (a pool of one 512-token block per sequence), and
  the sequences decoded one at a time; tokens/s of each, and the two ratios;
- chunked prefill: a 480-token prompt in chunks of 64 against one whole prefill;
- extend attention against its float64 reference over random prefixes, chunks, block sizes and
  GQA groups (max relative error, float32);
- greedy tokens from every KV layout and backend here, compared.

The variants are timed in turns within each round, in a new order each round, so that the
machine's drift falls on all of them; each rate is the median over rounds, and each ratio the
median of the rounds' own ratios. After each timed decode
step every sequence is truncated back to 256 tokens, so every step sees the same context.
On a CUDA GPU it also checks the torch path's greedy tokens against numba's and times decode at
batch 1 and 64.

    python benchmarks/engine_core.py [--rounds 15] [--json benchmarks/results/engine_core.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time

import numpy as np

from infra_lab import backend, model
from infra_lab.kernels import extend_attention
from infra_lab.kv.radix import RadixCache
from infra_lab.model import corpus
from infra_lab.model.generate import generate_many
from infra_lab.serving import radix_serving

BATCH, CONTEXT, STEPS = 32, 256, 4  # decode: sequences, tokens of context, steps per timing
PROMPT, CHUNK = 480, 64  # chunked prefill


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """An interval that holds the median with at least `confidence`, from order statistics
    alone (no assumption about the noise's shape): the k-th smallest and k-th largest value,
    with k the largest rank for which a fair coin gives at most (1 - confidence) / 2 odds."""
    ordered, n = sorted(values), len(values)
    k = 0
    while k + 1 <= n // 2 and sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n <= (1 - confidence) / 2:
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else (ordered[0], ordered[-1])


def write_sections(out, script: str, order: tuple[str, ...], sections: dict, extra: dict, only: bool,
                   began: float, load_before: float) -> None:
    """Write a sectioned benchmark's figures to `out` (JSON): the machine, date and command, the
    run's `extra` settings, the load before and after, and each section in `order`. A run of some
    sections only (`only`) keeps the others from the file, naming the command, machine and date
    that measured them (`kept_from_earlier`, `kept_runs`)."""
    import os
    import sys
    from pathlib import Path

    figures = {"machine": backend.machine(),
               "measured_on": datetime.date.today().isoformat(),
               "command": "python " + " ".join([script] + sys.argv[1:]),
               "backend": backend.describe(), **extra,
               "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
               "seconds": time.perf_counter() - began, "sections": dict(sections)}
    out = Path(out)
    if only and out.is_file():  # keep the sections this run did not measure
        earlier = json.loads(out.read_text())
        kept = {k: v for k, v in earlier.get("sections", {}).items() if k not in sections}
        figures["sections"] = {k: (sections | kept)[k] for k in order if k in sections | kept}
        figures["kept_from_earlier"] = {k: earlier.get("kept_from_earlier", {}).get(k) or earlier.get("command")
                                        for k in kept}
        # where and when each kept section ran: this run's machine may be another
        figures["kept_runs"] = {k: earlier.get("kept_runs", {}).get(k) or
                                {"machine": earlier["machine"], "measured_on": earlier["measured_on"],
                                 "command": figures["kept_from_earlier"][k]} for k in kept}
    figures["bars_passed"] = {k: v.get("passed") for k, v in figures["sections"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1, default=float) + "\n")


def section_parser(doc: str, sections: tuple[str, ...], results) -> argparse.ArgumentParser:
    """The options every sectioned benchmark takes: --quick, --only SECTION (repeatable),
    --rounds, --seed and --json; a benchmark adds its own before parsing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    parser.add_argument("--only", action="append", choices=sections, help="run this section (repeatable)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help=f"write the figures here (default without --quick: {results})")
    return parser


def run_sections(script: str, order: tuple[str, ...], runs: dict, args, headline, results, extra: dict) -> dict:
    """A sectioned benchmark's run: each section `args.only` names (all of `order` without it),
    run as runs[name](sections so far), its headline printed, and the figures written after
    every section (to args.json, or to `results` unless args.quick), so that a long run that
    stops keeps what it measured."""
    import os
    from pathlib import Path

    out = Path(args.json) if args.json else (None if args.quick else Path(results))
    print(backend.describe(), flush=True)
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    sections: dict = {}
    for name in [s for s in order if s in (args.only or order)]:
        started = time.perf_counter()
        sections[name] = runs[name](sections) | {"section_s": time.perf_counter() - started}
        print(f"{name} ({sections[name]['section_s']:.0f} s): {headline(name, sections[name])}", flush=True)
        if out is not None:
            write_sections(out, script, order, sections, extra, bool(args.only), began, load_before)
    print(f"({time.perf_counter() - began:.0f} s in all)")
    return sections


def median_seconds(run, rounds_out: list[float]):
    started = time.perf_counter()
    run()
    rounds_out.append(time.perf_counter() - started)


def decode_figures(target, prompts: list[list[int]], rounds: int, chosen) -> dict:
    """Tokens/s of batched decode from the paged pool, from contiguous caches, and one at a time."""
    paged = target.new_paged_cache(BATCH * (CONTEXT + STEPS) // 16 + BATCH, 16, backend=chosen)
    contiguous = target.new_paged_cache(BATCH, target.config.context, backend=chosen)
    alone = [target.new_cache(backend=chosen) for _ in prompts]
    views = {}
    for name, pool in (("paged", paged), ("contiguous", contiguous)):
        views[name] = [pool.view(pool.new_sequence()) for _ in prompts]
        for view, prompt in zip(views[name], prompts):
            target.forward(prompt, view, chosen)
    for cache, prompt in zip(alone, prompts):
        target.forward(prompt, cache, chosen)
    next_tokens = np.array([p[-1] for p in prompts])

    def batched(name):
        def run():
            for _ in range(STEPS):
                target.decode_batch(next_tokens, views[name], chosen)
        return run

    def one_at_a_time():
        for _ in range(STEPS):
            for cache, token in zip(alone, next_tokens):
                target.forward([token], cache, chosen)

    def rewind():
        for view in views["paged"] + views["contiguous"] + alone:
            view.cache.truncate(view.seq, CONTEXT)

    runs = {"paged": batched("paged"), "contiguous": batched("contiguous"), "one_at_a_time": one_at_a_time}
    for run in runs.values():  # warm up: compile, caches
        run()
        rewind()
    seconds = {name: [] for name in runs}
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for name in order.permutation(list(runs)):  # a new order each round: no variant always goes first
            median_seconds(runs[name], seconds[name])
            rewind()
    tokens_per_s = {name: BATCH * STEPS / statistics.median(times) for name, times in seconds.items()}
    ratios = {peer: [p / q for p, q in zip(seconds[peer], seconds["paged"])]  # per round, side by side
              for peer in ("contiguous", "one_at_a_time")}
    return {"batch": BATCH, "context_tokens": CONTEXT, "steps_per_timing": STEPS, "tokens_per_s": tokens_per_s,
            "paged_over_contiguous": statistics.median(ratios["contiguous"]),
            "paged_over_contiguous_95": median_interval(ratios["contiguous"]),
            "paged_over_one_at_a_time": statistics.median(ratios["one_at_a_time"]),
            "paged_over_one_at_a_time_95": median_interval(ratios["one_at_a_time"]),
            "seconds_per_round": seconds}


def chunked_prefill_figures(target, prompt: list[int], rounds: int, chosen) -> dict:
    """Seconds to prefill `prompt` whole and in chunks of CHUNK, each into a fresh cache."""
    def whole():
        target.forward(prompt, target.new_cache(backend=chosen), chosen)

    def chunked():
        cache = target.new_cache(backend=chosen)
        for start in range(0, len(prompt), CHUNK):
            target.forward(prompt[start:start + CHUNK], cache, chosen)

    for run in (whole, chunked):
        run()
    seconds = {"whole": [], "chunked": []}
    for round_ in range(rounds):
        for run in (whole, chunked) if round_ % 2 else (chunked, whole):
            median_seconds(run, seconds[run.__name__])
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    ratios = [c / w for c, w in zip(seconds["chunked"], seconds["whole"])]
    return {"prompt_tokens": len(prompt), "chunk_tokens": CHUNK, "median_seconds": medians,
            "chunked_over_whole": statistics.median(ratios), "chunked_over_whole_95": median_interval(ratios),
            "seconds_per_round": seconds}


def extend_errors(cases: int = 200, seed: int = 0) -> dict:
    """Max relative error of the numba and torch faces against the float64 reference."""
    rng = np.random.default_rng(seed)
    worst = {"numba": 0.0, "torch": 0.0}
    for _ in range(cases):
        batch = int(rng.integers(1, 5))
        query_lens, prefix_lens = rng.integers(1, 150, batch), rng.integers(0, 300, batch)
        n_kv, group = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
        d, block_size = int(rng.choice([16, 32, 64])), int(rng.choice([1, 3, 16, 512]))
        context = prefix_lens + query_lens
        per_seq = -(-context // block_size)
        pool = rng.standard_normal((int(per_seq.sum()), 2, block_size, n_kv, d)).astype(np.float32)
        order = rng.permutation(len(pool))
        tables = np.full((batch, per_seq.max()), -1, np.int64)
        for b, first in enumerate(np.concatenate([[0], np.cumsum(per_seq)[:-1]])):
            tables[b, : per_seq[b]] = order[first:first + per_seq[b]]
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        q = rng.standard_normal((starts[-1], n_kv * group, d)).astype(np.float32)
        args = (q, pool[:, 0], pool[:, 1], tables, starts, context)
        reference = extend_attention.extend_attention_numpy(*args)
        for face in worst:
            got = np.asarray(extend_attention.FACES[face](*args), np.float64)
            worst[face] = max(worst[face], float(np.abs(got - reference).max() / np.abs(reference).max()))
    return {"cases": cases, "max_relative_error": worst}


def same_tokens(target, prompts: list[bytes], new_tokens: int = 32) -> dict:
    """Greedy tokens from each layout and backend here, against contiguous caches on numba."""
    reference = generate_many(target, prompts, new_tokens, backend=backend.resolve("numba"))
    agree = {}
    for name in [n for n in ("numba", "torch", "numpy") if n in backend.available()]:
        chosen = backend.resolve(name, "cpu")
        for block_size in (None, 1, 16):
            pool = None if block_size is None else target.new_paged_cache(1200 // block_size + 8, block_size,
                                                                        backend=chosen)
            label = f"{name}/{'contiguous' if block_size is None else f'paged {block_size}'}"
            agree[label] = generate_many(target, prompts, new_tokens, paged=pool, backend=chosen) == reference
        served = radix_serving.serve_model(target, prompts + prompts[:2], new_tokens, 1200, cache=RadixCache(),
                                           backend=chosen)
        agree[f"{name}/radix token pool"] = served.outputs == reference + reference[:2]
    return agree


def gpu_figures(target, prompts: list[list[int]], rounds: int) -> dict:
    """On CUDA: greedy tokens against numba's, and decode tokens/s at batch 1 and 64."""
    import torch

    cuda = backend.resolve("torch", "cuda")
    texts = [bytes(p[:200]) for p in prompts[:8]]
    reference = generate_many(target, texts, 32, backend=backend.resolve("numba"))
    pool = target.new_paged_cache(8 * 240 // 16 + 8, 16, backend=cuda)
    figures = {"device": torch.cuda.get_device_name(0),
               "greedy_tokens_equal_numba": generate_many(target, texts, 32, paged=pool, backend=cuda) == reference}
    for batch in (1, 64):
        pool = target.new_paged_cache(batch * (CONTEXT + STEPS) // 16 + batch, 16, backend=cuda)
        views = [pool.view(pool.new_sequence()) for _ in range(batch)]
        for b, view in enumerate(views):
            target.forward(prompts[b % len(prompts)], view, cuda)
        tokens = np.array([prompts[b % len(prompts)][-1] for b in range(batch)])
        times = []
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(STEPS):
                target.decode_batch(tokens, views, cuda)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            for view in views:
                pool.truncate(view.seq, CONTEXT)
        figures[f"decode_tokens_per_s_batch_{batch}"] = batch * STEPS / statistics.median(times[1:])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per figure (default 15)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    print(backend.describe())
    target = model.load("target")
    _, validation = corpus.load()
    prompts = [validation[i * 1000: i * 1000 + CONTEXT].astype(np.int64).tolist() for i in range(BATCH)]
    numba_cpu = backend.resolve("numba")
    figures = {
        "machine": backend.machine(),
        "measured_on": datetime.date.today().isoformat(),
        "command": "python benchmarks/engine_core.py" + (f" --rounds {args.rounds}" if args.rounds != 15 else ""),
        "backend": backend.describe(),
        "decode": decode_figures(target, prompts, args.rounds, numba_cpu),
        "chunked_prefill": chunked_prefill_figures(target, validation[:PROMPT].astype(np.int64).tolist(),
                                                   args.rounds, numba_cpu),
        "extend_attention": extend_errors(),
        "same_greedy_tokens": same_tokens(target, [bytes(p[:120]) for p in prompts[:4]]),
    }
    if "cuda" in backend.available().get("torch", ()):
        figures["gpu"] = gpu_figures(target, prompts, args.rounds)
    decode, prefill = figures["decode"], figures["chunked_prefill"]
    print(f"decode, {BATCH} sequences at {CONTEXT} tokens: " + ", ".join(
        f"{name} {rate:,.0f} tokens/s" for name, rate in decode["tokens_per_s"].items()))
    low, high = decode["paged_over_contiguous_95"]
    print(f"  paged / contiguous {decode['paged_over_contiguous']:.2f}x, 95% interval {low:.2f}-{high:.2f} "
          f"(bar >= 1), paged / one at a time {decode['paged_over_one_at_a_time']:.1f}x (bar >= 3)")
    low, high = prefill["chunked_over_whole_95"]
    print(f"prefill of {PROMPT} tokens in chunks of {CHUNK}: {prefill['chunked_over_whole']:.2f}x the whole "
          f"prefill, 95% interval {low:.2f}-{high:.2f} (bar <= 1.3)")
    print(f"extend attention, max relative error: {figures['extend_attention']['max_relative_error']} (bar 1e-5)")
    print("same greedy tokens:", all(figures["same_greedy_tokens"].values()), figures["same_greedy_tokens"])
    if "gpu" in figures:
        print("gpu:", figures["gpu"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
