"""Chapter 04's speed bar: match_prefix plus insert over 100,000 requests of about 500 tokens
(a few-shot mix: one of 50 shared 300-token prefixes, then a 200-token unique tail), with the
tree kept under 2 million tokens by LRU eviction. Must take at most 10 s on the book's 2-core
machine.

    python benchmarks/radix.py [--requests N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from infra_lab.kv.radix import RadixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prefixes = rng.integers(0, 50_000, size=(50, 300))
    choice = rng.integers(0, 50, size=args.requests)
    tails = rng.integers(0, 50_000, size=(args.requests, 200))
    cache = RadixCache()
    hits, next_slot = 0, 0
    started = time.perf_counter()
    for i in range(args.requests):
        tokens = np.concatenate([prefixes[choice[i]], tails[i]])  # (500,)
        matched, _, node = cache.match_prefix(tokens)
        hits += matched
        slots = np.arange(next_slot, next_slot + len(tokens))
        next_slot += len(tokens)
        cache.insert(tokens, slots)
        if cache.total_size > 2_000_000:
            cache.evict(cache.total_size - 1_500_000)
    seconds = time.perf_counter() - started
    figures = {"requests": args.requests, "seconds": seconds, "us_per_request": seconds / args.requests * 1e6,
               "hit_rate": hits / (args.requests * 500), "cached_tokens": cache.total_size}
    print(f"{args.requests:,} requests of 500 tokens: match_prefix + insert in {seconds:.2f} s "
          f"({figures['us_per_request']:.0f} us each); hit rate {figures['hit_rate']:.1%}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
