"""Checks for chapter 05's exercises: admission under a token budget and a block count, a
chunked-prefill plan for one step, preemption of the last admitted request, the serving metrics,
and a scheduler built from these that serves the real model.

The references call the package: the first three run `infra_lab.serving.scheduler.Scheduler`
itself on a state built for the case (requests with sequences in a real block pool), the fourth
reads `infra_lab.serving.metrics`, and the last serves each case through `Engine` with the
package's Scheduler. Every case is drawn from plain numbers, so a failure line shows them.
"""
from __future__ import annotations

import copy
import functools
from collections import deque

import numpy as np

from infra_lab import backend as backends
from infra_lab.grading.checks import Check, register
from infra_lab.kv.paged import PagedKVCache
from infra_lab.serving import metrics
from infra_lab.serving.block_manager import BlockManager
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import Request, RequestState, SamplingParams
from infra_lab.serving.scheduler import Scheduler, StepPlan

FILLER_ID = 10_000  # request ids at and above this belong to requests the references make up


# ---- requests and states built from numbers --------------------------------------------------

def make_request(request_id: int, prompt_len: int, output_len: int = 0) -> Request:
    """A request with `prompt_len` prompt tokens that has generated `output_len` tokens; nothing
    of it is computed yet (a waiting request, or one preempted to recompute)."""
    prompt = [(request_id * 7 + i) % 256 for i in range(prompt_len)]
    request = Request(request_id, prompt, SamplingParams(max_tokens=output_len + 64))
    request.output = [(request_id + i) % 256 for i in range(output_len)]
    if output_len:
        request.state = RequestState.PREEMPTED
    return request


def start_running(scheduler: Scheduler, request: Request, computed: int) -> None:
    """Make `request` a running one whose first `computed` tokens sit in the pool."""
    pool = scheduler.blocks.pool
    request.seq = pool.new_sequence()
    pool.reserve(request.seq, computed)
    pool.commit(request.seq, request.tokens[:computed])
    request.num_computed, request.state = computed, RequestState.RUNNING
    request.admitted_s = 0.0
    scheduler.running.append(request)


def _scheduler(config: EngineConfig, num_blocks: int) -> Scheduler:
    pool = PagedKVCache(1, 1, 1, num_blocks, config.block_size)  # bookkeeping only: K and V of one float
    return Scheduler(config, BlockManager(pool))


# ---- references ------------------------------------------------------------------------------

def _originals(batch, copies, originals) -> list[tuple[Request, int]]:
    """The plan's (copy, n) pairs as (original, n): the references schedule copies of the
    requests they are given, and change none of them."""
    where = {id(c): o for c, o in zip(copies, originals)}
    return [(where[id(r)], n) for r, n in batch if id(r) in where]


def admit(waiting, n_running, budget, free_blocks, block_size, max_batch):
    """Reference: the requests that the continuous policy admits from the head of `waiting`
    (whole prompts only, first come first served) when `n_running` requests run, `budget` tokens
    and `free_blocks` blocks are left in this step. It runs the package's Scheduler on a state
    where `n_running` requests decode inside their last block (one token each, no new block)."""
    decode_blocks = n_running if block_size == 1 else 0  # a one-token block is full: the next token needs one
    config = EngineConfig(policy="continuous", max_batch=max_batch, token_budget=budget + n_running,
                          block_size=block_size)
    scheduler = _scheduler(config, n_running + decode_blocks + free_blocks)
    for i in range(n_running):
        decoding = make_request(FILLER_ID + i, 1, 1)  # one prompt token computed, its first output next
        start_running(scheduler, decoding, 1)
    copies = copy.deepcopy(list(waiting))
    scheduler.waiting = deque(copies)
    plan = scheduler.schedule(0.0)
    assert not plan.preempted, "the decodes of the made-up running requests must fit"
    return [request for request, _ in _originals(plan.batch, copies, waiting)]


def plan_step(running, waiting, budget, chunk_size, max_batch):
    """Reference: (request, tokens) in the order the chunked policy plans one step, with room
    for everything in the pool: the package's Scheduler with policy "chunked"."""
    config = EngineConfig(policy="chunked", max_batch=max_batch, token_budget=budget, chunk_size=chunk_size,
                          block_size=1)
    room = sum(len(r.prompt) + len(r.output) for r in [*running, *waiting]) + budget
    scheduler = _scheduler(config, room)
    running_copies, waiting_copies = copy.deepcopy(list(running)), copy.deepcopy(list(waiting))
    for request in running_copies:
        start_running(scheduler, request, request.num_computed)
    scheduler.waiting = deque(waiting_copies)
    plan = scheduler.schedule(0.0)
    assert not plan.preempted, "the pool was made large enough for every request"
    return _originals(plan.batch, running_copies + waiting_copies, [*running, *waiting])


