"""Drafters for speculative decoding (chapter 07): who guesses the next γ tokens cheaply.

A drafter gets one job per sequence (its tokens so far, how many to propose, how to sample) and
returns a draft: the proposed tokens and, for each, the distribution q it drew it from (None for
a drafter that proposes deterministically, a point mass on each token). The target model then
checks every proposal in one forward (serving.speculative).

- ModelDrafter: a small model of the same vocabulary (the shipped `draft`, chapter 02) runs γ
  decode steps. It keeps each sequence's keys and values in its own paged pool, so a new round
  only feeds the tokens it has not seen: the target's bonus token, or the last accepted draft.
  Rejected tokens leave its cache with `truncate` (Leviathan et al., 2023; Chen et al., 2023).
- PromptLookupDrafter: no model. The last n tokens (n from `max_ngram` down to `min_ngram`) are
  looked up earlier in the sequence, prompt and output alike, and the tokens that followed their
  latest earlier occurrence are proposed (Saxena, "prompt lookup decoding", 2023; vLLM's
  `ngram` method). Code repeats itself, so it drafts well on the standard-library corpus.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from infra_lab import backend as backends
from infra_lab.kv.paged import OutOfBlocks
from infra_lab.model.generate import distribution
from infra_lab.serving.request import SamplingParams


@dataclass(frozen=True)
class DraftJob:
    key: int  # the sequence (a request id): a drafter keeps its state per key
    tokens: list[int]  # everything so far, prompt and output; the last one is not in the target's cache yet
    k: int  # most tokens to propose (the caller's γ, cut where the sequence must end)
    params: SamplingParams = field(default_factory=SamplingParams)
    rng: np.random.Generator | None = None  # draws the draft's tokens at temperature > 0


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]  # (k',) with k' <= the job's k (a lookup may find fewer, or none)
    q: np.ndarray | None = None  # (k', vocab) what each token was drawn from; None: point masses

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self):
        return iter(self.tokens)


class Drafter:
    """The interface: `propose` a draft per job; `retain` drops the state of every other key."""

    name = "drafter"
    vocab: int

    def propose(self, jobs: list[DraftJob]) -> list[Draft]:
        raise NotImplementedError

    def retain(self, keys) -> None:
        """Forget every sequence not in `keys` (they finished, or lost their place)."""

    def forget(self, key: int) -> None:
        """Forget one sequence (it was aborted)."""


class PromptLookupDrafter(Drafter):
    name = "prompt lookup"

    def __init__(self, vocab: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.vocab, self.max_ngram, self.min_ngram = vocab, max_ngram, min_ngram

    def propose(self, jobs: list[DraftJob]) -> list[Draft]:
        return [Draft(tuple(self.lookup(job.tokens, job.k))) for job in jobs]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (of max_ngram down to min_ngram tokens) that occurs earlier; [] if none does."""
        if k < 1:
            return []
        seq = np.asarray(tokens, np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # (L - n, n): each start but the suffix's
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest occurrence: the text nearest in kind
                return seq[start:start + k].tolist()
        return []


class ModelDrafter(Drafter):
    def __init__(self, model, backend: backends.Backend | None = None, num_blocks: int | None = None,
                 block_size: int = 16):
        """`model` drafts with a pool of its own: `num_blocks` blocks of `block_size` tokens (by
        default room for 64 sequences as long as its context)."""
        self.model, self.backend = model, backend or backends.current()
        self.name = f"{model.config.name} model"
        self.vocab = model.config.vocab
        blocks = num_blocks or 64 * -(-model.config.context // block_size)
        self.pool = model.new_paged_cache(blocks, block_size, backend=self.backend)
        self.seqs: dict[int, int] = {}  # key -> its sequence in the pool

    def retain(self, keys) -> None:
        for key in set(self.seqs) - set(keys):
            self.forget(key)

    def forget(self, key: int) -> None:
        if key in self.seqs:
            self.pool.free(self.seqs.pop(key))

    def propose(self, jobs: list[DraftJob]) -> list[Draft]:
        """Every job's draft, batched: the first forward feeds what each sequence's cache lacks
        (a prefill for a new one, one or two tokens after a round), the next k - 1 are decodes."""
        jobs = [job for job in jobs]
        drafted: list[list[int]] = [[] for _ in jobs]
        q: list[list[np.ndarray]] = [[] for _ in jobs]
        feeds = [self._catch_up(job) for job in jobs]
        active = [i for i, job in enumerate(jobs) if job.k > 0]
        while active:
            seqs = [self.seqs[jobs[i].key] for i in active]
            counts = [len(feeds[i]) for i in active]
            with self.pool.undo_on_error(seqs):
                try:
                    self.pool.reserve_all(seqs, counts)
                except OutOfBlocks as error:
                    raise OutOfBlocks(f"the {self.name} drafter's pool is full ({error}); give it more num_blocks "
                                      "or draft for fewer sequences") from None
                meta = self.pool.step_metadata(seqs, counts)
                tokens = np.array([t for i in active for t in feeds[i]], np.int64)
                logits = self.model.step(tokens, meta, self.pool, self.backend)[meta.last_rows]  # (B, vocab)
            for row, i in enumerate(active):
                self.pool.commit(self.seqs[jobs[i].key], feeds[i])
                params = jobs[i].params
                probabilities = distribution(logits[row], params.temperature, params.top_k, params.top_p)
                token = (int(np.argmax(probabilities)) if params.temperature == 0
                         else int(jobs[i].rng.choice(len(probabilities), p=probabilities)))
                drafted[i].append(token)
                q[i].append(probabilities)
                feeds[i] = [token]
            active = [i for i in active if len(drafted[i]) < jobs[i].k]  # its last token is never fed
        return [Draft(tuple(d), np.array(rows) if rows else None) for d, rows in zip(drafted, q)]

    def _catch_up(self, job: DraftJob) -> list[int]:
        """The tokens of `job` this drafter's cache lacks, after rolling back what it drafted and
        the target rejected. At least the last token is fed: its logits give the first draft."""
        if job.key not in self.seqs:
            self.seqs[job.key] = self.pool.new_sequence()
        seq = self.seqs[job.key]
        cached = self.pool.tokens[seq]
        common = 0
        limit = min(len(cached), len(job.tokens) - 1)
        while common < limit and cached[common] == job.tokens[common]:
            common += 1
        if common < len(cached):
            self.pool.truncate(seq, common)  # rejected drafts (and anything after) leave the cache
        return list(job.tokens[common:])
