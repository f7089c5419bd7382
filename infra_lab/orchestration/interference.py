"""Why prefill and decode fight, measured on the real engine (chapter 06): long prompts arrive
among requests that are decoding, on this machine's two cores, served three ways.

- colocated, no chunking (policy "continuous"): one engine with both cores; a long prompt is
  prefilled whole in one step, and every running decode waits for that step;
- colocated, chunked prefill (chapter 05, Sarathi-Serve's fix): the same engine, with a token
  budget per step so that a prompt is cut into chunks that ride along with the decodes;
- disaggregated: a prefill engine and a decode engine in two processes, one core each, the K and
  V of each prompt sent over torch.distributed (gloo) with kv_transfer's wire format (DistServe's
  and Splitwise's fix).

Each run returns every request's token times (its engine's clock), so the inter-token gaps
of the decoding requests, and the throughput, come out of one run.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from infra_lab.serving.traffic import TimedRequest

LONG_PROMPT = 420  # tokens: the byte model's context is 512
DECODE_PROMPT = 16
END = "end"  # the transfer id that tells the decode rank nothing more comes


@dataclass(frozen=True)
class Mix:
    """Decoding requests that start together, and long prompts that arrive among them."""
    decoders: int = 16  # requests that arrive at 0 s and decode `decode_tokens` each
    decode_tokens: int = 200
    long_prompts: int = 8  # prompts of LONG_PROMPT tokens, arriving every `long_every_s`, 1 token each
    long_every_s: float = 0.25
    long_tokens: int = 8  # tokens each long prompt generates

    def requests(self, seed: int = 0) -> list[TimedRequest]:
        rng = np.random.default_rng(seed)
        text = lambda n: [int(t) for t in rng.integers(32, 127, n)]  # noqa: E731: printable bytes
        out = [TimedRequest(0.0, text(DECODE_PROMPT), self.decode_tokens) for _ in range(self.decoders)]
        out += [TimedRequest(0.2 + i * self.long_every_s, text(LONG_PROMPT), self.long_tokens)
                for i in range(self.long_prompts)]
        return out


@dataclass
class Run:
    """One way of serving a Mix: each request's token times (s), its prompt length, the wall time."""
    name: str
    token_times_s: list[list[float]]
    prompt_lens: list[int]
    seconds: float
    threads: str

    def itl_s(self) -> np.ndarray:
        """Gaps between consecutive tokens of the decoding (short-prompt) requests, in seconds."""
        gaps = [np.diff(times) for times, n in zip(self.token_times_s, self.prompt_lens) if n == DECODE_PROMPT]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def throughput(self) -> float:
        """Output tokens per second over the run."""
        return sum(len(t) for t in self.token_times_s) / self.seconds

    def summary(self) -> dict:
        itl = self.itl_s()
        return {"name": self.name, "threads": self.threads, "itl_p50_ms": float(np.percentile(itl, 50) * 1e3),
                "itl_p99_ms": float(np.percentile(itl, 99) * 1e3), "itl_max_ms": float(itl.max() * 1e3),
                "tokens_per_s": self.throughput(), "seconds": self.seconds}


def _engine(policy: str, token_budget: int, threads: int):
    import numba

    from infra_lab import backend as backends
    from infra_lab import model
    from infra_lab.serving.config import EngineConfig
    from infra_lab.serving.engine import Engine

    numba.set_num_threads(threads)
    config = EngineConfig(policy=policy, max_batch=64, token_budget=token_budget, num_blocks=1024, block_size=16)
    return Engine(model.load("target"), config, backends.resolve("numba", "cpu"))


def _colocated_rank(requests: list[TimedRequest], policy: str, token_budget: int, threads: int) -> dict:
    engine = _engine(policy, token_budget, threads)
    engine.generate([[32, 33, 34]])  # the kernels compile here, not in the run
    started = engine.clock()
    served = engine.serve(requests)
    return {"times": [[t - started for t in r.token_times_s] for r in served],
            "prompts": [len(r.prompt) for r in served], "seconds": engine.clock() - started}


