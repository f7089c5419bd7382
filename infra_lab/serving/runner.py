"""The model runner: one forward over a mixed batch per engine step (chapter 05).

Given what a scheduler chose, each request with how many of its uncomputed tokens to run (a
prefill chunk, or the one token it generated last), the runner makes room in the KV pool, builds
the step's metadata (kv.metadata), runs the model's one `step` over every token at once, and
samples a next token for each request whose tokens are now all computed. It makes no choices of
its own: the scheduler above it decides who runs, and how much.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from infra_lab import backend as backends
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model.generate import sample
from infra_lab.serving.request import Request, RequestState


class ModelRunner:
    def __init__(self, model, pool: PagedKVCache, backend: backends.Backend | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.model, self.pool = model, pool
        self.backend = backend or backends.current()
        self.clock = clock  # seconds; an engine passes its own, a simulator a virtual one
        self.forward_s = 0.0  # the last step's time in the model's forward alone
        self.verdicts: dict[int, tuple[int, int]] = {}  # the last step's (drafted, accepted) per request
        self.vocab, self.context = model.config.vocab, model.config.context

    def run(self, batch: list[tuple[Request, int]], now_s: float | None = None) -> dict[int, list[int]]:
        """Run one step: request r computes its next n uncomputed tokens, for each (r, n) in
        `batch` (a speculative runner adds drafted tokens after a decode's one). Returns
        {request_id: [tokens]} for the requests that produced tokens. All or nothing: on
        OutOfBlocks (or any error) no request changes and the pool is as it was."""
        self._check(batch)
        fresh = [request for request, _ in batch if request.seq is None]
        for request in fresh:
            request.seq = self.pool.new_sequence()
        seqs = [request.seq for request, _ in batch]
        try:
            drafts = self._draft(batch)  # (B,) tokens to verify after each request's n; none here
            chunks = [request.next_tokens(n) + list(draft) for (request, n), draft in zip(batch, drafts)]
            counts = [len(chunk) for chunk in chunks]
            with self.pool.undo_on_error(seqs):
                self.pool.reserve_all(seqs, counts)
                meta = self.pool.step_metadata(seqs, counts)
                tokens = np.array([t for chunk in chunks for t in chunk], np.int64)  # (N,)
                started = self.clock()
                logits = self._forward(tokens, meta)  # (N, vocab)
                self.forward_s = self.clock() - started
        except Exception:
            for request in fresh:  # sequences made for this step go too
                self.pool.free(request.seq)
                request.seq = None
            raise
        now_s = self.clock() if now_s is None else now_s
        produced, last_rows = {}, meta.last_rows  # (B,) each request's last row of logits
        greedy = self._greedy(logits, last_rows)  # (B,) argmax of each last row, in one call
        for row, ((request, n), chunk, draft) in enumerate(zip(batch, chunks, drafts)):
            self.pool.commit(request.seq, chunk)
            if draft:
                tokens = self._verify(request, n, draft, logits, int(meta.query_starts[row]))
            else:
                request.num_computed += n
                if request.num_uncomputed:
                    continue  # a prefill chunk that did not reach the prompt's end
                tokens = [int(greedy[row]) if request.params.temperature == 0
                          else self._sample(logits, int(last_rows[row]), request)]
            produced[request.request_id] = request.extend(tokens, now_s)
        return produced

    def _draft(self, batch: list[tuple[Request, int]]) -> list:
        return [()] * len(batch)

    def _verify(self, request: Request, n: int, draft, logits: np.ndarray, first_row: int) -> list[int]:
        raise NotImplementedError("only a speculative runner drafts")

    def _forward(self, tokens: np.ndarray, meta) -> np.ndarray:
        return self.model.step(tokens, meta, self.pool, self.backend)

    @staticmethod
    def _greedy(logits: np.ndarray, last_rows: np.ndarray) -> np.ndarray:
        return logits[last_rows].argmax(axis=1)  # what sample() returns at temperature 0

    @staticmethod
    def _sample(logits: np.ndarray, row: int, request: Request) -> int:
        p = request.params
        return sample(logits[row], p.temperature, p.top_k, p.top_p, request.rng)

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
