"""The serving engine: requests in, tokens out, one batched forward per step (chapter 05).

`add_request` queues a prompt with its sampling parameters; each `step()` asks the scheduler
what to run, runs it through the model runner as one mixed batch, and returns what each request
produced; `abort` cancels; `stream` yields one request's tokens as they come; `generate` serves a
whole batch of prompts; `serve` replays a timed workload (traffic.TimedRequest) against the
clock. Every step is logged (steplog), and every figure of the chapter is computed from that log
and the requests' timestamps (metrics). The simulator runs this same engine with a runner that
times steps by a roofline model on a virtual clock.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from infra_lab import backend as backends
from infra_lab.serving.block_manager import BlockManager
from infra_lab.serving.clock import WallClock
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import Drafter
from infra_lab.serving.request import Request, RequestState, SamplingParams
from infra_lab.serving.runner import ModelRunner
from infra_lab.serving.scheduler import Scheduler
from infra_lab.serving.speculative import check_drafter
from infra_lab.serving.speculative_runner import SpeculativeRunner
from infra_lab.serving.steplog import StepRecord, Work


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    token: int
    finished: bool
    finish_reason: str | None  # "stop" or "length" when finished


class Engine:
    def __init__(self, model=None, config: EngineConfig | None = None, backend: backends.Backend | None = None,
                 *, runner=None, clock=None, scheduler_class: type[Scheduler] = Scheduler,
                 drafter: Drafter | None = None, acceptance_rule=None):
        """The engine over `model` (a Transformer) on `backend`; a simulator passes its own
        `runner` (with its pool) and `clock` instead of a model. `scheduler_class` may be a
        subclass of Scheduler with a policy of one's own (chapter 05's last exercise). With
        config.num_speculative_tokens = γ > 0, `drafter` proposes γ tokens per decode and
        `acceptance_rule` (speculative.accept_sampling unless given) judges them (chapter 07)."""
        self.config = config or EngineConfig()
        self.clock = clock or WallClock()
        gamma = self.config.num_speculative_tokens
        if (drafter is None) != (gamma == 0):
            raise ValueError(f"speculative decoding needs both a drafter and num_speculative_tokens >= 1; got "
                             f"drafter={type(drafter).__name__ if drafter else None}, num_speculative_tokens={gamma}")
        if runner is None:
            if model is None:
                raise ValueError("an engine needs a model, or a runner (the simulator's)")
            backend = backend or backends.current()
            pool = model.new_paged_cache(self.config.num_blocks, self.config.block_size, backend=backend)
            if drafter is not None:
                check_drafter(drafter, model)
                runner = SpeculativeRunner(model, pool, backend, self.clock, drafter, gamma, acceptance_rule)
            else:
                runner = ModelRunner(model, pool, backend, clock=self.clock)
        self.runner = runner
        self.blocks = BlockManager(runner.pool, radix=self.config.prefix_cache == "radix",
                                   host_blocks=self.config.host_blocks)
        self.scheduler = scheduler_class(self.config, self.blocks)
        self.requests: dict[int, Request] = {}
        self.log: list[StepRecord] = []
        self._next_id = 0

    # ---- requests in ---------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, arrival_s: float | None = None,
                    request_id: int | None = None) -> int:
        """Queue a prompt (text, bytes or token ids); returns its request id. A prompt that can
        never run raises ValueError naming why, and the engine is unchanged. When `max_waiting`
        requests already wait, the request is rejected: it ends at once, aborted, with the reason."""
        params = params or SamplingParams()
        tokens = self._tokens(prompt)
        request_id = self._next_id if request_id is None else int(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is taken; ids must be unique")
        self._check_fits(request_id, tokens, params)
        now = self.clock()
        request = Request(request_id, tokens, params, arrival_s=now if arrival_s is None else arrival_s)
        self.requests[request_id] = request
        self._next_id = max(self._next_id, request_id + 1)
        limit = self.config.max_waiting
        if limit is not None and len(self.scheduler.waiting) >= limit:
            request.finish(RequestState.ABORTED, f"rejected: {limit} requests already wait (max_waiting)", now)
        else:
            self.scheduler.add(request)
        return request_id

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            prompt = prompt.encode("utf-8")
        tokens = [int(t) for t in (list(prompt) if isinstance(prompt, (bytes, bytearray)) else np.ravel(prompt))]
        if not tokens:
            raise ValueError("the prompt is empty; a request needs at least one token")
        vocab = self.runner.vocab
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token {bad[0]} is outside the vocabulary [0, {vocab})")
        return tokens

    def _check_fits(self, request_id: int, tokens: list[int], params: SamplingParams) -> None:
        config, total = self.config, len(tokens) + params.max_tokens
        longest = total - 1  # tokens whose K and V are ever stored: the last one sampled is not run
        where = f"request {request_id}: {len(tokens)} prompt tokens + max_tokens {params.max_tokens}"
        if total > self.runner.context:
            raise ValueError(f"{where} = {total} exceeds the model's context of {self.runner.context} tokens")
        pool_tokens = self.blocks.capacity_tokens
        if (total if config.batch_at_once else longest) > pool_tokens:
            raise ValueError(f"{where} needs more KV than the whole pool holds ({config.num_blocks} blocks of "
                             f"{config.block_size} = {pool_tokens} tokens)")
        if config.policy == "dynamic" and total > config.max_len:
            raise ValueError(f"{where} = {total} is longer than dynamic batching's max_len {config.max_len}: "
                             "the published loop would never take it, and never end")
        if config.policy == "continuous" and longest > config.token_budget:
            raise ValueError(f"{where}: without chunking, a prompt (or its recompute after a preemption, "
                             f"up to {longest} tokens) must fit one step's token_budget {config.token_budget}; "
                             "use policy='chunked' or a larger budget")

    def abort(self, request_id: int) -> bool:
        """Cancel a request; its blocks go back at once. False if it had already ended."""
        request = self._get(request_id)
        if request.is_done:
            return False
        self.scheduler.remove(request)
        self.blocks.drop(request)
        if isinstance(self.runner, SpeculativeRunner):
            self.runner.drafter.forget(request_id)  # its draft model's cache goes too
        request.finish(RequestState.ABORTED, "abort", self.clock())
        return True

    def _get(self, request_id: int) -> Request:
        if request_id not in self.requests:
            known = sorted(self.requests)
            shown = f"{known[:8]}{'...' if len(known) > 8 else ''}" if known else "none yet"
            raise KeyError(f"no request {request_id}; known ids: {shown}")
        return self.requests[request_id]

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step; returns the token each request produced in it (empty if nothing ran)."""
        start = self.clock()
        plan = self.scheduler.schedule(start)
        while not plan and plan.preempted:  # every candidate was preempted; those left can run now
            preempted = plan
            plan = self.scheduler.schedule(start)
            plan.preempted[:0], plan.swapped_out[:0] = preempted.preempted, preempted.swapped_out
        if not plan:
            return []
        kinds = ["decode" if r.output and r.num_uncomputed == 1 else "prefill" for r, _ in plan.batch]
        produced = self.runner.run(plan.batch)
        verdicts = self.runner.verdicts  # request id -> (drafted, accepted) in this step
        work = tuple(Work(r.request_id, kind, n, *verdicts.get(r.request_id, (0, 0)))
                     for (r, n), kind in zip(plan.batch, kinds))
        outputs, finished = [], []
        for request, _ in plan.batch:
            if request.request_id in produced:
                tokens = produced[request.request_id]  # one, or several with speculative decoding
                outputs.extend(StepOutput(request.request_id, token, request.is_done and i == len(tokens) - 1,
                                          request.finish_reason if i == len(tokens) - 1 else None)
                               for i, token in enumerate(tokens))
                if request.is_done:
                    finished.append(request.request_id)
                    self.scheduler.finished(request)
        ids = lambda requests: tuple(r.request_id for r in requests)  # noqa: E731
        self.log.append(StepRecord(
            index=len(self.log), start_s=start, end_s=self.clock(), forward_s=self.runner.forward_s, work=work,
            preempted=ids(plan.preempted), swapped_out=ids(plan.swapped_out), swapped_in=ids(plan.swapped_in),
            finished=tuple(finished), held=ids(plan.held), waiting=len(self.scheduler.waiting),
            free_blocks=self.blocks.pool.num_free, draft_s=getattr(self.runner, "draft_s", 0.0)))
        return outputs

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def _advance(self, next_arrival_s: float | None = None) -> None:
        """One step, or, if nothing can run now, wait for the next arrival or batching deadline."""
        steps = len(self.log)
        self.step()
        if len(self.log) > steps:
            return
        times = [t for t in (next_arrival_s, self.scheduler.next_decision_s(self.clock())) if t is not None]
        if not times:
            stuck = {r.request_id: r.state.value for r in self.requests.values() if not r.is_done}
            raise RuntimeError(f"nothing can run and nothing will arrive, but requests {stuck} are unfinished")
        self.clock.wait_until(min(times))

    # ---- whole runs ------------------------------------------------------------------------------------

    def stream(self, request_id: int) -> Iterator[int]:
        """Yield the request's tokens as they come, stepping the engine (and every other request
        in it) as needed."""
        request, sent = self._get(request_id), 0
        while True:
            while sent < len(request.output):
                sent += 1
                yield request.output[sent - 1]
            if request.is_done:
                return
            self._advance()

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Serve every prompt together; returns each one's output tokens, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling parameters")
        checked = [(self._tokens(p), q or SamplingParams()) for p, q in zip(prompts, params)]
        for i, (tokens, q) in enumerate(checked):  # all or nothing: check every prompt before adding one
            self._check_fits(self._next_id + i, tokens, q)
        ids = [self.add_request(tokens, q) for tokens, q in checked]
        while any(not self.requests[i].is_done for i in ids):
            self._advance()
        return [self.requests[i].output for i in ids]

    def serve(self, workload: list, params: SamplingParams | None = None) -> list[Request]:
        """Replay a timed workload (traffic.TimedRequest: arrival_s after now, prompt, max_tokens),
        adding each request when the clock reaches its arrival; returns its requests in order."""
        params = params or SamplingParams()
        pending = sorted(workload, key=lambda r: r.arrival_s)
        for i, timed in enumerate(pending):
            self._check_fits(self._next_id + i, timed.prompt, SamplingParams(max_tokens=timed.max_tokens))
        origin, ids, position = self.clock(), [], 0
        while position < len(pending) or self.scheduler.has_work:
            now = self.clock()
            while position < len(pending) and origin + pending[position].arrival_s <= now:
                timed = pending[position]
                request_params = SamplingParams(params.temperature, params.top_k, params.top_p,
                                                params.seed + position, timed.max_tokens, params.stop_tokens)
                ids.append(self.add_request(timed.prompt, request_params, arrival_s=origin + timed.arrival_s))
                position += 1
            upcoming = origin + pending[position].arrival_s if position < len(pending) else None
            if self.scheduler.has_work:
                self._advance(upcoming)
            elif upcoming is not None:
                self.clock.wait_until(upcoming)
        return [self.requests[i] for i in ids]
