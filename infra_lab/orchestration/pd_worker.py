"""A server's part in a disaggregated deployment (chapter 06): `infra-lab serve --kv-role prefill`
or `--kv-role decode`, as vLLM's `--kv-transfer-config` names a producer and a consumer.

A prefill worker answers `POST /kv/prefill`: an OpenAI request body with `kv_transfer_params`
{"transfer_id": str, "decode_rank": int (gloo)}. It computes the prompt and the first token
(EngineLoop.submit with hand_off: the request leaves the engine in that step, so a prefill
worker never decodes), sends the request's state and K and V (kv_transfer's wire format) and
answers {"transfer_id", "kv_bytes", "kv_tokens", "send_s"} once they are sent. Its blocks went
back to its pool when the request left the engine: a decode worker that dies mid-transfer
cannot leave them held.

A decode worker takes the same OpenAI body at /v1/completions or /v1/chat/completions with
`kv_transfer_params` {"transfer_id": str}: it claims the transfer, checks that it fits (model,
block size, K and V layout and dtype; kv_transfer.check) before its pool is touched, splices the
K and V into its own block table (EngineLoop.import_request) and streams the answer from the
first token on, as one engine would have.
"""
from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram

from infra_lab.orchestration import kv_transfer
from infra_lab.orchestration.openai_api import ApiError
from infra_lab.orchestration.server_metrics import LATENCY_BUCKETS_S

ROLES = ("prefill", "decode")


