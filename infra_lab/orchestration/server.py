"""An OpenAI-compatible HTTP server over the book's engine (chapter 06), at the size of
mini-sglang's api_server: FastAPI and uvicorn in front of one EngineLoop.

A request's path: the handler checks the JSON body (openai_api.parse), submits the prompt to the
loop (a full queue answers 429 with Retry-After) and reads the request's token events as the
loop's thread makes them, turning each into text (a character spelled by several tokens waits
for its last one, and text that may begin a stop string waits until it cannot). Streamed, every
event is one server-sent event, and the stream ends with `data: [DONE]`; plain, the whole answer
comes at once. A client that goes away aborts its request: the engine frees it within one step.
POST /admin/weights loads a checked weights file and swaps it in between two steps.
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infra_lab.orchestration import openai_api, weights_file
from infra_lab.orchestration.launch import announce
from infra_lab.orchestration.openai_api import ApiError, Parsed
from infra_lab.orchestration.server_metrics import ServerMetrics
from infra_lab.serving.engine import Engine
from infra_lab.serving.engine_loop import EngineLoop, LoopStopped, Overloaded, TokenEvent

DISCONNECT_POLL_S = 0.02  # how often a plain (not streamed) request looks for its client


class Choice:
    """One of a request's n samples as the client sees it: its tokens, its text, what was sent."""

    def __init__(self, served, stops: tuple[str, ...]):
        self.text_stream, self.stops = served.detokenizer(), stops
        self.hold = max(map(len, stops), default=1) - 1  # characters that could begin a stop string
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list = []
        self.versions: list[int] = []
        self.text, self.sent, self.finish_reason = "", 0, None
        self.last_token_s: float | None = None

    def add(self, event: TokenEvent) -> str:
        """Take one event; the text that may be sent now."""
        if event.token is not None:
            self.tokens.append(event.token)
            self.versions.append(event.weight_version)
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
                self.tops.append(event.top_logprobs or ())
            self.text += self.text_stream.add([event.token])
        if event.finish_reason is None:
            release = len(self.text) - self.hold
        else:
            self.finish_reason = event.finish_reason
            self.text += self.text_stream.finish()
            if event.finish_reason == "stop" and self.stops:  # the text ends before the stop string
                found = [self.text.find(s) for s in self.stops if s in self.text]
                self.text = self.text[:max(min(found), self.sent)] if found else self.text
            release = len(self.text)
        new = self.text[self.sent:release] if release > self.sent else ""
        self.sent = max(self.sent, release)
        return new