def preempt(scheduler, plan):
    """Reference: preempt the running request admitted last, by recompute (the package's rule)."""
    victim = scheduler.running[-1]
    scheduler._preempt(victim, plan)
    return victim


def serving_metrics(requests, ttft_slo_s, tpot_slo_s):
    """Reference: (p90 TTFT, p99 TPOT over every gap, goodput in requests/s) of the finished
    requests, from `infra_lab.serving.metrics.summarize`."""
    summary = metrics.summarize(requests, [], 1, ttft_slo_s, tpot_slo_s)
    return summary.ttft_s["p90"], summary.tpot_s["p99"], summary.goodput_req_s


# ---- drives: build the case's state, call the function, record what it did -------------------------

def _ids(result, what: str) -> list[int]:
    ids = []
    for item in result:
        if not isinstance(item, Request):
            raise TypeError(f"{what} must list Request objects (the ones it was given); got {type(item).__name__} "
                            f"{item!r}")
        ids.append(item.request_id)
    return ids


def drive_admit(function, waiting, n_running, budget, free_blocks, block_size, max_batch):
    """waiting: (request id, prompt tokens, output tokens) in queue order; the admitted ids."""
    requests = [make_request(*spec) for spec in waiting]
    return _ids(function(requests, n_running, budget, free_blocks, block_size, max_batch), "admit's answer")


def _running_request(spec) -> Request:
    request_id, prompt_len, output_len, computed = spec
    request = make_request(request_id, prompt_len, output_len)
    request.num_computed, request.state = computed, RequestState.RUNNING
    return request


def drive_plan(function, running, waiting, budget, chunk_size, max_batch):
    """running: (id, prompt tokens, output tokens, computed) in admission order; waiting: (id,
    prompt tokens, output tokens). The plan as (request id, tokens) pairs."""
    running_requests = [_running_request(spec) for spec in running]
    waiting_requests = [make_request(*spec) for spec in waiting]
    plan = function(running_requests, waiting_requests, budget, chunk_size, max_batch)
    pairs = []
    for entry in plan:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError(f"plan_step must return (request, n_tokens) pairs; got {entry!r}")
        pairs.append((_ids([entry[0]], "each pair")[0], int(entry[1])))
    return pairs


def _snapshot(scheduler: Scheduler, plan: StepPlan, everyone: list[Request]) -> tuple:
    """Everything a preemption may change, each item labelled, so a failure line names it."""
    ids = lambda requests: tuple(r.request_id for r in requests)  # noqa: E731
    return (("running", ids(scheduler.running)), ("waiting", ids(scheduler.waiting)),
            ("plan.batch", tuple((r.request_id, n) for r, n in plan.batch)), ("plan.budget", plan.budget),
            ("plan.preempted", ids(plan.preempted)), ("free blocks", scheduler.blocks.pool.num_free),
            ("requests", tuple((f"request {r.request_id}", ("state", r.state.value), ("num_computed", r.num_computed),
                                ("seq", "none" if r.seq is None else "set"), ("preemptions", r.preemptions))
                               for r in everyone)))