class KVRole:
    """What a prefill or decode worker adds to `infra-lab serve`: its link, its endpoint, its metrics."""

    def __init__(self, role: str, transport: str, timeout_s: float = 30.0, rank: int | None = None,
                 world: int | None = None, master: str | None = None):
        if role not in ROLES:
            raise ValueError(f"kv role must be one of {ROLES}; got {role!r}")
        if transport not in kv_transfer.TRANSPORTS:
            raise ValueError(f"kv transport must be one of {kv_transfer.TRANSPORTS}; got {transport!r}")
        if not timeout_s > 0:
            raise ValueError(f"the transfer time limit must be > 0 s; got {timeout_s}")
        if transport == "gloo" and (rank is None or world is None or not master):
            raise ValueError("the gloo transport needs --kv-rank, --kv-world and --kv-master (host:port)")
        self.role, self.transport, self.timeout_s, self.rank = role, transport, timeout_s, rank
        self.link = kv_transfer.GlooLink(rank, world, master, receive=role == "decode", timeout_s=timeout_s) \
            if transport == "gloo" else kv_transfer.SharedMemoryLink(stale_after_s=timeout_s)
        self.server = None

    def attach(self, server) -> None:
        """Join `server` (server.Server): its loop, its model, its metrics registry."""
        self.server = server
        registry, labels = server.metrics.registry, list(server.metrics.labels)
        self._labels = server.metrics.labels
        self.transfers = Counter("infra_lab_kv_transfers", "KV transfers by outcome: sent, received, failed "
                                 "(the peer is gone), timed_out, refused (does not fit this engine)",
                                 labels + ["outcome"], registry=registry)
        self.bytes = Counter("infra_lab_kv_transfer_bytes", "Bytes of K and V sent or received", labels,
                             registry=registry).labels(**self._labels)
        self.seconds = Histogram("infra_lab_kv_transfer_seconds", "Seconds to send one transfer (prefill) or to "
                                 "claim it (decode)", labels, buckets=LATENCY_BUCKETS_S,
                                 registry=registry).labels(**self._labels)

    def count(self, outcome: str) -> None:
        self.transfers.labels(**self._labels, outcome=outcome).inc()

    def routes(self, app: FastAPI) -> None:
        @app.get("/kv/info")
        async def info():
            return {"role": self.role, "transport": self.transport, "rank": self.rank,
                    "block_size": self.server.loop.engine.blocks.block_size}

        if self.role == "prefill":
            @app.post("/kv/prefill")
            async def prefill(request: Request):
                try:
                    return JSONResponse(await self.prefill(request))
                except ApiError as error:
                    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    # ---- the prefill side ------------------------------------------------------------------------

    async def prefill(self, request: Request) -> dict:
        from infra_lab.orchestration import openai_api

        body = await openai_api.json_body(request)
        params = body.pop("kv_transfer_params", None) if isinstance(body, dict) else None
        transfer_id, decode_rank = _transfer_params(params, need_rank=self.transport == "gloo")
        chat = isinstance(body, dict) and "messages" in body
        parsed = openai_api.parse(body, self.server.served, chat, self.server.max_n)
        if parsed.params.n != 1:
            raise ApiError(400, f"a disaggregated request moves one sample; got n={parsed.params.n}", param="n")
        handle = self.server._submit(parsed, hand_off=True)
        async for _ in handle:
            pass
        if handle.moved is None:  # rejected by the engine's queue limit
            raise ApiError(503, f"the prefill worker ended the request ({handle.finish_reason})",
                           kind="server_error", code="prefill_failed")
        state, kv = handle.moved
        header, payload = kv_transfer.pack(transfer_id, state, kv, self.server.loop.engine.blocks.block_size)
        started = time.perf_counter()
        try:
            if self.transport == "gloo":
                await asyncio.to_thread(self.link.send, decode_rank, header, payload, self.timeout_s)
            else:
                await asyncio.to_thread(self.link.send, transfer_id, header, payload)
        except kv_transfer.TransferFailed as error:
            self.count("failed")
            raise ApiError(503, f"kv transfer {transfer_id} failed: {error}", kind="server_error",
                           code="kv_transfer_failed") from None
        except FileExistsError:
            raise ApiError(409, f"transfer id {transfer_id!r} is in use", param="kv_transfer_params") from None
        send_s = time.perf_counter() - started
        self.count("sent")
        self.bytes.inc(payload.size)
        self.seconds.observe(send_s)
        return {"transfer_id": transfer_id, "kv_bytes": int(payload.size), "kv_tokens": len(kv.tokens) if kv else 0,
                "header_bytes": len(header), "send_s": send_s}

    # ---- the decode side ------------------------------------------------------------------------

    async def resume(self, params, parsed):
        """The handle of the transferred request named in `params`, imported into this loop."""
        if self.role != "decode":
            raise ApiError(400, "kv_transfer_params go to a decode worker; this one prefills",
                           param="kv_transfer_params")
        transfer_id, _ = _transfer_params(params, need_rank=False)
        started = time.perf_counter()
        try:
            raw, payload = await asyncio.to_thread(self.link.claim, transfer_id, self.timeout_s)
        except kv_transfer.TransferFailed as error:
            self.count("timed_out")
            raise ApiError(504, str(error), kind="server_error", code="kv_transfer_timeout") from None
        engine = self.server.loop.engine
        try:
            header, kv = kv_transfer.unpack(raw, payload)
            kv_transfer.check(header, engine)
            if header["state"]["prompt"] != list(parsed.prompt):
                raise kv_transfer.TransferRefused(f"transfer {transfer_id} carries another prompt than this request's")
        except kv_transfer.TransferRefused as error:
            self.count("refused")
            raise ApiError(400, str(error), param="kv_transfer_params", code="kv_transfer_refused") from None
        try:
            handle = self.server.loop.import_request(header["state"], kv, replay=True)
        except ValueError as error:  # the pool is short of blocks, or the request does not fit
            self.count("refused")
            raise ApiError(503, f"transfer {transfer_id}: {error}", kind="server_error", code="kv_import_failed") \
                from None
        self.count("received")
        self.bytes.inc(payload.size)
        self.seconds.observe(time.perf_counter() - started)
        return handle


def _transfer_params(params, need_rank: bool) -> tuple[str, int | None]:
    if not isinstance(params, dict) or not isinstance(params.get("transfer_id"), str) \
            or not params["transfer_id"].isalnum():
        raise ApiError(400, "kv_transfer_params must be {'transfer_id': letters and digits"
                       + (", 'decode_rank': int}" if need_rank else "}") + f"; got {params!r}",
                       param="kv_transfer_params")
    rank = params.get("decode_rank")
    if need_rank and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ApiError(400, f"kv_transfer_params needs the decode worker's 'decode_rank' (int); got {rank!r}",
                       param="kv_transfer_params")
    return params["transfer_id"], rank


def from_args(args) -> KVRole | None:
    if not getattr(args, "kv_role", None):
        return None
    return KVRole(args.kv_role, args.kv_transport, args.kv_timeout, args.kv_rank, args.kv_world, args.kv_master)