class Server:
    """The engine loop, the model it serves and the server's metrics; `app()` is the FastAPI app."""

    def __init__(self, served, config, backend=None, max_queue: int = 256, max_n: int = 16,
                 admin_key: str | None = None, warm_up: bool = True, kv=None):
        """`kv`: a pd_worker.KVRole, for a prefill or decode worker of a disaggregated deployment."""
        self.served, self.max_n, self.admin_key, self.kv = served, max_n, admin_key, kv
        self.metrics = ServerMetrics(served.name, config.num_blocks)
        detokenize = None if served.byte_tokens else served.decode
        engine = Engine(served.model, config, backend, detokenize=detokenize)
        self.loop = EngineLoop(engine, max_waiting=max_queue, on_step=self.metrics.on_step,
                               on_abort=self.metrics.abort_steps.observe)
        self.metrics.watch(self.loop)
        if kv is not None:
            kv.attach(self)
        self.reloading = threading.Lock()
        if warm_up:  # the kernels compile on their first call, not on a client's
            from infra_lab.serving.request import SamplingParams

            self.loop.submit(served.encode("def "), SamplingParams(max_tokens=2)).result()

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        try:
            body = await openai_api.json_body(request)
            transfer = body.pop("kv_transfer_params", None) if isinstance(body, dict) else None
            parsed = openai_api.parse(body, self.served, chat, self.max_n)
            if transfer is not None and self.kv is None:
                raise ApiError(400, "kv_transfer_params need a decode worker (--kv-role decode)",
                               param="kv_transfer_params")
            handle = await self.kv.resume(transfer, parsed) if transfer is not None else self._submit(parsed)
        except ApiError as error:
            self.metrics.outcome("rejected" if error.status == 429 else "invalid")
            return error_response(error)
        request_id = openai_api.new_id(chat)
        choices = [Choice(self.served, parsed.params.stop) for _ in range(parsed.params.n)]
        if parsed.stream:
            return StreamingResponse(self._stream(parsed, handle, request_id, choices, arrived),
                                     media_type="text/event-stream")
        return await self._whole(request, parsed, handle, request_id, choices, arrived)

    def _submit(self, parsed: Parsed, hand_off: bool = False):
        try:
            return self.loop.submit(parsed.prompt, parsed.params, hand_off=hand_off)
        except Overloaded as full:
            raise ApiError(429, str(full), code="rate_limit_exceeded", kind="rate_limit_error",
                           headers={"Retry-After": str(max(1, math.ceil(full.retry_after_s)))}) from None
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        except LoopStopped as error:
            raise ApiError(503, str(error), kind="server_error", code="shutting_down") from None

    def _observe(self, choice: Choice, event: TokenEvent, arrived: float, first: bool) -> None:
        if event.token is None:
            return
        now = time.perf_counter()
        if first:
            self.metrics.ttft_s.observe(now - arrived)
        elif choice.last_token_s is not None:
            self.metrics.itl_s.observe(now - choice.last_token_s)
        choice.last_token_s = now
        self.metrics.generation_tokens.inc()

    async def _stream(self, parsed: Parsed, handle, request_id: str, choices: list[Choice], arrived: float):
        first, ended = True, False
        try:
            if parsed.chat:  # the role comes first, as OpenAI's stream does
                for index in range(len(choices)):
                    yield _sse(self._chunk(parsed, request_id, index, {"role": "assistant", "content": ""}, [0]))
            async for event in handle:
                choice = choices[event.index]
                self._observe(choice, event, arrived, first)
                first = first and event.token is None
                text = choice.add(event)
                if event.token is None and event.finish_reason is None:
                    continue
                logprobs = None
                if parsed.logprobs is not None and event.token is not None:
                    logprobs = openai_api.logprob_entries(parsed, self.served, [event.token], [event.logprob],
                                                          [event.top_logprobs or ()])
                yield _sse(self._chunk(parsed, request_id, event.index, text, [event.weight_version],
                                       logprobs, event.finish_reason))
            if parsed.include_usage:
                yield _sse(openai_api.envelope(request_id, parsed, _versions(choices), chunk=True)
                           | {"choices": [], "usage": self._usage(parsed, handle, choices)})
            yield "data: [DONE]\n\n"
            ended = True
        except LoopStopped as error:
            yield _sse(ApiError(503, str(error), kind="server_error").body())
        finally:
            self._settle(parsed, handle, choices, arrived, ended)

    def _chunk(self, parsed: Parsed, request_id: str, index: int, text, versions, logprobs=None,
               finish_reason=None) -> dict:
        if parsed.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return openai_api.envelope(request_id, parsed, versions, chunk=True) | {"choices": [choice], "usage": None}

    async def _whole(self, request: Request, parsed: Parsed, handle, request_id: str, choices: list[Choice],
                     arrived: float) -> Response:
        ended = False

        async def collect():
            first = True
            async for event in handle:
                self._observe(choices[event.index], event, arrived, first)
                first = first and event.token is None
                choices[event.index].add(event)

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    self.loop.abort(handle.request_id)
            task.result()
            ended = True
        except LoopStopped as error:
            return error_response(ApiError(503, str(error), kind="server_error"))
        finally:
            self._settle(parsed, handle, choices, arrived, ended)
        body = openai_api.envelope(request_id, parsed, _versions(choices), chunk=False)
        body["choices"] = [self._choice(parsed, index, choice) for index, choice in enumerate(choices)]
        body["usage"] = self._usage(parsed, handle, choices)
        return JSONResponse(body)

    def _choice(self, parsed: Parsed, index: int, choice: Choice) -> dict:
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = openai_api.logprob_entries(parsed, self.served, choice.tokens, choice.logprobs, choice.tops)
        out = {"index": index, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        if parsed.chat:
            return out | {"message": {"role": "assistant", "content": choice.text}}
        return out | {"text": choice.text}

    def _usage(self, parsed: Parsed, handle, choices: list[Choice]) -> dict:
        return openai_api.usage(len(parsed.prompt), sum(len(c.tokens) for c in choices), handle.cached_tokens)

    def _settle(self, parsed: Parsed, handle, choices: list[Choice], arrived: float, ended: bool) -> None:
        """After a response, whole or cut: abort what the client left behind, count the outcome."""
        if not handle.done:
            try:
                self.loop.abort(handle.request_id)
            except KeyError:
                pass
        reasons = [c.finish_reason for c in choices]
        outcome = "abort" if not ended or "abort" in reasons else ("stop" if "stop" in reasons else "length")
        self.metrics.outcome(outcome)
        self.metrics.prompt_tokens.inc(len(parsed.prompt))
        self.metrics.cached_tokens.inc(handle.cached_tokens)
        if ended:
            self.metrics.e2e_s.observe(time.perf_counter() - arrived)

    # ---- hot reload ----------------------------------------------------------------------------

    async def reload(self, request: Request) -> Response:
        if self.admin_key is None:
            return error_response(ApiError(403, "hot reload is off: start the server with --admin-key",
                                           kind="permission_error", code="admin_disabled"))
        if request.headers.get("authorization") != f"Bearer {self.admin_key}":
            return error_response(ApiError(401, "the admin endpoints need 'Authorization: Bearer <admin key>'",
                                           kind="authentication_error", code="invalid_api_key"))
        try:
            body = await openai_api.json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("path"), str):
                raise ApiError(400, "the body must be {'path': str, 'sha256': str, 'version': int (optional), "
                                    "'in_flight': 'continue' | 'recompute' (optional)}", param="path")
            return JSONResponse(await asyncio.to_thread(self._reload, body))
        except ApiError as error:
            return error_response(error)

    def _reload(self, body: dict) -> dict:
        """Check the file, lay out its weights (the loop goes on stepping), swap them in between two steps."""
        with self.reloading:
            current = self.loop.engine.weight_version
            version = body.get("version", current + 1)
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ApiError(400, f"version must be a whole number >= 0; got {version!r}", param="version")
            started = time.perf_counter()
            try:
                state, timings = weights_file.read_checked(body["path"], body.get("sha256"),
                                                           self.served.model.config)
                prepare_began = time.perf_counter()
                pause_s = self.loop.update_weights(state, version, body.get("in_flight", "continue"))
            except ValueError as error:
                raise ApiError(400, f"weights refused, still serving version {current}: {error}", param="path",
                               code="weights_refused") from None
            total_s = time.perf_counter() - started
            self.metrics.weight_swap_s.observe(pause_s)
            return {"version": version, "previous_version": current, "pause_s": pause_s, "total_s": total_s,
                    "prepare_and_wait_s": time.perf_counter() - prepare_began - pause_s, **timings}

    # ---- the app --------------------------------------------------------------------------------

    def app(self, on_ready=None) -> FastAPI:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(_):
            if on_ready is not None:
                on_ready()
            yield
            await asyncio.to_thread(self.loop.shutdown, False, 30.0)  # what draining left: aborted

        app = FastAPI(title="infra-lab", lifespan=lifespan)
        served = self.served

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.generate(request, chat=True)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": served.name, "object": "model", "created": 0, "owned_by": "infra-lab",
                "max_model_len": served.context, "weight_version": self.loop.engine.weight_version,
                "about": served.about}]}

        @app.get("/health")
        async def health():
            alive = self.loop._thread.is_alive()
            return JSONResponse({"status": "ok" if alive else "engine loop stopped"}, status_code=200 if alive else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.post("/admin/weights")
        async def admin_weights(request: Request):
            return await self.reload(request)

        if self.kv is not None:
            self.kv.routes(app)
        return app


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _versions(choices: list[Choice]) -> list[int]:
    return sorted({v for c in choices for v in c.versions})


def main(args) -> int:
    """`infra-lab serve`: load the model, start the loop, serve until SIGTERM or Ctrl-C."""
    import uvicorn

    from infra_lab import backend as backends
    from infra_lab.orchestration import pd_worker
    from infra_lab.orchestration import served as served_models
    from infra_lab.serving.config import EngineConfig

    try:
        served = served_models.load(args.model, args.served_model_name, args.weight_version)
        config = EngineConfig(policy=args.policy, max_batch=args.max_batch, token_budget=args.token_budget,
                              num_blocks=args.num_blocks, block_size=args.block_size,
                              prefix_cache=None if args.prefix_cache == "none" else args.prefix_cache)
        backend = backends.resolve(args.backend) if args.backend else backends.current()
        kv = pd_worker.from_args(args)  # a gloo link waits here for every rank of the deployment
    except (ValueError, FileNotFoundError, backends.BackendUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    _limit_blas(args.blas_threads)
    server = Server(served, config, backend, max_queue=args.max_queue, max_n=args.max_n, admin_key=args.admin_key,
                    kv=kv)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    host, port = listener.getsockname()[:2]
    app = server.app(on_ready=lambda: announce(host, port))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.drain_timeout)).run(
        sockets=[listener])
    return 0


def _limit_blas(blas_threads: int) -> None:
    """BLAS's threads: one by default, as the chapters run, since BLAS threads that spin after a
    matmul take the cores numba's next kernel needs. `infra-lab` fixes OpenBLAS's pool (and
    numba's, from --threads) before either loads (cli.main); this holds where BLAS loaded first."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(blas_threads, "blas")
