"""The model runner: one forward over a mixed batch per engine step (chapter 05).

Given what a scheduler chose, each request with how many of its uncomputed tokens to run (a
prefill chunk, or the one token it generated last), the runner builds the step's metadata
(kv.metadata) from the block tables, runs the model's one `step` over every token at once (which
writes each token's K and V into the slot its table gives), and samples a next token for each
request whose tokens are now all computed. It makes no choices and keeps no books: the scheduler
above it decides who runs, and how much; the block manager made room in the pool before the step
and records what the step computed after it; the engine takes the tokens into the requests.
`run(batch) -> RunnerOutput` is the whole interface, so that another runner (the simulator's, a
speculative one, a prefill-only or a remote one) plugs into the same engine.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from infra_lab import backend as backends
from infra_lab.kv.paged import PagedKVCache
from infra_lab.model.generate import sample
from infra_lab.serving.request import Request, RequestState


@dataclass
class RunnerOutput:
    """What one step computed, by request id (requests of the batch; a sample waiting to fork
    from a prompt that ended in this step gets its first token here too)."""
    computed: dict[int, list[int]] = field(default_factory=dict)  # tokens whose K and V the step wrote
    kept: dict[int, int] = field(default_factory=dict)  # how many of them stand (drafts may be rejected)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # new tokens, for requests that made some
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # each new token's, if its request asks
    top_logprobs: dict[int, list[tuple]] = field(default_factory=dict)  # ((token, logprob), ...) per token
    verdicts: dict[int, tuple[int, int]] = field(default_factory=dict)  # speculative: (drafted, accepted)
    weight_version: int = 0  # of the weights that ran the step
    forward_s: float = 0.0  # in the model's forward (the engine's clock)
    draft_s: float = 0.0  # in the drafter


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """(..., vocab) logits -> log-probabilities, in float64."""
    rows = np.asarray(rows, np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(rows: np.ndarray, tokens: list[int], ks: list[int]) -> tuple[list[float], list[tuple]]:
    """Each token's log-probability under its row of logits (T, vocab) (the model's own
    distribution, at temperature 1, before any cut, as vLLM's default), and its row's ks[i]
    likeliest tokens with theirs: one batched softmax and one sort for all the rows."""
    logp = log_softmax(rows)  # (T, vocab)
    chosen = logp[np.arange(len(tokens)), tokens].tolist()
    most = min(max(ks), logp.shape[1])
    best = np.argpartition(-logp, most - 1, axis=1)[:, :most] if most else np.zeros((len(tokens), 0), np.int64)
    values = np.take_along_axis(logp, best, axis=1)  # (T, most): the likeliest, in no order yet
    order = np.lexsort((best, -values), axis=1)  # likeliest first; ties by token id, as a stable sort
    best, values = np.take_along_axis(best, order, axis=1), np.take_along_axis(values, order, axis=1)
    tops = [tuple(zip(best[i, :k].tolist(), values[i, :k].tolist())) for i, k in enumerate(ks)]
    return chosen, tops


class ModelRunner:
    def __init__(self, model, pool: PagedKVCache, backend: backends.Backend | None = None,
                 clock: Callable[[], float] = time.perf_counter, config=None):
        """Run `model` over `pool`; a runner without a model (the simulator's) passes the
        model's `config` instead."""
        self.model, self.pool = model, pool
        self.backend = backend or backends.current()
        self.clock = clock  # seconds; an engine passes its own, a simulator a virtual one
        self.config = config or model.config  # the model's shape: what an imported request must match
        self.vocab, self.context = self.config.vocab, self.config.context

    @property
    def weight_version(self) -> int:
        return getattr(self.model, "version", 0)

    def run(self, batch: list[tuple[Request, int]]) -> RunnerOutput:
        """Run one step: request r computes its next n uncomputed tokens, for each (r, n) in
        `batch` (a speculative runner adds drafted tokens after a decode's one), in the room the
        block manager reserved. Changes no request and no block table: on any error the pool's
        books are as they were (the slots written belong to no committed token)."""
        self._check(batch)
        out = RunnerOutput(weight_version=self.weight_version)
        drafts = self._draft(batch, out)  # (B,) tokens to verify after each request's n; none here
        chunks = [request.next_tokens(n) + list(draft) for (request, n), draft in zip(batch, drafts)]
        seqs, counts = [request.seq for request, _ in batch], [len(chunk) for chunk in chunks]
        meta = self.pool.step_metadata(seqs, counts)  # raises unless the room is reserved
        tokens = np.array([t for chunk in chunks for t in chunk], np.int64)  # (N,)
        started = self.clock()
        logits = self._forward(tokens, meta)  # (N, vocab)
        out.forward_s = self.clock() - started
        last_rows = meta.last_rows  # (B,) each request's last row of logits
        greedy = self._greedy(logits, last_rows)  # (B,) argmax of each last row, in one call
        scored: list[tuple[Request, int, int]] = []  # (request, token, its row): log-probabilities asked
        for row, ((request, n), chunk, draft) in enumerate(zip(batch, chunks, drafts)):
            rid = request.request_id
            out.computed[rid] = chunk
            if draft:
                self._verify(request, n, draft, logits, int(meta.query_starts[row]), out)
                continue
            out.kept[rid] = n
            if n < request.num_uncomputed:
                continue  # a prefill chunk that did not reach the prompt's end
            last = int(last_rows[row])
            forking = request.samples if not request.output else []  # n samples draw from one prompt
            for each in [request] + forking:
                token = int(greedy[row]) if each.params.temperature == 0 and not self._masks(each) \
                    else self._sample(logits, last, each)
                out.tokens[each.request_id] = [token]
                if each.params.logprobs is not None and logits is not None:
                    scored.append((each, token, last))
        if scored:  # one batched log-softmax for every request that asked
            chosen, tops = token_logprobs(logits[[row for _, _, row in scored]], [t for _, t, _ in scored],
                                          [each.params.logprobs for each, _, _ in scored])
            for (each, _, _), logprob, top in zip(scored, chosen, tops):
                out.logprobs[each.request_id], out.top_logprobs[each.request_id] = [logprob], [top]
        return out

    def release(self, request_ids: list[int]) -> None:
        """These requests ended (finished, aborted, exported): a runner that keeps state per
        request (a drafter's cache) drops theirs. The model runner keeps none."""

    def _take(self, out: RunnerOutput, request: Request, tokens: list[int], rows) -> None:
        """Record `request`'s new tokens, with their log-probabilities from `rows` (one per token)
        when it asks for them."""
        rid = request.request_id
        out.tokens[rid] = tokens
        k = request.params.logprobs
        if k is not None and rows is not None:
            out.logprobs[rid], out.top_logprobs[rid] = token_logprobs(rows, tokens, [k] * len(tokens))

    def _draft(self, batch: list[tuple[Request, int]], out: RunnerOutput) -> list:
        return [()] * len(batch)

    def _verify(self, request: Request, n: int, draft, logits: np.ndarray, first_row: int,
                out: RunnerOutput) -> None:
        raise NotImplementedError("only a speculative runner drafts")

    def _forward(self, tokens: np.ndarray, meta) -> np.ndarray:
        return self.model.step(tokens, meta, self.pool, self.backend)

    @staticmethod
    def _greedy(logits: np.ndarray, last_rows: np.ndarray) -> np.ndarray:
        return logits[last_rows].argmax(axis=1)  # what sample() returns at temperature 0

    @staticmethod
    def _masks(request: Request) -> bool:
        """Before min_tokens, the request's stop tokens cannot be drawn (vLLM's min_tokens)."""
        return bool(request.params.stop_tokens) and not request.may_stop

    @staticmethod
    def masked(row: np.ndarray, request: Request, ahead: int = 0) -> np.ndarray:
        """(vocab,) logits with the stop tokens ruled out while the request's output, `ahead`
        tokens from now, is shorter than min_tokens."""
        if not request.params.stop_tokens or len(request.output) + ahead >= request.params.min_tokens:
            return row
        row = np.array(row, copy=True)
        row[list(request.params.stop_tokens)] = -np.inf
        return row

    def _sample(self, logits: np.ndarray, row: int, request: Request) -> int:
        p = request.params
        return sample(self.masked(logits[row], request), p.temperature, p.top_k, p.top_p, request.rng)

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
            if request.seq is None:
                raise ValueError(f"request {request.request_id} holds no sequence in the pool; the block "
                                 "manager starts it before it runs")
            if not 1 <= n <= request.num_uncomputed:
                raise ValueError(f"request {request.request_id} has {request.num_uncomputed} uncomputed tokens; "
                                 f"a step can run 1 to that many, not {n}")
