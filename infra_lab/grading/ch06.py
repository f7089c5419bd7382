"""Checks for chapter 06's exercises: TPOT and ITL from what a streaming client saw, a token
bucket, the cache-aware routing decision, and a routing policy of one's own that runs inside the
real router in front of real servers.

The references call the package: `orchestration.bench_metrics` (RequestTrace and compute),
`orchestration.tenants.TokenBucket` itself on a fake clock, and `orchestration.policies.CacheAware`
with its state built from the case. The last check judges a policy by what it achieves, not move
by move, since a sound policy may break ties its own way: on streams of prompts that share a few
long openings, sent one after another, every request must be served, the share of prompt tokens
found in a worker's cache must be at least HIT_GAIN times round robin's on the same stream, and no
worker may take more than MAX_SHARE of the requests (one worker for everything would hit the
most). Most cases run the policy in a made-up cluster whose workers' caches are prefix trees of
the prompts they were sent; the last ones run it in `router.create_app` over two real
`infra-lab serve` workers with the radix cache, started once and kept for the check's cases (the
reference's served cases are its verdict alone: tests/test_ch06_checks.py serves the package's
policy as a candidate, so a grader starts servers only for a policy that can choose). Every
case is drawn from plain numbers, so a failure line shows them.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import math
from concurrent.futures import ThreadPoolExecutor

from infra_lab.grading.ch07 import Schedule
from infra_lab.grading.checks import Check, register
from infra_lab.orchestration import bench_metrics, tenants
from infra_lab.orchestration.policies import CacheAware, Policy, RoundRobin, Worker
from infra_lab.orchestration.prefix_tree import PrefixTree

HIT_GAIN = 1.3  # a policy's prefix hit rate must be at least this times round robin's
MAX_SHARE = 0.75  # the most of a stream's requests that one worker may take
SERVED_MAX_TOKENS = 2  # output tokens per request on the real servers: the prompts are what is cached
SERVE_ARGS = ["--model", "target", "--prefix-cache", "radix", "--block-size", "1", "--num-blocks", "65536"]


class WrongRouting(AssertionError):
    """A policy's routing breaks what the exercise asks (the failure line says how)."""


# ---- exercise 1: TPOT and ITL ---------------------------------------------------------------------

def _traces(requests) -> list[bench_metrics.RequestTrace]:
    return [bench_metrics.RequestTrace(float(send_s), tuple(t for t, _ in chunks),
                                       completion_tokens=int(sum(n for _, n in chunks)))
            for send_s, chunks in requests]


def tpot_and_itl(requests):
    """Reference: (mean TPOT over the requests with two output tokens or more, 0 if none; every
    gap between consecutive chunks, request by request), in seconds, from `bench_metrics`."""
    traces = _traces(requests)
    mean_tpot_s = bench_metrics.compute(traces, 1.0)["mean_tpot_ms"] / 1000.0
    return mean_tpot_s, [gap for trace in traces for gap in trace.itls_s]


def drive_metrics(function, requests):
    result = function([(send_s, [tuple(c) for c in chunks]) for send_s, chunks in requests])
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(f"tpot_and_itl must return (mean_tpot_s, itls_s); got {result!r:.100}")
    mean_tpot_s, itls_s = result
    return ("mean TPOT (s)", float(mean_tpot_s)), ("ITLs (s)", [float(gap) for gap in itls_s])


def _chunks(rng, what: str, send_s: float) -> list[tuple[float, int]]:
    """One request's chunks: (arrival time, tokens) pairs, times in whole ms."""
    n_chunks = 1 if what in ("one chunk", "one token") else int(rng.integers(2, 9))
    gaps_ms = rng.integers(1, 120, size=n_chunks)
    gaps_ms[0] += int(rng.integers(20, 600))  # queueing and prefill before the first chunk
    times = send_s + gaps_ms.cumsum() / 1000.0
    if what in ("one token per chunk", "one token"):
        tokens = [1] * n_chunks
    elif what == "one chunk":  # every token in one chunk: TPOT 0, no ITL
        tokens = [int(rng.integers(2, 6))]
    else:  # several tokens per chunk (a server's stream interval, or speculative decoding)
        tokens = [int(n) for n in rng.integers(1, 6, size=n_chunks)]
    return [(round(float(t), 3), k) for t, k in zip(times, tokens)]


