"""Speculative decoding inside the engine (chapter 07): the model runner, with a drafter.

The scheduler plans each decode with room for its token and up to γ more (`draft_room`: the
blocks, and the step's token budget), as vLLM's lookahead slots; a prompt's last chunk gets that
room too, so a request's first tokens are speculated as well. Before the forward, every such
request in the batch gets a draft, all drafted together; the one forward then runs the prefill
chunks, the decodes and their drafts side by side through the extend kernel. Each
request keeps its own accepted length: the target's verdict (serving.speculative.accept), then
`truncate` rolls its sequence back past the rejected tokens, and whole blocks go back to the pool.
"""
from __future__ import annotations

import time

import numpy as np

from infra_lab.serving.drafters import Draft, Drafter, DraftJob
from infra_lab.serving.request import Request
from infra_lab.serving.runner import ModelRunner
from infra_lab.serving.speculative import Tally, accept, check_draft, check_gamma


class SpeculativeRunner(ModelRunner):
    def __init__(self, model, pool, backend, clock, drafter: Drafter, gamma: int, rule=None):
        """`rule(p (k + 1, vocab), drafted, q, rng) -> Verdict` decides what is kept at temperature
        > 0 (serving.speculative.accept_sampling unless given; chapter 07's exercise plugs in its
        own); temperature 0 keeps the drafts the target's argmax agrees with."""
        super().__init__(model, pool, backend, clock)
        self.drafter, self.gamma, self.rule = drafter, check_gamma(gamma), rule
        self.tally = Tally(self.gamma)  # α and tokens per forward over the engine's life
        self.draft_s = 0.0  # the last step's time in the drafter

    def run(self, batch: list[tuple[Request, int]], now_s: float | None = None) -> dict[int, list[int]]:
        produced = super().run(batch, now_s)
        for request, _ in batch:  # room the scheduler reserved for drafts that were never made (none found,
            if request.seq is not None:  # or none allowed near max_tokens) goes back: a table holds what is computed
                self.pool.truncate(request.seq, self.pool.lengths[request.seq])
        # A request that finished in this step is in no later batch: its draft state goes now.
        self.drafter.retain([request.request_id for request, _ in batch if not request.is_done])
        return produced

    def _draft(self, batch: list[tuple[Request, int]]) -> list:
        jobs, where = [], []
        for row, (request, n) in enumerate(batch):
            k = min(request.draft_room, request.params.max_tokens - len(request.output) - 1)
            if k > 0 and n == request.num_uncomputed:  # a decode, or a prompt's last chunk
                jobs.append(DraftJob(request.request_id, request.tokens, k, request.params, request.rng))
                where.append(row)
        self.verdicts = {}
        started = time.perf_counter()
        self.drafter.retain([request.request_id for request, _ in batch])
        proposed = self.drafter.propose(jobs) if jobs else []
        self.draft_s = time.perf_counter() - started
        drafts: list = [()] * len(batch)
        for row, job, draft in zip(where, jobs, proposed):
            drafts[row] = check_draft(draft, job.k, self.drafter)
        return drafts

    def _verify(self, request: Request, n: int, draft: Draft, logits: np.ndarray, first_row: int) -> list[int]:
        """The verdict on the draft after request's n tokens (rows first_row .. + n + len(draft))."""
        rows = logits[first_row + n - 1:first_row + n + len(draft)]  # (k + 1, vocab): before each draft, and after
        verdict = accept(rows, draft, request.params, request.rng, self.rule)
        request.num_computed += n + verdict.accepted
        self.pool.truncate(request.seq, request.num_computed)  # the rejected drafts' K and V go
        self.tally.add(len(draft), verdict)
        self.verdicts[request.request_id] = (len(draft), verdict.accepted)
        return list(verdict.tokens)
