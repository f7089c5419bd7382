"""A request to the serving engine: its prompt, how to sample its answer, where it stands, and
the timestamps that latency metrics are computed from (chapter 05).

A request's tokens are its prompt followed by what it has generated; `num_computed` counts those
whose keys and values sit in the KV pool. A step computes some of the rest: a chunk of the prompt,
or the one token generated last, and samples the next token when it reaches the end.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from infra_lab.model.generate import check_sampling

MAX_LOGPROBS = 20  # most alternatives a token's log-probabilities list (vLLM's default max_logprobs; OpenAI's 20)


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or sent back to wait
    RUNNING = "running"  # holds KV blocks and is scheduled step by step
    PREEMPTED = "preempted"  # lost its blocks to others; waits to be run again
    FINISHED = "finished"  # hit max_tokens or a stop token
    ABORTED = "aborted"  # cancelled by the caller, or exported to another engine


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int = 0  # each request samples from its own generator: the batch cannot change its tokens
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()
    n: int = 1  # samples of the prompt; they share its KV blocks, and sample i draws with seed + i
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k likeliest rivals
    stop: tuple[str, ...] = ()  # strings that end the output once its text ends with one
    min_tokens: int = 0  # before this many tokens, stop tokens are never drawn and stop strings do not count

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        for name, low in (("max_tokens", 1), ("n", 1), ("min_tokens", 0)):
            value = getattr(self, name)
            if not _whole(value) or value < low:
                raise ValueError(f"{name} must be a whole number >= {low}; got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is more than max_tokens {self.max_tokens}")
        if not isinstance(self.stop_tokens, tuple) or not all(_whole(t) and t >= 0 for t in self.stop_tokens):
            raise ValueError(f"stop_tokens must be a tuple of token ids >= 0; got {self.stop_tokens!r}")
        if self.logprobs is not None and (not _whole(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or a whole number in [0, {MAX_LOGPROBS}] (the rivals listed "
                             f"beside each token); got {self.logprobs!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings; got {self.stop!r}")

    def for_sample(self, index: int) -> SamplingParams:
        """Sample `index` of n alone: what it draws equals a one-sample request with seed + index."""
        return replace(self, seed=self.seed + index, n=1)


def _whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(eq=False)  # a request is itself: equal only to itself, hashed by identity
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    seq: int | None = None  # its sequence in the KV pool while it holds blocks
    num_computed: int = 0  # tokens whose K and V are in the pool
    token_times_s: list[float] = field(default_factory=list)  # when each output token came out
    finish_s: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or why it was rejected
    admitted_s: float | None = None  # when it first took part in a step
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache served, summed over its admissions
    draft_room: int = 0  # speculative decoding: drafted tokens the scheduler made room for this step
    parent_id: int | None = None  # sample i > 0 of n: the request (sample 0) that prefills their prompt
    index: int = 0  # which of its prompt's n samples this is
    samples: list[Request] = field(default_factory=list, repr=False)  # sample 0: the rest, until they fork
    logprobs: list[float] = field(default_factory=list)  # each output token's log-probability (if asked)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # its likeliest rivals
    versions: list[int] = field(default_factory=list)  # the weight version that produced each output token
    detokenize: Callable[[list[int]], str] | None = field(default=None, repr=False)  # for stop strings
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"request {self.request_id} has an empty prompt; it needs at least one token")
        self.prompt = [int(t) for t in self.prompt]
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def group_id(self) -> int:
        """The id the caller knows: its own, or for sample i > 0 of n, sample 0's."""
        return self.request_id if self.parent_id is None else self.parent_id

    def next_tokens(self, n: int) -> list[int]:
        """The `n` tokens after the computed ones (what a step with n tokens runs)."""
        start, prompt = self.num_computed, len(self.prompt)
        if start + n <= prompt:
            return self.prompt[start:start + n]
        return (self.prompt[start:] + self.output[max(start - prompt, 0):start + n - prompt])

    @property
    def num_uncomputed(self) -> int:
        """Tokens the next steps must still compute before the next one can be sampled."""
        return len(self.prompt) + len(self.output) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def is_done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def draftable(self) -> int:
        """Tokens a draft may propose after the next one (the target's own token fills the last place)."""
        return self.params.max_tokens - len(self.output) - 1

    @property
    def may_stop(self) -> bool:
        """Stop tokens and strings count from min_tokens output tokens on."""
        return len(self.output) >= self.params.min_tokens

    def append(self, token: int, now_s: float, version: int = 0, logprob: float | None = None,
               top: tuple[tuple[int, float], ...] | None = None) -> None:
        """Take a sampled token (made by weight `version`, with its log-probability if asked);
        finish on a stop token, a stop string, or at max_tokens."""
        self.output.append(int(token))
        self.token_times_s.append(now_s)
        self.versions.append(version)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.top_logprobs.append(top or ())
        if self.may_stop and (int(token) in self.params.stop_tokens or self._ends_with_stop_string()):
            self.finish(RequestState.FINISHED, "stop", now_s)
        elif len(self.output) >= self.params.max_tokens:
            self.finish(RequestState.FINISHED, "length", now_s)

    def _ends_with_stop_string(self) -> bool:
        stop = self.params.stop
        if not stop:
            return False
        if self.detokenize is None:
            raise ValueError(f"request {self.request_id} has stop strings but its engine has no detokenizer")
        window = 4 * max(len(s) for s in stop) + 4  # tokens: enough for the longest string, 4 bytes a character
        text, last = self.detokenize(self.output[-window:]), len(self.detokenize(self.output[-1:]))
        return any(s in text[-(len(s) + last - 1):] for s in stop)  # a string the last token completed

    def extend(self, tokens: list[int], now_s: float, version: int = 0, logprobs: list[float] | None = None,
               tops: list | None = None) -> list[int]:
        """Take several tokens from one step (speculative decoding) until the request finishes;
        returns those it took."""
        taken = []
        for i, token in enumerate(tokens):
            if self.is_done:
                break
            self.append(token, now_s, version, None if logprobs is None else logprobs[i],
                        None if tops is None else tops[i])
            taken.append(int(token))
        return taken

    def finish(self, state: RequestState, reason: str, now_s: float) -> None:
        self.state, self.finish_reason, self.finish_s = state, reason, now_s
