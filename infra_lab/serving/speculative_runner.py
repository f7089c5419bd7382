"""Speculative decoding inside the engine (chapter 07): the model runner, with a drafter.

The scheduler plans each decode with room for its token and up to γ more (`draft_room`: the
blocks, and the step's token budget), as vLLM's lookahead slots; a prompt's last chunk gets that
room too, so a request's first tokens are speculated as well. Before the forward, every such
request in the batch gets a draft, all drafted together; the one forward then runs the prefill
chunks, the decodes and their drafts side by side through the extend kernel. Each
request keeps its own accepted length: the target's verdict (serving.speculative.accept), which
the runner reports as the tokens `kept`; the block manager then rolls the sequence back past the
rejected ones, and whole blocks go back to the pool.
"""
from __future__ import annotations

import numpy as np

from infra_lab.serving.drafters import Draft, Drafter, DraftJob
from infra_lab.serving.request import Request
from infra_lab.serving.runner import ModelRunner, RunnerOutput
from infra_lab.serving.speculative import Tally, accept, check_draft, check_gamma


class SpeculativeRunner(ModelRunner):
    def __init__(self, model, pool, backend, clock, drafter: Drafter, gamma: int, rule=None):
        """`rule(p (k + 1, vocab), drafted, q, rng) -> Verdict` decides what is kept at temperature
        > 0 (serving.speculative.accept_sampling unless given; chapter 07's exercise plugs in its
        own); temperature 0 keeps the drafts the target's argmax agrees with."""
        super().__init__(model, pool, backend, clock)
        self.drafter, self.gamma, self.rule = drafter, check_gamma(gamma), rule
        self.tally = Tally(self.gamma)  # α and tokens per forward over the engine's life

    def release(self, request_ids: list[int]) -> None:
        for request_id in request_ids:  # their draft model's cache goes too
            self.drafter.forget(request_id)

    def _draft(self, batch: list[tuple[Request, int]], out: RunnerOutput) -> list:
        jobs, where = [], []
        for row, (request, n) in enumerate(batch):
            k = min(request.draft_room, request.draftable)
            if k > 0 and n == request.num_uncomputed:  # a decode, or a prompt's last chunk
                jobs.append(DraftJob(request.request_id, request.tokens, k, request.params, request.rng))
                where.append(row)
        started = self.clock()
        self.drafter.retain([request.request_id for request, _ in batch])
        proposed = self.drafter.propose(jobs) if jobs else []
        out.draft_s = self.clock() - started
        drafts: list = [()] * len(batch)
        for row, job, draft in zip(where, jobs, proposed):
            drafts[row] = check_draft(draft, job.k, self.drafter)
        return drafts

    def _verify(self, request: Request, n: int, draft: Draft, logits: np.ndarray, first_row: int,
                out: RunnerOutput) -> None:
        """The verdict on the draft after request's n tokens (rows first_row .. + n + len(draft))."""
        rows = logits[first_row + n - 1:first_row + n + len(draft)]  # (k + 1, vocab): before each draft, and after
        rows = np.stack([self.masked(row, request, j) for j, row in enumerate(rows)])
        verdict = accept(rows, draft, request.params, request.rng, self.rule)
        out.kept[request.request_id] = n + verdict.accepted  # the rejected drafts' K and V go
        self.tally.add(len(draft), verdict)
        out.verdicts[request.request_id] = (len(draft), verdict.accepted)
        self._take(out, request, list(verdict.tokens), rows[:len(verdict.tokens)])