def _metrics_case(kind, rng):
    n = 1 if kind.startswith("one request") else int(rng.integers(2, 6))
    requests = []
    for _ in range(n):
        send_s = round(float(rng.uniform(0, 3)), 3)
        if kind.startswith("one request, "):
            what = kind.split(", ")[1]
        elif kind == "no request has two tokens":
            what = "one token"
        elif kind == "one token per chunk":
            what = "one token per chunk"
        else:  # mixed: lengths differ, some requests stream several tokens per chunk
            what = str(rng.choice(["one token per chunk", "several per chunk", "several per chunk", "one chunk",
                                   "one token"]))
        requests.append((send_s, _chunks(rng, what, send_s)))
    return (requests,)


_METRICS_KINDS = (["mixed", "one token per chunk", "mixed", "one request, several per chunk", "mixed",
                   "one request, one chunk", "mixed", "no request has two tokens", "mixed", "one request, one token",
                   "mixed", "one token per chunk"] * 2)


# ---- exercise 2: the token bucket -------------------------------------------------------------------

def drive_bucket(bucket_class, rate_per_s, burst, start_s, steps):
    """A bucket made at `start_s` on a fake clock; each step moves the clock on by `advance_s`
    and takes `cost`. The wait each take returned, step by step."""
    now = [float(start_s)]
    bucket = bucket_class(rate_per_s, burst, lambda: now[0])
    log = []
    for i, (advance_s, cost) in enumerate(steps):
        now[0] += advance_s
        wait_s = bucket.take(cost)
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool):
            raise TypeError(f"take must return the seconds to wait, a number; got {wait_s!r:.60}")
        log.append((f"step {i}: +{advance_s} s, take({cost})", float(wait_s)))
    return log


def _bucket_case(kind, rng):
    """Rates are powers of two and times eighths of a second: every level and wait is exact, so
    a take that the reference grants at once is never a hair away in another order of sums. A
    "the wait" step moves the clock by the wait the reference's last take returned."""
    rate = float(rng.choice([0.5, 1.0, 2.0, 4.0, 8.0]))
    burst = int(rng.integers(1, 13))
    start_s = int(rng.integers(0, 8000)) / 8
    now = [start_s]
    reference = tenants.TokenBucket(rate, burst, lambda: now[0])
    steps, last_wait = [], 0.0
    moves = ["none", "some", "some", "the wait", "long idle"]
    for _ in range(int(rng.integers(6, 15))):
        move = str(rng.choice(moves if kind != "a burst at once" else ["none", "none", "none", "some"]))
        advance = {"none": 0.0, "some": int(rng.integers(1, 17)) / 8, "the wait": last_wait,
                   "long idle": burst / rate + int(rng.integers(1, 9))}[move]
        cost = int(rng.integers(0, burst + 1))
        if kind == "costs above the burst" and rng.random() < 0.4:
            cost = burst + int(rng.integers(1, 6))
        steps.append((advance, cost))
        now[0] += advance
        last_wait = reference.take(cost) or last_wait
    return rate, burst, start_s, steps


_BUCKET_KINDS = ["random", "a burst at once", "costs above the burst", "random"] * 6


# ---- exercise 3: the cache-aware decision -------------------------------------------------------------

OPENINGS = ("import os\n", "import sys\n", "def main():\n", "class Node:\n", "from typing import ")


def cache_aware_choice(prompt, routed, outstanding, cache_threshold, balance_abs_threshold,
                       balance_rel_threshold):
    """Reference: the index of the worker that `CacheAware` with these thresholds chooses, its
    trees built from the prompts `routed` to each worker before."""
    policy = CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold)
    workers = [Worker(f"http://worker-{i}", int(n)) for i, n in enumerate(outstanding)]
    for worker, prompts in zip(workers, routed):
        for text in prompts:
            policy.routed(text, worker)
    return workers.index(policy.choose(prompt, workers))


