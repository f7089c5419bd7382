"""The model runner: one forward over a mixed batch per engine step (chapter 05).

Given what a scheduler chose, each request with how many of its uncomputed tokens to run (a
prefill chunk, or the one token it generated last), the runner makes room in the KV pool, builds
the step's metadata (kv.metadata), runs the model's one `step` over every token at once, and
samples a next token for each request whose tokens are now all computed. It makes no choices of
its own: the scheduler above it decides who runs, and how much.
"""
from __future__ import annotations

import time

import numpy as np

from infra_lab import backend as backends
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model.generate import sample
from infra_lab.serving.request import Request, RequestState


class ModelRunner:
    def __init__(self, model, pool: PagedKVCache, backend: backends.Backend | None = None):
        self.model, self.pool = model, pool
        self.backend = backend or backends.current()

    def run(self, batch: list[tuple[Request, int]], now_s: float | None = None) -> dict[int, int]:
        """Run one step: request r computes its next n uncomputed tokens, for each (r, n) in
        `batch`. Returns {request_id: token} for the requests that sampled a token. All or
        nothing: on OutOfBlocks (or any error) no request changes and the pool is as it was."""
        self._check(batch)
        fresh = [request for request, _ in batch if request.seq is None]
        for request in fresh:
            request.seq = self.pool.new_sequence()
        seqs = [request.seq for request, _ in batch]
        counts = [n for _, n in batch]
        try:
            with self.pool.undo_on_error(seqs):
                self.pool.reserve_all(seqs, counts)
                meta = self.pool.step_metadata(seqs, counts)
                tokens = np.concatenate([request.tokens[request.num_computed:request.num_computed + n]
                                         for request, n in batch])
                logits = self.model.step(tokens, meta, self.pool, self.backend)  # (N, vocab)
        except Exception:
            for request in fresh:  # sequences made for this step go too
                self.pool.free(request.seq)
                request.seq = None
            raise
        now_s = time.perf_counter() if now_s is None else now_s
        sampled = {}
        for row, (request, n) in enumerate(batch):
            self.pool.commit(request.seq, request.tokens[request.num_computed:request.num_computed + n])
            request.num_computed += n
            if request.num_uncomputed == 0:  # its last known token ran: the next one comes out
                p = request.params
                token = sample(logits[meta.last_rows[row]], p.temperature, p.top_k, p.top_p, request.rng)
                request.append(token, now_s)
                sampled[request.request_id] = token
        return sampled

    def release(self, request: Request) -> None:
        """Hand back a request's blocks (it finished, was aborted, or is preempted to recompute)."""
        if request.seq is not None:
            self.pool.free(request.seq)
            request.seq, request.num_computed = None, 0

    def _check(self, batch: list[tuple[Request, int]]) -> None:
        if not batch:
            raise ValueError("a step needs at least one request")
        ids = [request.request_id for request, _ in batch]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} name a request twice in one step")
        for request, n in batch:
            if request.is_done or request.state is not RequestState.RUNNING:
                raise ValueError(f"request {request.request_id} is {request.state.value}; only running requests "
                                 "take part in a step")
            if not 1 <= n <= request.num_uncomputed:
                raise ValueError(f"request {request.request_id} has {request.num_uncomputed} uncomputed tokens; "
                                 f"a step can run 1 to that many, not {n}")