def colocated(mix: Mix, chunked: bool, threads: int = 2, seed: int = 0, chunk_budget: int = 96) -> Run:
    """One engine on `threads` cores, in a process of its own."""
    from infra_lab.processes import run_on_ranks

    policy, budget = ("chunked", chunk_budget) if chunked else ("continuous", 512)
    out, = run_on_ranks(_colocated_rank, 1, mix.requests(seed), policy, budget, threads, timeout_s=600)
    return Run("colocated, chunked prefill" if chunked else "colocated, whole prompts", out["times"],
               out["prompts"], out["seconds"], f"1 engine x {threads} threads")


def _pd_rank(requests: list[TimedRequest]) -> dict:
    import torch.distributed as dist

    from infra_lab.orchestration import kv_transfer

    rank = dist.get_rank()
    link = kv_transfer.GlooLink(rank, 2, None, receive=rank == 1)
    engine = _engine("continuous", 512, 1)
    engine.generate([[32, 33, 34]])
    dist.barrier()
    return _prefill(engine, link, requests) if rank == 0 else _decode(engine, link, len(requests))


def _prefill(engine, link, requests: list[TimedRequest]) -> dict:
    """Add each request when its time comes, step, and send every request that has its first token."""
    from infra_lab.orchestration import kv_transfer
    from infra_lab.serving.request import SamplingParams

    started, pending, sent = engine.clock(), sorted(requests, key=lambda r: r.arrival_s), 0
    live: list[int] = []
    while pending or live:
        now = engine.clock() - started
        while pending and pending[0].arrival_s <= now:
            timed = pending.pop(0)
            live.append(engine.add_request(timed.prompt, SamplingParams(max_tokens=timed.max_tokens)))
        if not live:
            engine.clock.wait_until(started + pending[0].arrival_s)
            continue
        engine.step()
        for rid in [r for r in live if engine.requests[r].output]:
            live.remove(rid)
            if engine.requests[rid].is_done:
                continue  # its first token ended it: nothing to decode
            state, kv = engine.export_request(rid)
            header, payload = kv_transfer.pack(f"r{rid}", state, kv, engine.blocks.block_size)
            link.send(1, header, payload, timeout_s=60)
            sent += payload.size
    link.send(1, json.dumps({"wire": kv_transfer.WIRE_VERSION, "transfer_id": END, "close": True}).encode(),
              np.zeros(0, np.uint8), timeout_s=60)
    link.dist.barrier()  # the group stays up until the decode rank has finished
    pool = engine.blocks.pool
    return {"kv_bytes": sent, "free_blocks": pool.num_free, "blocks": pool.allocator.num_blocks}


def _decode(engine, link, n: int) -> dict:
    """Take each transfer in as it arrives and decode; token times on this engine's clock."""
    from infra_lab.orchestration import kv_transfer

    started, imported, ended = engine.clock(), [], False
    while not ended or engine.has_unfinished:
        for transfer_id in list(link.inbox._arrived):  # noqa: SLF001: arrival order
            raw, payload = link.inbox.claim(transfer_id, 1.0)
            if transfer_id == END:
                ended = True
                continue
            header, kv = kv_transfer.unpack(raw, payload)
            kv_transfer.check(header, engine)
            imported.append(engine.import_request(header["state"], kv))
        if engine.has_unfinished:
            engine.step()
        else:
            time.sleep(0.0005)
    link.dist.barrier()
    requests = [engine.requests[i] for i in imported]
    return {"times": [[t - started for t in r.token_times_s] for r in requests],
            "prompts": [len(r.prompt) for r in requests], "seconds": engine.clock() - started,
            "free_blocks": engine.blocks.pool.num_free, "blocks": engine.blocks.pool.allocator.num_blocks}


def disaggregated(mix: Mix, seed: int = 0) -> tuple[Run, dict]:
    """A prefill process and a decode process, one thread each; the Run (decode side) and the
    prefill side's books (bytes sent, free blocks)."""
    from infra_lab.processes import run_on_ranks

    prefill, decode = run_on_ranks(_pd_rank, 2, mix.requests(seed), timeout_s=600)
    books = {"prefill": prefill, "decode": {k: decode[k] for k in ("free_blocks", "blocks")}}
    return Run("disaggregated", decode["times"], decode["prompts"], decode["seconds"], "2 engines x 1 thread"), books