def drive_choice(function, prompt, routed, outstanding, cache_threshold, balance_abs_threshold,
                 balance_rel_threshold):
    index = function(prompt, [list(p) for p in routed], list(outstanding), cache_threshold, balance_abs_threshold,
                     balance_rel_threshold)
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"cache_aware_choice must return a worker's index, an int; got {index!r:.60}")
    return index


def _prompt(rng, openings=OPENINGS) -> str:
    tail = "".join(rng.choice(list("abcd"), size=int(rng.integers(0, 7))))
    return str(rng.choice(openings)) + tail


def _choice_case(kind, rng):
    n_workers = int(rng.integers(2, 5))
    openings = OPENINGS[: int(rng.integers(2, len(OPENINGS) + 1))]
    routed = [[_prompt(rng, openings) for _ in range(int(rng.integers(0, 4)))] for _ in range(n_workers)]
    cache_threshold = int(rng.integers(1, 8)) / 8
    abs_threshold = int(rng.integers(0, 6))
    rel_threshold = int(rng.integers(8, 21)) / 8
    outstanding = [int(n) for n in rng.integers(0, 4, size=n_workers)]
    prompt = _prompt(rng, openings)
    if kind == "imbalanced":  # the busiest beyond both thresholds: the least loaded wins, cache or not
        least = int(rng.integers(0, 3))
        outstanding = [least + int(rng.integers(0, 2)) for _ in range(n_workers)]
        outstanding[int(rng.integers(n_workers))] = max(least + abs_threshold + 1,
                                                        math.floor(rel_threshold * least) + 1)
        outstanding[int(rng.integers(n_workers))] = least
    elif kind == "beyond one threshold only":  # more than abs beyond, not rel times: balanced still
        least = int(rng.integers(4, 8))
        rel_threshold, abs_threshold = 2.0, int(rng.integers(0, 3))
        outstanding = [least + int(rng.integers(0, abs_threshold + 2)) for _ in range(n_workers)]
    elif kind == "a match on two workers":  # the same prompt sent to two: fewer in flight wins
        shared = _prompt(rng, openings)
        first, second = rng.choice(n_workers, size=2, replace=False)
        routed[first].append(shared)
        routed[second].append(shared)
        prompt = shared + "".join(rng.choice(list("xy"), size=int(rng.integers(0, 3))))
        outstanding = [int(n) for n in rng.integers(0, 2, size=n_workers)]
    elif kind == "a new prefix":  # nothing matches enough: the smallest tree
        prompt = "while True:\n" + "".join(rng.choice(list("ab"), size=int(rng.integers(0, 4))))
    elif kind == "nothing routed yet":
        routed = [[] for _ in range(n_workers)]
    elif kind == "an empty prompt":
        prompt = ""
    return prompt, routed, outstanding, cache_threshold, abs_threshold, rel_threshold


_CHOICE_KINDS = (["random", "imbalanced", "a match on two workers", "a new prefix", "random",
                  "beyond one threshold only", "random", "nothing routed yet", "imbalanced", "random",
                  "a match on two workers", "an empty prompt"] * 2)


# ---- exercise 4: your policy in the router ------------------------------------------------------------

def _stream(n, n_prefixes, state) -> list[str]:
    """Chapter 05's shared-prefix prompts: real Python openings, each plus a `def` line."""
    from infra_lab.serving import radix_serving

    return [p.decode("utf-8", errors="ignore") for p in
            radix_serving.shared_prefix_prompts(n, n_prefixes, 320, state)]


def _policy(policy_class) -> Policy:
    if not (isinstance(policy_class, type) and issubclass(policy_class, Policy)):
        raise TypeError(f"expected a subclass of infra_lab.orchestration.policies.Policy; got {policy_class!r:.80}")
    return policy_class()


