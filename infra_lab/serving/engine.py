"""The serving engine: requests in, tokens out, one batched forward per step (chapter 05).

`add_request` queues a prompt with its sampling parameters (n samples of it share its KV
blocks); each `step()` asks the scheduler what to run, runs it through the model runner as one
mixed batch, records what it computed in the block manager, and returns what each request
produced, with log-probabilities if asked and the weight version that made each token; a step
that fails in the runner changes no request and no block. `abort` cancels; `update_weights`
swaps the model's weights between steps; `export_request` and `import_request` move a request
to another engine; `stream` yields one request's tokens as they come; `generate` serves a whole
batch of prompts; `serve` replays a timed workload (traffic.TimedRequest) against the clock.
Every step is logged (steplog), and every figure of the chapter is computed from that log and
the requests' timestamps (metrics). The simulator runs this same engine with a runner that times
steps by a roofline model on a virtual clock.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np

from infra_lab import backend as backends
from infra_lab.kv.paged import SequenceKV
from infra_lab.serving.block_manager import BlockManager
from infra_lab.serving.clock import WallClock
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.drafters import Drafter
from infra_lab.serving.request import Request, RequestState, SamplingParams
from infra_lab.serving.runner import ModelRunner, RunnerOutput
from infra_lab.serving.scheduler import Scheduler, StepPlan
from infra_lab.serving.speculative import check_drafter
from infra_lab.serving.speculative_runner import SpeculativeRunner
from infra_lab.serving.steplog import StepRecord, Work


IN_FLIGHT_RULES = ("continue", "recompute")  # what update_weights does to requests that hold KV


@dataclass(frozen=True)
class StepOutput:
    request_id: int  # the id add_request returned (for sample i of n, its first sample's)
    token: int
    finished: bool  # this sample ended with this token
    finish_reason: str | None  # "stop" or "length" when finished
    index: int = 0  # which of the prompt's n samples
    logprob: float | None = None  # the token's log-probability, if the request asked (SamplingParams.logprobs)
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # the likeliest tokens there, with theirs
    weight_version: int = 0  # of the weights that produced the token


def check_in_flight(rule: str) -> None:
    if rule not in IN_FLIGHT_RULES:
        raise ValueError(f"in_flight must be one of {', '.join(map(repr, IN_FLIGHT_RULES))}; got {rule!r}")


def byte_text(tokens: list[int]) -> str:
    """The text of byte tokens (the book's models), for stop strings."""
    return bytes(tokens).decode("utf-8", errors="replace")


class Engine:
    def __init__(self, model=None, config: EngineConfig | None = None, backend: backends.Backend | None = None,
                 *, runner=None, clock=None, scheduler_class: type[Scheduler] = Scheduler,
                 drafter: Drafter | None = None, acceptance_rule=None,
                 detokenize: Callable[[list[int]], str] | None = None):
        """The engine over `model` (a Transformer) on `backend`; a simulator passes its own
        `runner` (with its pool) and `clock` instead of a model. `scheduler_class` may be a
        subclass of Scheduler with a policy of one's own (chapter 05's last exercise). With
        config.num_speculative_tokens = γ > 0, `drafter` proposes γ tokens per decode and
        `acceptance_rule` (speculative.accept_sampling unless given) judges them (chapter 07).
        `detokenize` turns output tokens into text for stop strings (bytes for a 256-token vocabulary)."""
        self.config = config or EngineConfig()
        self.model = model
        self.clock = clock or WallClock()
        gamma = self.config.num_speculative_tokens
        if (drafter is None) != (gamma == 0):
            raise ValueError(f"speculative decoding needs both a drafter and num_speculative_tokens >= 1; got "
                             f"drafter={type(drafter).__name__ if drafter else None}, num_speculative_tokens={gamma}")
        if runner is None:
            if model is None:
                raise ValueError("an engine needs a model, or a runner (the simulator's)")
            backend = backend or backends.current()
            pool = model.new_paged_cache(self.config.num_blocks, self.config.block_size,
                                         prefix_sharing=self.config.prefix_cache == "hash", backend=backend)
            if drafter is not None:
                check_drafter(drafter, model)
                runner = SpeculativeRunner(model, pool, backend, self.clock, drafter, gamma, acceptance_rule)
            else:
                runner = ModelRunner(model, pool, backend, clock=self.clock)
        self.runner = runner
        self.blocks = BlockManager(runner.pool, radix=self.config.prefix_cache == "radix",
                                   host_blocks=self.config.host_blocks)
        self.scheduler = scheduler_class(self.config, self.blocks)
        if detokenize is None and runner.vocab <= 256:
            detokenize = byte_text
        self.detokenize = detokenize
        self.requests: dict[int, Request] = {}  # every request by id, the samples of an n > 1 request too
        self.groups: dict[int, list[Request]] = {}  # an n > 1 request's id -> its n samples, in order
        self.log: list[StepRecord] = []  # every step's record (a long-running service keeps the last ones)
        self.steps = 0  # steps run, all told
        self._next_id = 0

    # ---- requests in ---------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, arrival_s: float | None = None,
                    request_id: int | None = None) -> int:
        """Queue a prompt (text, bytes or token ids); returns its request id. A prompt that can
        never run raises ValueError naming why, and the engine is unchanged. When `max_waiting`
        requests already wait, the request is rejected: it ends at once, aborted, with the reason.
        With params.n > 1 the prompt is computed once; its n samples fork from it (sharing its
        blocks) when it ends, and sample i draws as a one-sample request with seed + i would."""
        params = params or SamplingParams()
        tokens = self._tokens(prompt)
        request_id = self._next_id if request_id is None else int(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is taken; ids must be unique")
        self._check_fits(request_id, tokens, params)
        now = self.clock()
        arrival_s = now if arrival_s is None else arrival_s
        request = Request(request_id, tokens, params, arrival_s=arrival_s, detokenize=self.detokenize)
        self.requests[request_id] = request
        self._next_id = max(self._next_id, request_id + 1)
        if params.n > 1:
            for index in range(1, params.n):
                sample = Request(self._next_id, tokens, params.for_sample(index), arrival_s=arrival_s,
                                 parent_id=request_id, index=index, detokenize=self.detokenize)
                self.requests[sample.request_id], self._next_id = sample, self._next_id + 1
                request.samples.append(sample)
            self.groups[request_id] = [request] + request.samples
        limit = self.config.max_waiting
        if limit is not None and len(self.scheduler.waiting) >= limit:
            for each in self.group(request_id):
                each.finish(RequestState.ABORTED, f"rejected: {limit} requests already wait (max_waiting)", now)
        else:
            self.scheduler.add(request)
        return request_id

    def forget(self, request_id: int) -> None:
        """Drop an ended request (with n > 1, every sample of it) from `requests`: a service that
        runs for long keeps the books of the live ones only."""
        group = self.group(request_id)
        live = [r.request_id for r in group if not r.is_done]
        if live:
            raise ValueError(f"request {request_id} is live (samples {live}); only ended requests are forgotten")
        for request in group:
            del self.requests[request.request_id]
        self.groups.pop(request_id, None)

    def group(self, request_id: int) -> list[Request]:
        """The request's samples, in order: itself alone unless it asked for n > 1."""
        return self.groups.get(request_id) or [self._get(request_id)]

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
        """Raise ValueError naming why a request could never run: the model's context, a stop
        string without a detokenizer, then the scheduler's rules (Scheduler.check_fits)."""
        total = len(tokens) + params.max_tokens
        if total > self.runner.context:
            raise ValueError(f"request {request_id}: {len(tokens)} prompt tokens + max_tokens {params.max_tokens} = "
                             f"{total} exceeds the model's context of {self.runner.context} tokens")
        if params.stop and self.detokenize is None:
            raise ValueError(f"request {request_id}: stop strings {params.stop!r} need a detokenizer; this engine's "
                             f"vocabulary of {self.runner.vocab} tokens is not bytes: pass detokenize=")
        self.scheduler.check_fits(request_id, len(tokens), params)

    def abort(self, request_id: int) -> bool:
        """Cancel a request (with n > 1, every sample of it); its blocks go back at once. False if
        it had already ended."""
        live = [r for r in self.group(request_id) if not r.is_done]
        for request in live:
            self._end(request, "abort")
        return bool(live)

    def _end(self, request: Request, reason: str) -> None:
        """End a request that has not finished: out of every queue, its blocks back, its runner state gone."""
        self.scheduler.remove(request)
        self.blocks.drop(request)
        self.runner.release([request.request_id])
        request.finish(RequestState.ABORTED, reason, self.clock())

    def _get(self, request_id: int) -> Request:
        if request_id not in self.requests:
            known = sorted(self.requests)
            shown = f"{known[:8]}{'...' if len(known) > 8 else ''}" if known else "none yet"
            raise KeyError(f"no request {request_id}; known ids: {shown}")
        return self.requests[request_id]

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step; returns the token each request produced in it (empty if nothing ran).
        If the runner fails, the step never happened: the room reserved for it goes back, and the
        requests admitted for it wait again (requests preempted to make room stay preempted)."""
        start = self.clock()
        plan = self.scheduler.schedule(start)
        while not plan and plan.preempted:  # every candidate was preempted; those left can run now
            preempted = plan
            plan = self.scheduler.schedule(start)
            plan.preempted[:0], plan.swapped_out[:0] = preempted.preempted, preempted.swapped_out
        if not plan:
            return []
        kinds = ["decode" if r.output and r.num_uncomputed == 1 else "prefill" for r, _ in plan.batch]
        try:
            out = self.runner.run(plan.batch)
        except BaseException:
            self._undo(plan)
            raise
        now, outputs, finished = self.clock(), [], []
        for request, _ in plan.batch:
            rid = request.request_id
            self.blocks.record(request, out.computed[rid], out.kept[rid])
            request.num_computed += out.kept[rid]
            forks = [sample for sample in request.samples if sample.request_id in out.tokens]
            for sample in forks:  # the prompt is computed: its other samples start from its blocks
                self.blocks.fork(request, sample)
                self.scheduler.join(sample, now)
            if forks:
                request.samples = []
            for each in [request] + forks:
                if each.request_id in out.tokens:
                    outputs.extend(self._take(each, out, now))
                    if each.is_done:
                        finished.append(each.request_id)
                        self.scheduler.finished(each)
        if finished:
            self.runner.release(finished)
        work = tuple(Work(r.request_id, kind, n, *out.verdicts.get(r.request_id, (0, 0)))
                     for (r, n), kind in zip(plan.batch, kinds))
        ids = lambda requests: tuple(r.request_id for r in requests)  # noqa: E731
        self.log.append(StepRecord(
            index=self.steps, start_s=start, end_s=self.clock(), forward_s=out.forward_s, work=work,
            preempted=ids(plan.preempted), swapped_out=ids(plan.swapped_out), swapped_in=ids(plan.swapped_in),
            finished=tuple(finished), held=ids(plan.held), waiting=len(self.scheduler.waiting),
            free_blocks=self.blocks.pool.num_free, draft_s=out.draft_s))
        self.steps += 1
        return outputs

    def _take(self, request: Request, out: RunnerOutput, now: float) -> list[StepOutput]:
        """The request takes the step's tokens for it (until it finishes); one StepOutput each."""
        rid, version = request.request_id, out.weight_version
        logprobs, tops = out.logprobs.get(rid), out.top_logprobs.get(rid)
        taken = request.extend(out.tokens[rid], now, version, logprobs, tops)
        last = len(taken) - 1
        return [StepOutput(request.group_id, token, request.is_done and i == last,
                           request.finish_reason if i == last else None, request.index,
                           None if logprobs is None else logprobs[i], None if tops is None else tops[i], version)
                for i, token in enumerate(taken)]

    def _undo(self, plan: StepPlan) -> None:
        for request, _ in plan.batch:
            if request.seq is not None:
                self.blocks.unreserve(request)
        for admission in reversed(self.scheduler.admitted):
            self.scheduler.unadmit(*admission)

    # ---- requests that move between engines -------------------------------------------------------

    def export_request(self, request_id: int) -> tuple[dict, SequenceKV | None]:
        """Take a request out of this engine to go on in another: its state as plain data (prompt,
        output, parameters, its generator's state, weight versions, log-probabilities) and the K
        and V of its computed tokens (None if it holds none: the other engine recomputes them).
        Here it ends with finish reason "exported" and its blocks go back."""
        request = self._get(request_id)
        if request.is_done:
            raise ValueError(f"request {request_id} has ended ({request.finish_reason}); only live requests move")
        if request.samples:
            raise ValueError(f"request {request_id}'s {len(request.samples)} other samples have not started from its "
                             "prompt yet; export it once its prompt is computed")
        kv = self.blocks.pool.export_sequence(request.seq) if request.seq is not None and request.num_computed \
            else None
        state = self.request_state(request_id) | {"num_computed": len(kv.tokens) if kv else 0}
        self._end(request, "exported")
        return state, kv

    def request_state(self, request_id: int) -> dict:
        """A request as plain data (what export_request sends): prompt, output, parameters, its
        generator's state, weight versions, log-probabilities; an ended one also its finish reason."""
        request = self._get(request_id)
        p = request.params
        state = {
            "model": asdict(self.runner.config), "prompt": list(request.prompt), "output": list(request.output),
            "params": asdict(p) | {"stop_tokens": list(p.stop_tokens), "stop": list(p.stop)},
            "rng": request.rng.bit_generator.state, "num_computed": 0,
            "versions": list(request.versions), "logprobs": list(request.logprobs),
            "top_logprobs": [[list(pair) for pair in top] for top in request.top_logprobs],
            "preemptions": request.preemptions, "cached_tokens": request.cached_tokens, "index": request.index}
        return state | ({"finish_reason": request.finish_reason} if request.is_done else {})

    def import_request(self, state: dict, kv: SequenceKV | None = None, request_id: int | None = None) -> int:
        """Go on with a request another engine exported (export_request); returns its id here.
        With its K and V it joins the running batch as it was; without, it waits to compute its
        prompt and output again. A state for another model, K and V that do not fit this pool
        or do not hold its tokens, or no room in the pool raise by name; nothing changes."""
        if not isinstance(state, dict) or not {"model", "prompt", "output", "params", "rng"} <= set(state):
            raise ValueError("an imported state is the dict export_request made; got "
                             f"{type(state).__name__} with keys {sorted(state) if isinstance(state, dict) else '-'}")
        if state.get("finish_reason") is not None:
            raise ValueError(f"the request has ended ({state['finish_reason']}); there is nothing to go on with")
        mine = asdict(self.runner.config)
        if state["model"] != mine:
            differ = {k: (state["model"].get(k), mine[k]) for k in mine if state["model"].get(k) != mine[k]}
            raise ValueError(f"the request ran on another model: (theirs, this engine's) {differ}")
        p = state["params"]
        params = SamplingParams(**p | {"stop_tokens": tuple(p["stop_tokens"]), "stop": tuple(p["stop"])})
        tokens = self._tokens(state["prompt"])
        output = [int(t) for t in state["output"]]
        request_id = self._next_id if request_id is None else int(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is taken; ids must be unique")
        self._check_fits(request_id, tokens, params)
        if kv is not None:
            if tuple(kv.tokens) != tuple((tokens + output)[:len(kv.tokens)]) or not 0 < len(kv.tokens) <= \
                    len(tokens) + len(output) - 1:
                raise ValueError(f"the K and V hold {len(kv.tokens)} tokens that are not the first of request "
                                 f"{request_id}'s {len(tokens)} prompt and {len(output)} output tokens (less the last)")
            if self.config.batch_at_once:
                raise ValueError(f"a request with its K and V joins the running batch; the {self.config.policy!r} "
                                 "policy fixes a batch when it starts: import it without them to recompute")
        now = self.clock()
        request = Request(request_id, tokens, params, arrival_s=now, detokenize=self.detokenize,
                          output=output, versions=[int(v) for v in state.get("versions", [])],
                          logprobs=[float(x) for x in state.get("logprobs", [])],
                          top_logprobs=[tuple((int(t), float(x)) for t, x in top)
                                        for top in state.get("top_logprobs", [])],
                          preemptions=int(state.get("preemptions", 0)),
                          cached_tokens=int(state.get("cached_tokens", 0)), index=int(state.get("index", 0)))
        request.rng.bit_generator.state = state["rng"]
        if kv is not None:
            self.blocks.adopt(request, kv)  # raises, changing nothing, if the pool is short or the layout differs
            self.scheduler.join(request, now)
        else:
            self.scheduler.add(request)
        self.requests[request_id] = request
        self._next_id = max(self._next_id, request_id + 1)
        return request_id

    # ---- weights -----------------------------------------------------------------------------------

    def update_weights(self, state: dict, version: int, in_flight: str = "continue") -> None:
        """Serve the weights `state` (name -> array, every weight of the model) as `version`,
        from the next step on. Checked first: a missing, extra or misshapen weight, or one that is
        not finite, raises ValueError naming it, and nothing changes. The prefix cache is flushed
        (its K and V came from the old weights). Requests in flight: "continue" keeps their K and V
        and goes on with the new weights (each token records its version), "recompute" sends every
        request holding K and V back to compute its prompt and output again on the new weights."""
        if self.model is None:
            raise ValueError("this engine runs without a model (the simulator's); it has no weights to update")
        check_in_flight(in_flight)
        self.apply_weights(self.model.prepare_weights(state, version), in_flight)

    def apply_weights(self, prepared, in_flight: str = "continue") -> None:
        """Swap in weights that `model.prepare_weights` checked and laid out (perhaps in another
        thread, while the engine ran): the between-steps part of update_weights."""
        check_in_flight(in_flight)
        if in_flight == "recompute":
            self.scheduler.recompute_all()
        self.blocks.flush_prefix_cache()
        self.model.swap_weights(prepared)

    @property
    def weight_version(self) -> int:
        return self.runner.weight_version

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def _advance(self, next_arrival_s: float | None = None) -> None:
        """One step, or, if nothing can run now, wait for the next arrival or batching deadline."""
        steps = self.steps
        self.step()
        if self.steps > steps:
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
        """Serve every prompt together; returns each one's output tokens, in order (with n > 1,
        its first sample's: `group(id)` holds them all)."""
        ids = self.add_requests(prompts, params)
        while any(not self.requests[i].is_done for i in ids):
            self._advance()
        return [self.requests[i].output for i in ids]

    def add_requests(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[int]:
        """Queue every prompt, or none: each is checked (add_request's rules) before any is added."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling parameters")
        checked = [(self._tokens(p), q or SamplingParams()) for p, q in zip(prompts, params)]
        next_id = self._next_id
        for tokens, q in checked:
            self._check_fits(next_id, tokens, q)
            next_id += q.n
        return [self.add_request(tokens, q) for tokens, q in checked]

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
                request_params = replace(params, seed=params.seed + position, max_tokens=timed.max_tokens)
                ids.append(self.add_request(timed.prompt, request_params, arrival_s=origin + timed.arrival_s))
                position += 1
            upcoming = origin + pending[position].arrival_s if position < len(pending) else None
            if self.scheduler.has_work:
                self._advance(upcoming)
            elif upcoming is not None:
                self.clock.wait_until(upcoming)
        return [self.requests[i] for i in ids]