def drive_preempt(function, block_size, running, waiting, planned, extra_budget, extra_blocks, n_calls):
    """A scheduler with `running` (id, prompt, output, computed) in admission order, `waiting`
    (id, prompt, output) in queue order, and a plan of this step that already holds `planned`
    (index into running, tokens); then `n_calls` preemptions. After each: the victim's id,
    running, waiting, the plan (entries, budget, preempted), free blocks and every request's
    state, num_computed, whether it holds a sequence, and preemptions."""
    config = EngineConfig(policy="chunked", max_batch=16, token_budget=64, block_size=block_size)
    held = sum(-(-computed // block_size) for _, _, _, computed in running)
    need = sum(-(-(running[i][3] + n) // block_size) - -(-running[i][3] // block_size) for i, n in planned)
    scheduler = _scheduler(config, held + need + extra_blocks)
    everyone = []
    for spec in running:
        request = make_request(*spec[:3])
        start_running(scheduler, request, spec[3])
        everyone.append(request)
    for spec in waiting:
        request = make_request(*spec)
        scheduler.waiting.append(request)
        everyone.append(request)
    plan = StepPlan(budget=sum(n for _, n in planned) + extra_budget)
    for index, n in planned:
        scheduler._plan(scheduler.running[index], n, plan)
    log = [("before", *_snapshot(scheduler, plan, everyone))]
    for call in range(n_calls):
        victim = function(scheduler, plan)
        log.append((f"call {call + 1}", ("victim", _ids([victim], "preempt's answer")[0]),
                    *_snapshot(scheduler, plan, everyone)))
    return log


@functools.cache
def _target():
    from infra_lab import model

    return model.load("target")


def serving_backend() -> backends.Backend:
    """numpy, the kernels' reference face: nothing to compile, so the check starts at once, and
    the fastest of the three on steps of a few tokens. A greedy request's tokens are the same on
    every backend (tests/test_engine_step.py). numpy is always installed, so the Backend is made
    directly: `resolve` would import torch to look for a GPU."""
    return backends.Backend("numpy", "cpu")


MAX_STEPS = 2_000  # far more than any case needs: a scheduler that never finishes fails, not hangs


def _counted(scheduler_class: type) -> type:
    """`scheduler_class`, limited to 2 * MAX_STEPS plans: the engine asks again at once when a
    plan is empty because all it held were preempted, so a preemption that frees nothing would
    otherwise loop inside one step."""
    if not (isinstance(scheduler_class, type) and issubclass(scheduler_class, Scheduler)):
        raise TypeError(f"expected a subclass of infra_lab.serving.scheduler.Scheduler; got {scheduler_class!r}")

    class Counted(scheduler_class):
        plans = 0

        def schedule(self, now_s):
            self.plans += 1
            if self.plans > 2 * MAX_STEPS:
                raise RuntimeError(f"{2 * MAX_STEPS} plans and the requests are not done: the scheduler preempts "
                                   "without end (does a preemption hand the victim's blocks back?)")
            return super().schedule(now_s)

    return Counted


def drive_serve(scheduler_class, policy, max_batch, token_budget, chunk_size, num_blocks, block_size, prompts,
                max_tokens):
    """Serve the prompts greedily through the engine with `scheduler_class`; record each
    request's tokens, then the pool's free blocks once all are done."""
    config = EngineConfig(policy=policy, max_batch=max_batch, token_budget=token_budget, chunk_size=chunk_size,
                          num_blocks=num_blocks, block_size=block_size)
    engine = Engine(_target(), config, serving_backend(), scheduler_class=_counted(scheduler_class))
    ids = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    for _ in range(MAX_STEPS):
        if all(engine.requests[i].is_done for i in ids):
            break
        steps = len(engine.log)
        engine.step()
        if len(engine.log) == steps:
            waiting = [i for i in ids if not engine.requests[i].is_done]
            raise RuntimeError(f"the scheduler planned an empty step while requests {waiting} were unfinished")
    else:
        raise RuntimeError(f"requests were still unfinished after {MAX_STEPS} steps")
    log = [(f"request {i} tokens", tuple(engine.requests[i].output)) for i in ids]
    return log + [("free blocks at the end", engine.blocks.pool.num_free, "of", num_blocks)]


# ---- cases ----------------------------------------------------------------------------------------

def _ids_for(rng, n: int) -> list[int]:
    return [int(i) for i in rng.choice(100, size=n, replace=False)]  # not 0..n-1: indices are no answer


def _waiting_specs(rng, ids) -> list[tuple]:
    specs = []
    for request_id in ids:
        prompt = int(rng.integers(20, 41)) if rng.random() < 0.3 else int(rng.integers(1, 13))
        output = int(rng.integers(1, 10)) if rng.random() < 0.25 else 0  # a preempted one recomputes its output too
        specs.append((request_id, prompt, output))
    return specs


def _admit_case(rng):
    block_size = int(rng.choice([1, 2, 4, 16]))
    tight = str(rng.choice(["budget", "blocks", "batch", "all"]))  # the limit that most likely binds
    max_batch = int(rng.integers(1, 5)) if tight in ("batch", "all") else int(rng.integers(6, 12))
    n_running = max(0, max_batch - int(rng.integers(1, 4)))
    budget = int(rng.integers(max(block_size, 8), 51)) if tight in ("budget", "all") else 200
    free_blocks = int(rng.integers(1, 50 // block_size + 2)) if tight in ("blocks", "all") else 200
    waiting = []
    for i, request_id in enumerate(_ids_for(rng, int(rng.integers(1, 8)))):
        long = rng.random() < (0.5 if i == 0 else 0.15)  # a long head that may not fit, short ones behind
        output = int(rng.integers(5, 21)) if rng.random() < 0.4 else 0  # preempted: its output counts too
        waiting.append((request_id, int(rng.integers(30, 61)) if long else int(rng.integers(1, 13)), output))
    return waiting, n_running, budget, free_blocks, block_size, max_batch


def _running_specs(rng, ids) -> list[tuple]:
    specs = []
    for request_id in ids:
        kind = rng.choice(["decode", "decode", "prefill", "recompute"])
        prompt = int(rng.integers(2, 41))
        if kind == "decode":
            output = int(rng.integers(1, 20))
            specs.append((request_id, prompt, output, prompt + output - 1))
        elif kind == "prefill":  # may have one token left: still a prefill, it has no output yet
            specs.append((request_id, prompt, 0, int(rng.integers(1, prompt))))
        else:  # preempted, readmitted, part of its prompt and output computed again
            output = int(rng.integers(1, 10))
            specs.append((request_id, prompt, output, int(rng.integers(1, prompt + output - 1))))
    return specs


def _plan_case(rng):
    max_batch = int(rng.integers(1, 9))
    budget = int(rng.integers(1, 49))
    chunk_size = budget if rng.random() < 0.25 else int(rng.integers(1, budget + 1))
    n_running, n_waiting = int(rng.integers(0, max_batch + 1)), int(rng.integers(0, 6))
    ids = _ids_for(rng, n_running + n_waiting)
    return (_running_specs(rng, ids[:n_running]), _waiting_specs(rng, ids[n_running:]), budget, chunk_size,
            max_batch)


def _preempt_case(rng):
    block_size = int(rng.choice([1, 4, 16]))
    n_running, n_waiting = int(rng.integers(1, 7)), int(rng.integers(0, 4))
    ids = _ids_for(rng, n_running + n_waiting)
    running = _running_specs(rng, ids[:n_running])
    planned = []
    for index, (_, prompt, output, computed) in enumerate(running):
        if rng.random() < 0.6:
            planned.append((index, int(rng.integers(1, prompt + output - computed + 1))))
    return (block_size, running, _waiting_specs(rng, ids[n_running:]), planned, int(rng.integers(0, 20)),
            int(rng.integers(0, 5)), int(rng.integers(1, n_running + 1)))


def _metrics_case(rng):
    n = int(rng.integers(1, 13))
    arrivals = np.sort(rng.uniform(0, 5, size=n))
    requests = []
    for i, arrival in enumerate(arrivals):
        n_tokens = 1 if rng.random() < 0.2 else int(rng.integers(2, 30))
        gaps = rng.exponential(0.03, size=n_tokens)
        gaps[0] = rng.exponential(0.4) + 0.01  # queueing and prefill before the first token
        gaps[1:] += (rng.random(n_tokens - 1) < 0.05) * 0.3  # a decode stalled behind a long prefill
        times = [float(t) for t in arrival + np.cumsum(gaps)]
        request = Request(i, [1], SamplingParams(max_tokens=n_tokens), arrival_s=float(arrival))
        if i == 0 or rng.random() < 0.85:  # at least one request finishes
            n_tokens = max(n_tokens, 2) if i == 0 else n_tokens
            times = times if len(times) >= n_tokens else times + [times[-1] + 0.02]
            request.output, request.token_times_s = [7] * n_tokens, times[:n_tokens]
            request.finish(RequestState.FINISHED, "length", request.token_times_s[-1])
        else:  # aborted, or rejected, after some tokens or none: it does not count
            kept = int(rng.integers(0, n_tokens + 1))
            request.output, request.token_times_s = [7] * kept, times[:kept]
            request.finish(RequestState.ABORTED, "abort", times[-1] + 0.5)
        requests.append(request)
    return requests, float(rng.uniform(0.1, 1.0)), float(rng.uniform(0.01, 0.08))


def _serve_case(rng):
    policy = str(rng.choice(["continuous", "chunked"]))
    block_size, max_batch, n = int(rng.choice([2, 4, 8])), int(rng.integers(2, 4)), 3
    prompts = [[int(t) for t in rng.integers(32, 127, size=int(rng.integers(2, 7)))] for _ in range(n)]
    max_tokens = [int(rng.integers(1, 6)) for _ in range(n)]  # decodes outgrow what admission saw
    longest = max(len(p) + m - 1 for p, m in zip(prompts, max_tokens))  # tokens a request ever holds
    if policy == "chunked":
        token_budget = int(rng.integers(block_size, 13))
        chunk_size = None if rng.random() < 0.3 else int(rng.integers(1, token_budget + 1))
    else:  # a whole prompt, or a recompute, must fit one step
        token_budget, chunk_size = max(longest, block_size) + int(rng.integers(0, 9)), None
    num_blocks = -(-(longest + int(rng.integers(0, longest // 4 + 1))) // block_size)  # small: preemption happens
    return policy, max_batch, token_budget, chunk_size, num_blocks, block_size, prompts, max_tokens


register(Check("ch05.admit", admit, _admit_case, drive=drive_admit, rtol=0, atol=0))
register(Check("ch05.plan_step", plan_step, _plan_case, drive=drive_plan, rtol=0, atol=0))
register(Check("ch05.preempt", preempt, _preempt_case, drive=drive_preempt, rtol=0, atol=0))
register(Check("ch05.serving_metrics", serving_metrics, _metrics_case, rtol=1e-9, atol=1e-12))
register(Check("ch05.YourScheduler", Scheduler, _serve_case, drive=drive_serve, rtol=0, atol=0))