def simulate(policy: Policy, prompts: list[str], n_workers: int) -> tuple[float, list[int]]:
    """Route `prompts` one after another over `n_workers` made-up workers, calling the hooks as
    the router does; each worker caches what it was sent (a PrefixTree). (hit rate, requests
    per worker)."""
    workers = [Worker(f"http://worker-{i}") for i in range(n_workers)]
    caches = [PrefixTree() for _ in workers]
    hits = total = 0
    counts = [0] * n_workers
    for prompt in prompts:
        chosen = policy.choose(prompt, list(workers))
        index = next((i for i, w in enumerate(workers) if w is chosen), None)
        if index is None:
            raise WrongRouting(f"choose returned {chosen!r:.80}, which is not one of the Worker objects it was given")
        hits, total = hits + caches[index].match(prompt), total + len(prompt)
        caches[index].insert(prompt)
        counts[index] += 1
        chosen.outstanding += 1
        policy.routed(prompt, chosen)
        chosen.outstanding -= 1
        policy.finished(prompt, chosen, True)
    return hits / total, counts


_JUDGED = (f"hit rate at least {HIT_GAIN}x round robin's", f"no worker above {MAX_SHARE:.0%} of the requests")


def _judge(where: str, hit_rate: float, round_robin: float, counts: list[int]) -> tuple:
    if hit_rate < HIT_GAIN * round_robin:
        raise WrongRouting(f"{where}: prefix hit rate {hit_rate:.3f}, round robin's {round_robin:.3f}; it must be at "
                           f"least {HIT_GAIN} times round robin's ({HIT_GAIN * round_robin:.3f}): does a prompt go "
                           "back to the worker that was sent its prefix?")
    if max(counts) > MAX_SHARE * sum(counts):
        raise WrongRouting(f"{where}: requests per worker {counts}; no worker may take more than {MAX_SHARE:.0%} of "
                           "them: does a new prefix go to a worker that holds little?")
    return _JUDGED


class _Recording(Policy):
    """The policy under test, counting where the router sent each request."""

    def __init__(self, inner: Policy):
        self.inner, self.counts = inner, {}

    def choose(self, prompt_text, workers):
        return self.inner.choose(prompt_text, workers)

    def routed(self, prompt_text, worker):
        self.counts[worker.url] = self.counts.get(worker.url, 0) + 1
        self.inner.routed(prompt_text, worker)

    def finished(self, prompt_text, worker, ok):
        self.inner.finished(prompt_text, worker, ok)

    def removed(self, worker):
        self.inner.removed(worker)


