"""Chapter 06's checks: plausible wrong answers fail and say how, the cases cover what the
statements promise, and a correct policy with a tie-breaking of its own passes too."""
import dataclasses
import os
import zlib

import numpy as np
import pytest

from infra_lab.grading import ch06, checks
from infra_lab.grading.ch07 import Schedule
from infra_lab.orchestration import bench_metrics, tenants
from infra_lab.orchestration.policies import CacheAware, Policy, RoundRobin, Worker


def run(name, candidate, spec=None):
    return checks._run(spec or checks._lookup(f"ch06.{name}"), candidate)


def cases(name):
    spec = checks._lookup(f"ch06.{name}")
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    return [spec.draw_case(rng) for _ in range(spec.n_cases)]


def fails(name, wrong, shows="", spec=None):
    result = run(name, wrong, spec)
    assert result.passed < result.total, result.line
    assert shows in result.first_failure, result.first_failure
    return result


# ---- the cases ------------------------------------------------------------------------------------

def test_metric_cases_hold_chunks_of_several_tokens_and_requests_without_tpot():
    requests = [r for (case,) in cases("tpot_and_itl") for r in case]
    assert any(n > 1 for _, chunks in requests for _, n in chunks)  # where TPOT and ITL part
    assert any(len(chunks) == 1 and chunks[0][1] > 1 for _, chunks in requests)  # TPOT 0, no ITL
    assert any(all(sum(n for _, n in chunks) == 1 for _, chunks in case) for (case,) in cases("tpot_and_itl"))
    lengths = {sum(n for _, n in chunks) for _, chunks in requests}
    assert len(lengths) > 5  # over requests and over tokens differ


def test_bucket_cases_refuse_retry_after_the_wait_and_ask_beyond_the_burst():
    waits, retried, beyond = [], 0, 0
    for case in cases("TokenBucket"):
        log = ch06.drive_bucket(tenants.TokenBucket, *case)
        rate, burst, _, steps = case
        waits += [w for _, w in log]
        retried += sum(1 for (_, w), (advance, _) in zip(log, steps[1:]) if w > 0 and advance == w)
        beyond += sum(cost > burst for _, cost in steps)
    assert sum(w == 0 for w in waits) > 50 and sum(w > 0 for w in waits) > 30
    assert retried >= 5 and beyond >= 5


def test_choice_cases_reach_every_rule_and_its_ties():
    reached = set()
    for prompt, routed, outstanding, threshold, abs_threshold, rel_threshold in cases("cache_aware_choice"):
        policy = CacheAware(threshold, abs_threshold, rel_threshold)
        workers = [Worker(f"w{i}", n) for i, n in enumerate(outstanding)]
        for worker, prompts in zip(workers, routed):
            for text in prompts:
                policy.routed(text, worker)
        if policy.imbalanced(workers):
            reached.add("imbalanced")
            continue
        matched = [policy._tree(w).match(prompt) for w in workers]
        if prompt and max(matched) / len(prompt) >= threshold:
            reached.add("match, tie" if matched.count(max(matched)) > 1 else "match")
        else:
            sizes = [policy._tree(w).total_chars for w in workers]
            reached.add("smallest, tie" if sizes.count(min(sizes)) > 1 else "smallest")
        if max(outstanding) - min(outstanding) > abs_threshold:
            reached.add("beyond one threshold only")
    assert reached == {"imbalanced", "match", "match, tie", "smallest", "smallest, tie", "beyond one threshold only"}


def test_policy_cases_simulate_first_and_serve_last():
    kinds = [case[0] for case in cases("YourPolicy")]
    assert kinds == ["simulated"] * 20 + ["served"] * 3 + ["served, last"]


# ---- exercise 1 -------------------------------------------------------------------------------------

def tpot_over_tokens(requests):
    decode_s = sum(chunks[-1][0] - chunks[0][0] for _, chunks in requests)
    tokens = sum(sum(n for _, n in chunks) - 1 for _, chunks in requests)
    return (decode_s / tokens if tokens > 0 else 0.0), ch06.tpot_and_itl(requests)[1]


def itl_per_token(requests):
    itls = []
    for _, chunks in requests:
        for (earlier, _), (later, n) in zip(chunks, chunks[1:]):
            itls += [(later - earlier) / n] * n
    return ch06.tpot_and_itl(requests)[0], itls


def tpot_over_chunks(requests):
    tpots = [(chunks[-1][0] - chunks[0][0]) / (len(chunks) - 1) for _, chunks in requests if len(chunks) > 1]
    return (float(np.mean(tpots)) if tpots else 0.0), ch06.tpot_and_itl(requests)[1]


def one_token_requests_count_as_zero(requests):
    traces = ch06._traces(requests)
    tpots = [t.tpot_s or 0.0 for t in traces]
    return float(np.mean(tpots)), ch06.tpot_and_itl(requests)[1]


