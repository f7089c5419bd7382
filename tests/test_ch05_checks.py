"""Chapter 05's checks: plausible wrong answers fail and say where, the last check's cases
preempt, and its reference gives each request its tokens alone (what grading
solutions/ whole holds: an independent answer passes every check)."""
import zlib
from collections import deque

import numpy as np
import pytest

from infra_lab.grading import ch05, checks
from infra_lab.serving import metrics
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import RequestState, SamplingParams
from infra_lab.serving.scheduler import Scheduler, StepPlan


def run(name, candidate):
    return checks._run(checks._lookup(f"ch05.{name}"), candidate)


def cases(name):
    spec = checks._lookup(f"ch05.{name}")
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    return [spec.draw_case(rng) for _ in range(spec.n_cases)]


def test_the_serving_check_preempts_in_many_of_its_cases():
    preempted = 0
    for policy, max_batch, budget, chunk, num_blocks, block_size, prompts, max_tokens in cases("YourScheduler"):
        config = EngineConfig(policy=policy, max_batch=max_batch, token_budget=budget, chunk_size=chunk,
                              num_blocks=num_blocks, block_size=block_size)
        engine = Engine(ch05._target(), config, ch05.serving_backend())
        engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
        preempted += any(step.preempted for step in engine.log)
    assert preempted >= 12, f"only {preempted} of 24 cases preempt: the pools are too large"


def test_the_serving_reference_gives_each_request_its_tokens_alone():
    config = EngineConfig(policy="chunked", num_blocks=64, block_size=16)
    for case in cases("YourScheduler")[:6]:
        prompts, max_tokens = case[-2], case[-1]
        log = ch05.drive_serve(Scheduler, *case)
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
            alone = Engine(ch05._target(), config, ch05.serving_backend())
            assert log[i][1] == tuple(alone.generate([prompt], SamplingParams(max_tokens=m))[0])
        assert log[-1][1] == log[-1][3]  # every block free


# ---- wrong admission, planning, preemption and metrics fail, naming the first difference --------

