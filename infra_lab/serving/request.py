"""A request to the serving engine: its prompt, how to sample its answer, where it stands, and
the timestamps that latency metrics are computed from (chapter 05).

A request's tokens are its prompt followed by what it has generated; `num_computed` counts those
whose keys and values sit in the KV pool. A step computes some of the rest: a chunk of the prompt,
or the one token generated last, and samples the next token when it reaches the end.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from infra_lab.model.generate import check_sampling


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or sent back to wait
    RUNNING = "running"  # holds KV blocks and is scheduled step by step
    PREEMPTED = "preempted"  # lost its blocks to others; waits to be run again
    FINISHED = "finished"  # hit max_tokens or a stop token
    ABORTED = "aborted"  # cancelled by the caller


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int = 0  # each request samples from its own generator: the batch cannot change its tokens
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)):
            raise ValueError(f"max_tokens must be a whole number >= 1; got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if not isinstance(self.stop_tokens, tuple) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in self.stop_tokens):
            raise ValueError(f"stop_tokens must be a tuple of token ids >= 0; got {self.stop_tokens!r}")


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
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"request {self.request_id} has an empty prompt; it needs at least one token")
        self.prompt = [int(t) for t in self.prompt]
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

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

    def append(self, token: int, now_s: float) -> None:
        """Take a sampled token; finish on a stop token or at max_tokens."""
        self.output.append(int(token))
        self.token_times_s.append(now_s)
        if int(token) in self.params.stop_tokens:
            self.finish(RequestState.FINISHED, "stop", now_s)
        elif len(self.output) >= self.params.max_tokens:
            self.finish(RequestState.FINISHED, "length", now_s)

    def extend(self, tokens: list[int], now_s: float) -> list[int]:
        """Take several tokens from one step (speculative decoding) until the request finishes;
        returns those it took."""
        taken = []
        for token in tokens:
            if self.is_done:
                break
            self.append(token, now_s)
            taken.append(int(token))
        return taken

    def finish(self, state: RequestState, reason: str, now_s: float) -> None:
        self.state, self.finish_reason, self.finish_s = state, reason, now_s