def itl_from_the_send(requests):
    itls = []
    for send_s, chunks in requests:
        times = [send_s] + [t for t, _ in chunks]
        itls += list(np.diff(times))
    return ch06.tpot_and_itl(requests)[0], itls


@pytest.mark.parametrize("wrong", [tpot_over_tokens, itl_per_token, tpot_over_chunks,
                                   one_token_requests_count_as_zero, itl_from_the_send])
def test_wrong_tpot_and_itl_fail(wrong):
    fails("tpot_and_itl", wrong, "expected")


def test_the_reference_agrees_with_the_traces_by_hand():
    # a chunk of 4 tokens after 80 ms: TPOT 20 ms per token, one ITL of 80 ms
    requests = [(0.0, [(0.1, 1), (0.18, 4)]), (1.0, [(1.2, 3)])]
    tpot, itls = ch06.tpot_and_itl(requests)
    assert tpot == pytest.approx((0.08 / 4 + 0.0) / 2) and itls == pytest.approx([0.08])
    trace = bench_metrics.RequestTrace(0.0, (0.1, 0.18), completion_tokens=5)
    assert trace.tpot_s == pytest.approx(0.02)


# ---- exercise 2 -------------------------------------------------------------------------------------

class Unbounded(tenants.TokenBucket):
    """Refills without the cap at burst."""

    def _refill(self):
        now = self.clock()
        self.level += (now - self.updated_s) * self.rate_per_s
        self.updated_s = now


class TakesOnRefusal(tenants.TokenBucket):
    def take(self, cost):
        wait = self.wait_s(cost)
        self.level -= min(cost, self.burst)
        return wait


class StartsEmpty(tenants.TokenBucket):
    def __init__(self, rate_per_s, burst, clock):
        super().__init__(rate_per_s, burst, clock)
        self.level = 0.0


class NoCostCap(tenants.TokenBucket):
    def wait_s(self, cost):
        self._refill()
        missing = cost - self.level
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def take(self, cost):
        wait = self.wait_s(cost)
        if wait == 0:
            self.level -= cost
        return wait


class WaitsForAFullBucket(tenants.TokenBucket):
    def wait_s(self, cost):
        self._refill()
        return 0.0 if self.level >= min(cost, self.burst) else (self.burst - self.level) / self.rate_per_s


@pytest.mark.parametrize("wrong", [Unbounded, TakesOnRefusal, StartsEmpty, NoCostCap, WaitsForAFullBucket])
def test_wrong_buckets_fail(wrong):
    fails("TokenBucket", wrong, "step")


# ---- exercise 3 -------------------------------------------------------------------------------------

def _with(**changes):
    def choice(prompt, routed, outstanding, cache_threshold, abs_threshold, rel_threshold):
        policy = changes.get("policy", CacheAware)(cache_threshold, abs_threshold, rel_threshold)
        workers = [Worker(f"w{i}", n) for i, n in enumerate(outstanding)]
        for worker, prompts in zip(workers, routed):
            for text in prompts:
                policy.routed(text, worker)
        if "imbalanced" in changes:
            policy.imbalanced = changes["imbalanced"].__get__(policy)
        return workers.index(policy.choose(prompt, workers))
    return choice


class ByPromptCount(CacheAware):
    """The smallest holder counted in prompts, not characters."""

    def choose(self, prompt_text, workers):
        if self.imbalanced(workers):
            return min(workers, key=lambda w: w.outstanding)
        matched = [self._tree(w).match(prompt_text) for w in workers]
        if prompt_text and max(matched) / len(prompt_text) >= self.cache_threshold:
            return min((w for w, m in zip(workers, matched) if m == max(matched)), key=lambda w: w.outstanding)
        return min(workers, key=lambda w: (self.counts.get(w.url, 0), w.outstanding))

    def routed(self, prompt_text, worker):
        super().routed(prompt_text, worker)
        self.counts = getattr(self, "counts", {})
        self.counts[worker.url] = self.counts.get(worker.url, 0) + 1


class LastOnATie(CacheAware):
    def choose(self, prompt_text, workers):
        return super().choose(prompt_text, workers[::-1])


class AlwaysBestMatch(CacheAware):
    def choose(self, prompt_text, workers):
        if self.imbalanced(workers):
            return min(workers, key=lambda w: w.outstanding)
        matched = [self._tree(w).match(prompt_text) for w in workers]
        return min((w for w, m in zip(workers, matched) if m == max(matched)), key=lambda w: w.outstanding)