def skips_the_head(waiting, n_running, budget, free_blocks, block_size, max_batch):
    admitted = []
    for request in waiting:
        tokens, blocks = request.num_uncomputed, -(-request.num_uncomputed // block_size)
        if n_running + len(admitted) < max_batch and tokens <= budget and blocks <= free_blocks:
            admitted.append(request)
            budget, free_blocks = budget - tokens, free_blocks - blocks
    return admitted


def ignores_blocks(waiting, n_running, budget, free_blocks, block_size, max_batch):
    return ch05.admit(waiting, n_running, budget, 10_000, block_size, max_batch)


def returns_indices(waiting, n_running, budget, free_blocks, block_size, max_batch):
    admitted = ch05.admit(waiting, n_running, budget, free_blocks, block_size, max_batch)
    return list(range(len(admitted)))


@pytest.mark.parametrize("wrong, says", [
    (skips_the_head, "expected"),
    (ignores_blocks, "expected"),
    (returns_indices, "must list Request objects"),
])
def test_wrong_admission_fails(wrong, says):
    result = run("admit", wrong)
    assert result.passed < result.total
    assert says in result.first_failure, result.first_failure


def prefills_first(running, waiting, budget, chunk_size, max_batch):
    """Running requests in admission order, decodes and prefills mixed: a prefill ahead of a
    decode can take the budget the decode needed."""
    plan = []
    for request in running + waiting[:max(0, max_batch - len(running))]:
        n = min(request.num_uncomputed, chunk_size, budget)
        if n == 0:
            break
        plan.append((request, n))
        budget -= n
    return plan


def no_chunks(running, waiting, budget, chunk_size, max_batch):
    return ch05.plan_step(running, waiting, budget, budget, max_batch)


def no_batch_limit(running, waiting, budget, chunk_size, max_batch):
    return ch05.plan_step(running, waiting, budget, chunk_size, 1_000)


@pytest.mark.parametrize("wrong", [prefills_first, no_chunks, no_batch_limit])
def test_wrong_plans_fail(wrong):
    result = run("plan_step", wrong)
    assert result.passed < result.total
    assert "returned [(" in result.first_failure and "expected [(" in result.first_failure, result.first_failure


def oldest_first(scheduler, plan):
    scheduler.running.append(scheduler.running.pop(0))  # the oldest becomes the one admitted last
    return ch05.preempt(scheduler, plan)


def to_the_tail(scheduler, plan):
    victim = ch05.preempt(scheduler, plan)
    scheduler.waiting.remove(victim)
    scheduler.waiting.append(victim)
    return victim


def keeps_the_budget(scheduler, plan):
    budget = plan.budget
    victim = ch05.preempt(scheduler, plan)
    plan.budget = budget
    return victim


def keeps_the_blocks(scheduler, plan):
    victim = scheduler.running.pop()
    for entry in [e for e in plan.batch if e[0] is victim]:
        plan.batch.remove(entry)
        plan.budget += entry[1]
    victim.state, victim.preemptions = RequestState.PREEMPTED, victim.preemptions + 1
    plan.preempted.append(victim)
    victim.seq, victim.num_computed = None, 0  # forgets its sequence without freeing its blocks
    scheduler.waiting.appendleft(victim)
    return victim


@pytest.mark.parametrize("wrong", [oldest_first, to_the_tail, keeps_the_budget, keeps_the_blocks])
def test_wrong_preemption_fails_at_a_named_call(wrong):
    result = run("preempt", wrong)
    assert result.passed < result.total
    assert "(call " in result.first_failure, result.first_failure


def tpot_per_request(requests, ttft_slo_s, tpot_slo_s):
    ttft, _, goodput = ch05.serving_metrics(requests, ttft_slo_s, tpot_slo_s)
    done = [r for r in requests if r.state is RequestState.FINISHED]
    means = [np.diff(r.token_times_s).mean() for r in done if len(r.token_times_s) > 1]
    return ttft, float(np.percentile(means, 99)), goodput


def every_gap_must_meet(requests, ttft_slo_s, tpot_slo_s):
    ttft, tpot, _ = ch05.serving_metrics(requests, ttft_slo_s, tpot_slo_s)
    done = [r for r in requests if r.state is RequestState.FINISHED]
    met = sum(metrics.ttft_s(r) <= ttft_slo_s and all(metrics.tpot_gaps_s(r) <= tpot_slo_s) for r in done)
    return ttft, tpot, met / (max(r.finish_s for r in done) - min(r.arrival_s for r in requests))


def counts_aborted(requests, ttft_slo_s, tpot_slo_s):
    for request in requests:
        if request.token_times_s:
            request.state = RequestState.FINISHED
    return ch05.serving_metrics(requests, ttft_slo_s, tpot_slo_s)


@pytest.mark.parametrize("wrong, where", [(tpot_per_request, "item [1]"), (every_gap_must_meet, "item [2]"),
                                          (counts_aborted, "item [")])
def test_wrong_metrics_fail(wrong, where):
    result = run("serving_metrics", wrong)
    assert result.passed < result.total
    assert f"first difference at {where}" in result.first_failure, result.first_failure


# ---- wrong schedulers fail the serving check -------------------------------------------------------

class ForgetsBlocks(Scheduler):
    """Preempts by dropping the victim's sequence without handing its blocks back."""

    def _preempt(self, victim, plan):
        self.running.remove(victim)
        for entry in [e for e in plan.batch if e[0] is victim]:
            plan.batch.remove(entry)
            plan.budget += entry[1]
        victim.state, victim.preemptions = RequestState.PREEMPTED, victim.preemptions + 1
        plan.preempted.append(victim)
        victim.seq, victim.num_computed = None, 0
        self.waiting.appendleft(victim)


class AdmitsNoOne(Scheduler):
    def _schedule_iteration(self, now_s):
        return StepPlan(budget=self.config.token_budget)


class IgnoresMemory(Scheduler):
    """Plans every token it likes and never preempts: the pool runs out."""

    def _schedule_iteration(self, now_s):
        plan = StepPlan(budget=self.config.token_budget)
        was_running = list(self.running)
        steps = ch05.plan_step(was_running, list(self.waiting), plan.budget, self.config.prefill_chunk,
                               self.config.max_batch)
        for request, n in steps:
            if request not in was_running:
                self.waiting.remove(request)
                self._admit(request, now_s)
            self._plan(request, n, plan)
        return plan


@pytest.mark.parametrize("wrong, says", [
    (ForgetsBlocks, "preempts without end"),
    (AdmitsNoOne, "planned an empty step"),
    (IgnoresMemory, "raised OutOfBlocks"),
])
def test_wrong_schedulers_fail_the_serving_check(wrong, says):
    result = run("YourScheduler", wrong)
    assert result.passed < result.total
    assert says in result.first_failure, result.first_failure


def test_a_fresh_exercise_fails_fast_with_its_message():
    class Stub(Scheduler):
        def _schedule_iteration(self, now_s):
            raise NotImplementedError("exercise ch05.YourScheduler: your code here")

    result = run("YourScheduler", Stub)
    assert result.passed == 0 and "raised NotImplementedError" in result.first_failure


# ---- the references hand their work to the package --------------------------------------------------

def test_admission_and_planning_references_run_the_package_scheduler(monkeypatch):
    seen = []
    original = Scheduler.schedule

    def spy(self, now_s):
        seen.append((self.config.policy, self.config.chunk_size))
        return original(self, now_s)

    monkeypatch.setattr(Scheduler, "schedule", spy)
    waiting = [ch05.make_request(5, 4), ch05.make_request(6, 3)]
    assert [r.request_id for r in ch05.admit(waiting, 1, 8, 4, 4, 4)] == [5, 6]
    running = [ch05.make_request(7, 3, 1)]
    running[0].num_computed = 3
    planned = ch05.plan_step(running, [ch05.make_request(8, 10)], 6, 4, 4)
    assert [(r.request_id, n) for r, n in planned] == [(7, 1), (8, 4)]
    assert seen == [("continuous", None), ("chunked", 4)]


def test_the_preemption_reference_applies_the_package_rule(monkeypatch):
    calls = []
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, victim, plan: calls.append((victim, plan)))
    scheduler = ch05._scheduler(EngineConfig(block_size=4), 8)
    first, last = ch05.make_request(1, 3), ch05.make_request(2, 3)
    ch05.start_running(scheduler, first, 3)
    ch05.start_running(scheduler, last, 3)
    plan = StepPlan()
    assert ch05.preempt(scheduler, plan) is last
    assert calls == [(last, plan)]
    assert scheduler.waiting == deque()


def test_the_metrics_reference_reads_the_package_summary(monkeypatch):
    class Summary:
        ttft_s, tpot_s, goodput_req_s = {"p90": 1.0}, {"p99": 2.0}, 3.0

    seen = []
    monkeypatch.setattr(metrics, "summarize", lambda *args: seen.append(args) or Summary())
    assert ch05.serving_metrics(["r"], 0.5, 0.05) == (1.0, 2.0, 3.0)
    assert seen == [(["r"], [], 1, 0.5, 0.05)]


def test_the_admission_and_planning_references_change_none_of_their_inputs():
    waiting = [ch05.make_request(5, 4), ch05.make_request(6, 3, 2)]
    running = [ch05.make_request(7, 3, 1)]
    running[0].num_computed, running[0].state = 3, RequestState.RUNNING
    before = [(r.seq, r.num_computed, r.state, r.admitted_s) for r in running + waiting]
    assert ch05.admit(waiting, 1, 16, 4, 4, 4) == waiting
    assert [n for _, n in ch05.plan_step(running, waiting, 6, 4, 4)] == [1, 4, 1]
    assert [(r.seq, r.num_computed, r.state, r.admitted_s) for r in running + waiting] == before