class _Fleet:
    """Two `infra-lab serve` workers with the radix cache, started once for the check's cases.
    Each run's prompts start with a tag of their own, so no run finds another's prefixes."""

    def __init__(self):
        from infra_lab.orchestration import launch

        with ThreadPoolExecutor(2) as pool:
            self.workers = list(pool.map(lambda _: launch.start("serve", SERVE_ARGS, threads=1), range(2)))
        self._runs = itertools.count()
        atexit.register(self.stop)

    def tag(self) -> str:
        k = next(self._runs)
        return chr(33 + k % 94) + chr(33 + (k // 94) % 94) + "\n"  # a first character unused for 94 runs

    def serve(self, policy: Policy, prompts: list[str]) -> tuple[list, float, list[int]]:
        from infra_lab.orchestration import launch, loadgen, router

        tag = self.tag()
        requests = [loadgen.BenchRequest(tag + p, SERVED_MAX_TOKENS, len((tag + p).encode())) for p in prompts]
        recording = _Recording(policy)
        app = router.create_app([w.url for w in self.workers], recording)
        with launch.InThread(app) as served:
            traces, duration_s = loadgen.run(served.url, "target", requests, max_concurrency=1, timeout_s=60)
        counts = [recording.counts.get(w.url, 0) for w in self.workers]
        return traces, duration_s, counts

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []


_FLEET: list[_Fleet] = []


def _fleet() -> _Fleet:
    if not _FLEET or not all(w.alive for w in _FLEET[0].workers):
        if _FLEET:
            _FLEET.pop().stop()
        _FLEET.append(_Fleet())
    return _FLEET[0]


def stop_fleet() -> None:
    """Stop the check's workers (the last served case does, so a notebook goes on without them)."""
    while _FLEET:
        _FLEET.pop().stop()


@functools.cache
def _served_round_robin(n, n_prefixes, state) -> float:
    traces, duration_s, _ = _fleet().serve(RoundRobin(), _stream(n, n_prefixes, state))
    metrics = bench_metrics.compute(traces, duration_s)
    assert metrics["failed"] == 0, [t.error for t in traces if not t.success][:1]
    return metrics["prefix_hit_rate"]


def drive_policy(policy_class, kind, n_workers, n, n_prefixes, state):
    """Route a stream of `n` prompts sharing `n_prefixes` openings, one request after another:
    in a made-up cluster of `n_workers` ("simulated"), or through the real router over two real
    workers ("served"). What a sound policy achieves; WrongRouting naming what it missed."""
    prompts = _stream(n, n_prefixes, state)
    if kind == "simulated":
        hit_rate, counts = simulate(_policy(policy_class), prompts, n_workers)
        round_robin, _ = simulate(RoundRobin(), prompts, n_workers)
        return (kind, f"{n} requests over {n_workers} workers", *_judge("simulated", hit_rate, round_robin, counts))
    if policy_class is CacheAware:  # the reference's verdict (see the module's docstring)
        return (kind, f"all {n} requests served", *_JUDGED)
    probe = _policy(policy_class)  # a policy that cannot choose fails here, before any server starts
    simulate(probe, prompts[:2], n_workers)
    try:
        traces, duration_s, counts = _fleet().serve(_policy(policy_class), prompts)
    finally:
        if kind == "served, last":
            stop_fleet()
    failed = [t for t in traces if not t.success]
    if failed:
        raise WrongRouting(f"{len(failed)} of {n} requests failed through the router with your policy; the first: "
                           f"{failed[0].error[:200]}")
    hit_rate = bench_metrics.compute(traces, duration_s)["prefix_hit_rate"]
    judged = _judge("served by two real workers", hit_rate, _served_round_robin(n, n_prefixes, state), counts)
    return (kind, f"all {n} requests served", *judged)


def _policy_case(kind, rng):
    """A stream on which routing matters: the package's CacheAware gains at least 1.5 times round
    robin's hit rate in the made-up cluster, with no worker above 70% of the requests."""
    while True:
        served = kind.startswith("served")
        n_workers = 2 if served else int(rng.integers(2, 5))
        n = int(rng.integers(10, 15)) if served else int(rng.integers(8, 25))
        n_prefixes = int(rng.integers(3, 6))
        state = int(rng.integers(0, 10_000))
        prompts = _stream(n, n_prefixes, state)
        hit_rate, counts = simulate(CacheAware(), prompts, n_workers)
        round_robin, _ = simulate(RoundRobin(), prompts, n_workers)
        if hit_rate >= 1.5 * round_robin and max(counts) <= 0.7 * n:
            return kind, n_workers, n, n_prefixes, state


_POLICY_KINDS = ["simulated"] * 20 + ["served"] * 3 + ["served, last"]


register(Check("ch06.tpot_and_itl", tpot_and_itl, Schedule(_METRICS_KINDS, _metrics_case), drive=drive_metrics,
               rtol=1e-9, atol=1e-12))
register(Check("ch06.TokenBucket", tenants.TokenBucket, Schedule(_BUCKET_KINDS, _bucket_case), drive=drive_bucket,
               rtol=1e-9, atol=1e-12))
register(Check("ch06.cache_aware_choice", cache_aware_choice, Schedule(_CHOICE_KINDS, _choice_case),
               drive=drive_choice, rtol=0, atol=0))
register(Check("ch06.YourPolicy", CacheAware, Schedule(_POLICY_KINDS, _policy_case), drive=drive_policy, rtol=0,
               atol=0))

from infra_lab.grading import ch06_part2  # noqa: E402,F401: the second part's exercises register there