@pytest.mark.parametrize("wrong", [
    _with(imbalanced=lambda self, workers: False),  # ignores the load
    _with(imbalanced=lambda self, workers: max(w.outstanding for w in workers)
          - min(w.outstanding for w in workers) > self.balance_abs_threshold),  # one threshold is enough
    _with(policy=ByPromptCount), _with(policy=LastOnATie), _with(policy=AlwaysBestMatch),
], ids=["ignores imbalance", "abs threshold alone", "prompts not characters", "last on a tie", "no threshold"])
def test_wrong_choices_fail(wrong):
    fails("cache_aware_choice", wrong, "cache_aware_choice(")


def test_a_correct_choice_from_plain_strings_passes():
    def choice(prompt, routed, outstanding, cache_threshold, abs_threshold, rel_threshold):
        most, least = max(outstanding), min(outstanding)
        order = range(len(outstanding))
        if most - least > abs_threshold and most > rel_threshold * least:
            return min(order, key=lambda i: (outstanding[i], i))
        held = [max((len(os.path.commonprefix([prompt, p])) for p in ps), default=0) for ps in routed]
        if prompt and max(held) >= cache_threshold * len(prompt):
            return min((i for i in order if held[i] == max(held)), key=lambda i: (outstanding[i], i))
        sizes = [len({p[:k] for p in ps for k in range(1, len(p) + 1)}) for ps in routed]
        return min(order, key=lambda i: (sizes[i], outstanding[i], i))

    assert run("cache_aware_choice", choice).line == "PASS ch06.cache_aware_choice 24/24"


# ---- exercise 4 (the made-up clusters; the real servers run in the notebook's check) ----------------

def simulated_only():
    spec = checks._lookup("ch06.YourPolicy")
    return dataclasses.replace(spec, n_cases=20)


class FirstWorker(Policy):
    def choose(self, prompt_text, workers):
        return workers[0]


class BestMatchElseLeastBusy(CacheAware):
    """Cache-aware, but a new prefix goes to the least busy worker: the first, one at a time."""

    def choose(self, prompt_text, workers):
        matched = [self._tree(w).match(prompt_text) for w in workers]
        if prompt_text and max(matched) / len(prompt_text) >= self.cache_threshold:
            return workers[matched.index(max(matched))]
        return min(workers, key=lambda w: w.outstanding)


class ReturnsAnIndex(CacheAware):
    def choose(self, prompt_text, workers):
        return workers.index(super().choose(prompt_text, workers))


class RecordsNothing(CacheAware):
    def routed(self, prompt_text, worker):
        pass


@pytest.mark.parametrize("wrong, shows", [
    (RoundRobin, "round robin's"), (FirstWorker, "no worker may take more than 75%"),
    (BestMatchElseLeastBusy, "no worker may take more than 75%"), (ReturnsAnIndex, "not one of the Worker"),
    (RecordsNothing, "no worker may take more than 75%"),
])
def test_wrong_policies_fail_in_the_made_up_clusters(wrong, shows):
    result = fails("YourPolicy", wrong, shows, simulated_only())
    assert result.passed == 0, result.line


class RandomOnNewPrefixes(CacheAware):
    """A sound variant: a new prefix goes to the smaller of two holders drawn at random."""

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)

    def choose(self, prompt_text, workers):
        matched = [self._tree(w).match(prompt_text) for w in workers]
        if prompt_text and max(matched) / len(prompt_text) >= self.cache_threshold:
            return workers[matched.index(max(matched))]
        a, b = self.rng.choice(len(workers), size=2, replace=False)
        return min(workers[a], workers[b], key=lambda w: self._tree(w).total_chars)


def test_a_policy_with_its_own_tie_breaking_passes_the_made_up_clusters():
    assert run("YourPolicy", RandomOnNewPrefixes, simulated_only()).line == "PASS ch06.YourPolicy 20/20"


def test_a_class_that_is_no_policy_is_named():
    fails("YourPolicy", object, "subclass of infra_lab.orchestration.policies.Policy", simulated_only())


class ThePackagesPolicy(CacheAware):
    """The package's policy as a candidate: the reference's own served cases are its verdict alone."""


@pytest.mark.slow
def test_served_cases_pass_the_package_policy_and_stop_the_workers():
    """The variant and the package's policy on the same two real workers: the same cases with
    the last not stopping them serve the variant, then the check as it is the package's policy."""
    spec = checks._lookup("ch06.YourPolicy")
    kinds = ["simulated"] * 20 + ["served"] * 4  # "served, last" draws as "served" does
    keep = dataclasses.replace(spec, draw_case=Schedule(kinds, ch06._policy_case))
    assert run("YourPolicy", RandomOnNewPrefixes, keep).line == "PASS ch06.YourPolicy 24/24"
    assert ch06._FLEET and all(worker.alive for worker in ch06._FLEET[0].workers)
    result = run("YourPolicy", ThePackagesPolicy)
    assert result.line == "PASS ch06.YourPolicy 24/24", result.line
    assert not ch06._FLEET  # the last served case stopped them
