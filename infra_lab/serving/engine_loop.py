"""The engine as a service: one thread steps the engine, any thread or asyncio task submits
requests and reads their tokens as they come (what chapter 06's HTTP server and chapter 11's
rollouts stand on).

`Engine` is single-threaded: `add_request`, `step` and `abort` change its queues and its KV
pool. `EngineLoop` owns an engine and is the only caller of those three, from its own thread.
Other threads hand it requests and aborts through an inbox under a lock and wake it with a
condition; the loop takes the inbox between steps, so a step never sees a half-added request.
With nothing to run it sleeps on the condition (no busy wait), or until the scheduler's next
decision (a dynamic batch's deadline).

Each request gets a `RequestHandle`: iterate it, with `for` in a thread or `async for` in a
task, for its `TokenEvent`s (token, log-probability, weight version, finish reason, and which of
n samples); each sample's last event carries its finish reason. `update_weights` checks and lays
out new weights in the caller's thread and swaps them in between two steps; `export` and
`import_request` move a request, with its K and V, to another loop's engine. Requests take the
caller's string id or a generated one. A server watches the loop through two callbacks, run in
the loop's thread: `on_step(record)` after every step (its StepRecord), and `on_abort(steps)`
when an abort takes effect, with the steps the engine ran between the call and then (0 or 1).
When `max_waiting` requests already wait, `submit` raises `Overloaded` with an estimate of when
to retry. `shutdown(drain=True)` serves what was submitted and stops the thread;
`shutdown(drain=False)` aborts it.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import NamedTuple

from infra_lab.serving.engine import check_in_flight
from infra_lab.serving.request import SamplingParams


class TokenEvent(NamedTuple):  # a tuple: made once per token per request, in the loop's thread
    token: int | None  # None only for the event that ends an aborted (or exported) sample
    logprob: float | None  # the token's log-probability, if the request asked (SamplingParams.logprobs)
    weight_version: int  # of the weights that produced the token
    finish_reason: str | None  # None until the sample's last event: "stop", "length", "abort"
    index: int = 0  # which of the request's n samples
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # the likeliest tokens there, with theirs


class Overloaded(RuntimeError):
    """The waiting queue is full; `retry_after_s` estimates when a place frees up."""

    def __init__(self, waiting: int, limit: int, retry_after_s: float):
        self.waiting, self.limit, self.retry_after_s = waiting, limit, retry_after_s
        super().__init__(f"overloaded: {waiting} requests already wait (max_waiting {limit}); "
                         f"retry after about {retry_after_s:.3g} s")


class LoopStopped(RuntimeError):
    """The loop takes no new requests: it was shut down, or its thread failed (the cause is chained)."""


class RequestHandle:
    """One request's events, written by the loop's thread and read by any number of readers
    (each iteration starts from the first event). With n samples, the events of all of them,
    in the order they were made; it ends when every sample has."""

    def __init__(self, request_id: str, n: int = 1):
        self.request_id = request_id
        self.finish_reasons: list[str | None] = [None] * n  # each sample's, once it ends
        self._events: list[TokenEvent] = []
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._engine_id: int | None = None  # set by the loop's thread when the engine takes it
        self.cached_tokens = 0  # prompt tokens a prefix cache served, set when the request ends
        self.hand_off = False  # leaves the engine after its first token (submit's hand_off)
        self.moved: tuple | None = None  # then: (its state, its K and V or None), before its last event

    @property
    def finish_reason(self) -> str | None:
        """The first sample's finish reason (None until it ends)."""
        return self.finish_reasons[0]

    @property
    def samples(self) -> list[list[int]]:
        """Each sample's tokens so far."""
        with self._changed:
            out = [[] for _ in self.finish_reasons]
            for event in self._events:
                if event.token is not None:
                    out[event.index].append(event.token)
            return out

    @property
    def tokens(self) -> list[int]:
        """The first sample's tokens so far."""
        return self.samples[0]

    @property
    def events(self) -> list[TokenEvent]:
        with self._changed:
            return list(self._events)

    @property
    def done(self) -> bool:
        with self._changed:
            return self._ended or self._error is not None

    @property
    def _ended(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def _push(self, events: list[TokenEvent] = (), error: BaseException | None = None) -> None:
        with self._changed:
            self._events.extend(events)
            for event in events:
                if event.finish_reason is not None:
                    self.finish_reasons[event.index] = event.finish_reason
            if error is not None and not self._ended:
                self._error = error
            self._changed.notify_all()
            wakers = list(self._wakers)
        for loop, changed in wakers:
            loop.call_soon_threadsafe(changed.set)

    def _after(self, seen: int) -> tuple[list[TokenEvent], bool, BaseException | None]:
        """Events after the first `seen`, whether the request has ended, its error."""
        return self._events[seen:], self._ended, self._error

    @staticmethod
    def _over(new: list, ended: bool, error: BaseException | None) -> bool:
        """After `new` is handed out: raise the loop's error, or say whether nothing more comes."""
        if error is not None:
            raise error
        return ended and not new

    def __iter__(self):
        seen = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self._events) > seen or self.done)
                new, ended, error = self._after(seen)
            for event in new:
                seen += 1
                yield event
            if self._over(new, ended, error):
                return

    async def _events_async(self):
        loop, changed = asyncio.get_running_loop(), asyncio.Event()
        with self._changed:
            self._wakers.append((loop, changed))
        seen = 0
        try:
            while True:
                changed.clear()  # before reading: a push after the read sets it again
                with self._changed:
                    new, ended, error = self._after(seen)
                for event in new:
                    seen += 1
                    yield event
                if self._over(new, ended, error):
                    return
                if not new:
                    await changed.wait()
        finally:
            with self._changed:
                self._wakers.remove((loop, changed))

    def __aiter__(self):
        return self._events_async()

    def result(self, timeout_s: float | None = None) -> list[int]:
        """Wait for the request to end; its tokens."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout_s):
                raise TimeoutError(f"request {self.request_id!r} did not end within {timeout_s} s")
            if self._error is not None:
                raise self._error
        return self.tokens


class EngineLoop:
    def __init__(self, engine, max_waiting: int = 256, start: bool = True, keep_finished: int = 1024,
                 keep_steps: int = 10_000, on_step=None, on_abort=None):
        """Serve `engine` from a thread of its own. `max_waiting`: submitted requests that may wait
        for their first step before `submit` raises Overloaded. `start=False` leaves the thread
        unstarted until `start()` (requests queue meanwhile). A service runs for long, so the loop
        keeps the books of the last `keep_finished` ended requests (older ones are forgotten, here
        and in the engine: their ids may be used again) and the engine's last `keep_steps` step
        records. `on_step` and `on_abort` are called in the loop's thread (module docstring)."""
        for name, value in (("max_waiting", max_waiting), ("keep_finished", keep_finished),
                            ("keep_steps", keep_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
        if engine.has_unfinished:
            raise ValueError("the engine already has requests in flight; a loop must be its only caller")
        self.engine, self.max_waiting = engine, max_waiting
        self.keep_finished, self.keep_steps = keep_finished, keep_steps
        self._ended: deque[str] = deque()  # ids of ended requests, oldest first (the loop's thread's own)
        self._wake = threading.Condition()
        self._inbox: list[tuple] = []  # ("add", handle, tokens, params), ("abort", request id), or work
        # between two steps with a future for its result: ("weights" | "export" | "import", *args, future)
        self._handles: dict[str, RequestHandle] = {}  # live requests and the last keep_finished ended, by id
        self._live: dict[int, RequestHandle] = {}  # engine id -> handle, until the request ends
        self._waiting = 0  # submitted and not yet run: in the inbox or waiting in the engine
        self._queued = 0  # of them, in the inbox
        self._unstarted: set[int] = set()  # of them, in the engine (the loop's thread's own)
        self._stopping: str | None = None  # "drain" or "abort" once shutdown is called
        self._failure: BaseException | None = None
        self._ids = itertools.count()
        self._finishes: deque[float] = deque(maxlen=64)  # when recent requests ended (perf_counter)
        self._step_s: deque[float] = deque(maxlen=64)  # recent step times
        self.weight_swaps: deque[tuple[float, float]] = deque(maxlen=keep_steps)  # recent weight updates in the
        # loop's thread: (when each began on the engine's clock, seconds it took)
        self.on_step, self.on_abort = on_step, on_abort
        self._abort_asked: dict[str, int] = {}  # request id -> engine.steps when abort was called
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------------

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               hand_off: bool = False) -> RequestHandle:
        """Queue a prompt (text, bytes or token ids); returns its handle at once. A prompt that can
        never run raises ValueError naming why, a taken id ValueError, a full queue Overloaded,
        a stopped loop LoopStopped; none of them changes anything. With `hand_off`, the request
        leaves the engine in the step that makes its first token (a prefill worker's job, chapter
        06): `handle.moved` holds (its state, its K and V) and it ends with reason "exported", or,
        if that token ended it, (its state with its finish reason, None) and it ends as it did."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams; got {type(params).__name__}")
        if hand_off and params.n != 1:
            raise ValueError(f"a request handed off after its first token moves one sample; got n={params.n}")
        tokens = self.engine._tokens(prompt)  # reads the model's vocabulary only: safe beside a step
        with self._wake:
            self._check_running()
            request_id = self._new_id() if request_id is None else request_id
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"a request id must be a non-empty string; got {request_id!r}")
            if request_id in self._handles:
                raise ValueError(f"request id {request_id!r} is taken; ids must be unique")
            self.engine._check_fits(request_id, tokens, params)  # the config's rules: safe beside a step
            if self._waiting >= self.max_waiting:
                raise Overloaded(self._waiting, self.max_waiting, self._retry_after_s(params))
            handle = RequestHandle(request_id, params.n)
            handle.hand_off = hand_off
            self._handles[request_id] = handle
            self._inbox.append(("add", handle, tokens, params))
            self._waiting += 1
            self._queued += 1
            self._wake.notify()
        return handle

    def abort(self, request_id: str) -> bool:
        """Cancel a request from any thread; it ends within one step with finish reason "abort".
        False if it had already ended; an unknown id raises KeyError."""
        with self._wake:
            if request_id not in self._handles:
                raise KeyError(f"no request {request_id!r}")
            if self._handles[request_id].done:
                return False
            self._inbox.append(("abort", request_id))
            self._abort_asked.setdefault(request_id, self.engine.steps)
            self._wake.notify()
        return True

    def update_weights(self, state: dict, version: int, in_flight: str = "continue",
                       timeout_s: float | None = None) -> float:
        """Serve new weights from the next step on (Engine.update_weights: checked by name first,
        the prefix cache flushed, requests in flight continued or recomputed). The checking and
        the derived copies are made here, in the caller's thread, while the loop goes on stepping;
        the loop's thread only swaps them in between two steps. Returns once they serve, with the
        seconds the swap took in the loop's thread (the pause the update put between two steps)."""
        if self.engine.model is None:
            raise ValueError("this engine runs without a model (the simulator's); it has no weights to update")
        check_in_flight(in_flight)
        prepared = self.engine.model.prepare_weights(state, version)  # raises by name; nothing changed
        return self._between_steps("weights", prepared, in_flight, timeout_s=timeout_s)

    def export(self, request_id: str, timeout_s: float | None = None) -> tuple:
        """Take a live one-sample request out of the engine between two steps, to go on in another
        (Engine.export_request): (state as plain data, its K and V). Its handle here ends with
        finish reason "exported"."""
        with self._wake:
            if request_id not in self._handles:
                raise KeyError(f"no request {request_id!r}")
            samples = len(self._handles[request_id].finish_reasons)
            if samples > 1:
                raise ValueError(f"request {request_id!r} has {samples} samples; requests move one sample at a time")
        return self._between_steps("export", request_id, timeout_s=timeout_s)

    def import_request(self, state: dict, kv=None, request_id: str | None = None,
                       timeout_s: float | None = None, replay: bool = False) -> RequestHandle:
        """Go on with a request another engine exported (Engine.import_request); returns its handle,
        which streams the tokens made here, and with `replay` first those it brought (a decode
        worker streams the prefill worker's first token). A state that has ended (a hand-off
        whose first token finished it) only replays. Raises as Engine.import_request does,
        changing nothing."""
        with self._wake:
            self._check_running()
            request_id = self._new_id() if request_id is None else request_id
            if not isinstance(request_id, str) or not request_id or request_id in self._handles:
                raise ValueError(f"a request id must be a new, non-empty string; got {request_id!r}")
            handle = RequestHandle(request_id)
            self._handles[request_id] = handle
        brought = _brought_events(state) if replay else []
        if replay and isinstance(state, dict) and state.get("finish_reason") is not None:
            last = brought.pop() if brought else TokenEvent(None, None, 0, None)
            handle._push(brought + [last._replace(finish_reason=state["finish_reason"])])
            with self._wake:
                self._ended.append(request_id)
            return handle
        handle._push(brought)
        try:
            self._between_steps("import", handle, state, kv, timeout_s=timeout_s)
        except BaseException:
            with self._wake:
                del self._handles[request_id]
            raise
        return handle

    def _between_steps(self, kind: str, *args, timeout_s: float | None = None):
        """Have the loop's thread do `kind` between two steps; its result, or its error raised here."""
        done: Future = Future()
        with self._wake:
            self._check_running()
            self._inbox.append((kind, *args, done))
            self._wake.notify()
        return done.result(timeout_s)

    def shutdown(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop taking requests; serve those submitted (drain) or abort them, then stop the thread."""
        with self._wake:
            self._stopping = self._stopping or ("drain" if drain else "abort")
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine loop did not stop within {timeout_s} s")
        elif not self._thread.ident:  # never started: end what was queued
            for item in self._take_inbox():
                if item[0] == "add":
                    item[1]._push(self._endings(item[1], "abort"))
                elif item[0] != "abort":
                    item[-1].set_exception(LoopStopped("the engine loop was shut down before it started"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(drain=exc[0] is None)

    @property
    def waiting(self) -> int:
        with self._wake:
            return self._waiting

    def _new_id(self) -> str:
        while (request_id := f"req-{next(self._ids)}") in self._handles:
            pass
        return request_id

    def _check_running(self) -> None:
        if self._failure is not None:
            raise LoopStopped("the engine loop failed; it takes no new requests") from self._failure
        if self._stopping is not None:
            raise LoopStopped("the engine loop is shut down; it takes no new requests")

    def _retry_after_s(self, params: SamplingParams) -> float:
        """Seconds until a waiting place frees up: one request's share of the recent finishing
        rate, or, before any request has finished, its max_tokens steps at the recent step time."""
        if len(self._finishes) >= 2 and self._finishes[-1] > self._finishes[0]:
            return (self._finishes[-1] - self._finishes[0]) / (len(self._finishes) - 1)
        step_s = sum(self._step_s) / len(self._step_s) if self._step_s else 0.01
        return step_s * params.max_tokens

    # ---- the loop's thread ---------------------------------------------------------------------

    def _take_inbox(self) -> list[tuple]:
        with self._wake:
            inbox, self._inbox, self._queued = self._inbox, [], 0
            return inbox

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._inbox and not engine.has_unfinished and self._stopping is None:
                        self._wake.wait()  # idle: sleep until a submit, an abort or a shutdown
                    stopping = self._stopping
                self._apply(self._take_inbox())
                if stopping == "abort":
                    for engine_id in list(self._live):
                        self._abort(engine_id)
                    return
                if not engine.has_unfinished:
                    if stopping == "drain":
                        return
                    continue
                self._step()
        except BaseException as error:  # noqa: BLE001 - every reader must hear of it
            with self._wake:
                self._failure = error
                handles = list(self._live.values()) + [i[1] for i in self._inbox if i[0] == "add"]
                updates = [i[-1] for i in self._inbox if i[0] not in ("add", "abort")]
                self._inbox = []
            for handle in handles:
                handle._push(error=LoopStopped(f"the engine loop failed: {error!r}"))
            for applied in updates:
                applied.set_exception(LoopStopped(f"the engine loop failed: {error!r}"))

    def _apply(self, inbox: list[tuple]) -> None:
        engine = self.engine
        for item in inbox:
            if item[0] == "add":
                _, handle, tokens, params = item
                handle._engine_id = engine.add_request(tokens, params)
                self._live[handle._engine_id] = handle
                self._unstarted.add(handle._engine_id)
                request = engine.requests[handle._engine_id]
                if request.is_done:  # rejected by the engine's own max_waiting
                    self._end(handle._engine_id, self._endings(handle, request.finish_reason))
            elif item[0] in ("weights", "export", "import"):
                try:
                    item[-1].set_result(getattr(self, "_" + item[0])(*item[1:-1]))
                except Exception as error:  # noqa: BLE001 - the caller hears of it, the loop goes on
                    item[-1].set_exception(error)
            elif item[1] in self._handles and self._handles[item[1]]._engine_id in self._live:
                self._abort(self._handles[item[1]]._engine_id)
        self._recount()

    def _recount(self) -> None:
        """Requests that have not run yet: queued in the inbox, or waiting for their first step."""
        requests = self.engine.requests
        self._unstarted = {i for i in self._unstarted if i in self._live and requests[i].admitted_s is None}
        with self._wake:
            self._waiting = self._queued + len(self._unstarted)

    def _weights(self, prepared, in_flight: str) -> float:
        began, started = self.engine.clock(), time.perf_counter()
        self.engine.apply_weights(prepared, in_flight)
        self.weight_swaps.append((began, time.perf_counter() - started))
        return self.weight_swaps[-1][1]

    def _export(self, request_id: str) -> tuple:
        handle = self._handles.get(request_id)
        if handle is None:
            raise KeyError(f"no request {request_id!r}")
        if handle._engine_id not in self._live:
            raise ValueError(f"request {request_id!r} has ended ({handle.finish_reason}); only live requests move")
        moved = self.engine.export_request(handle._engine_id)
        self._end(handle._engine_id, self._endings(handle, "exported"))
        return moved

    def _import(self, handle: RequestHandle, state: dict, kv) -> None:
        handle._engine_id = self.engine.import_request(state, kv)
        self._live[handle._engine_id] = handle

    def _abort(self, engine_id: int) -> None:
        handle = self._live[engine_id]
        with self._wake:
            asked = self._abort_asked.pop(handle.request_id, None)
        self.engine.abort(engine_id)
        self._end(engine_id, self._endings(handle, "abort"))
        if asked is not None and self.on_abort is not None:
            self.on_abort(self.engine.steps - asked)

    def _endings(self, handle: RequestHandle, reason: str) -> list[TokenEvent]:
        """One token-less event per sample of `handle` that has not ended, with `reason`."""
        version = self.engine.weight_version
        return [TokenEvent(None, None, version, reason, index)
                for index, done in enumerate(handle.finish_reasons) if done is None]

    def _end(self, engine_id: int, events: list[TokenEvent]) -> None:
        handle = self._live.pop(engine_id)
        request = self.engine.requests.get(engine_id)
        handle.cached_tokens = request.cached_tokens if request is not None else 0
        with self._wake:
            self._finishes.append(time.perf_counter())
            self._abort_asked.pop(handle.request_id, None)
        handle._push(events)
        self._ended.append(handle.request_id)
        while len(self._ended) > self.keep_finished:  # the oldest ended request leaves the books
            old = self._ended.popleft()
            with self._wake:
                forgotten = self._handles.pop(old)
            if forgotten._engine_id is not None and forgotten._engine_id in self.engine.requests:
                self.engine.forget(forgotten._engine_id)

    def _step(self) -> None:
        engine, steps = self.engine, self.engine.steps
        started = time.perf_counter()
        outputs = engine.step()
        if len(engine.log) > 2 * self.keep_steps:
            del engine.log[:-self.keep_steps]
        if engine.steps == steps:  # nothing could run: wait for the scheduler's next decision
            deadline = engine.scheduler.next_decision_s(engine.clock())
            with self._wake:
                if not self._inbox and self._stopping is None:
                    self._wake.wait(None if deadline is None else max(0.0, deadline - engine.clock()))
            return
        self._step_s.append(time.perf_counter() - started)
        if self.on_step is not None:
            self.on_step(engine.log[-1])
        events: dict[int, list[TokenEvent]] = {}
        for out in outputs:
            events.setdefault(out.request_id, []).append(TokenEvent(
                out.token, out.logprob, out.weight_version, out.finish_reason if out.finished else None, out.index,
                out.top_logprobs))
        groups = engine.groups
        for engine_id, produced in events.items():
            ended = (all(request.is_done for request in groups[engine_id]) if engine_id in groups
                     else produced[-1].finish_reason is not None)
            handle = self._live[engine_id]
            if handle.hand_off:  # a prefill worker's request leaves with its first token
                handle.moved = (engine.request_state(engine_id), None) if ended else None
                if not ended:
                    handle._push(produced)
                    handle.moved = engine.export_request(engine_id)
                    produced = self._endings(handle, "exported")
                self._end(engine_id, produced)
            elif ended:
                self._end(engine_id, produced)
            else:
                handle._push(produced)
        self._recount()


def _brought_events(state: dict) -> list[TokenEvent]:
    """The events of the tokens an exported request made before it moved."""
    if not isinstance(state, dict) or not state.get("output"):
        return []
    output, versions = state["output"], state.get("versions") or [0] * len(state["output"])
    logprobs = state.get("logprobs") or [None] * len(output)
    tops = state.get("top_logprobs") or [None] * len(output)
    return [TokenEvent(int(t), lp, int(v), None, 0, None if top is None else tuple(tuple(p) for p in top))
            for t, lp, v, top in zip(output, logprobs, versions, tops)]
