"""Timed request streams that drive chapter 05's serving engine: each request has an arrival
time, a prompt of real Python and the number of tokens it will generate.

Arrivals are a Poisson process, as in the vLLM paper's serving experiments (Kwon et al., SOSP
2023, Section 6.1), and lengths are log-normal with ShareGPT's means (161.31 prompt and 337.99
output tokens) scaled to the book's 512-token context. Prompts are windows of the held-out
validation files (`corpus.VALIDATION`), so the model sees text it was not trained on. A request
generates exactly `max_tokens` tokens: the engine runs with no stop tokens, as vLLM's benchmarks
do with `ignore_eos`. `static_ceiling` gives the most continuous batching can gain over static
batching on a set of output lengths (Orca, Yu et al., OSDI 2022).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from infra_lab.kv import accounting
from infra_lab.model import corpus, tokenizer
from infra_lab.model.config import CONFIGS
from infra_lab.serving import radix_serving

MAX_LEN = CONFIGS["target"].context  # tokens: prompt + output of one request must fit
MEAN_SHARE = 0.5  # ShareGPT-like lengths are scaled so that mean prompt + output = MEAN_SHARE * max_len


@dataclass(frozen=True)
class TimedRequest:
    arrival_s: float  # seconds after the stream starts
    prompt: list[int]  # token ids (bytes)
    max_tokens: int  # tokens it generates: no stop tokens end it early

    def __post_init__(self):
        if not 0 <= self.arrival_s < math.inf:
            raise ValueError(f"arrival_s must be finite and >= 0; got {self.arrival_s}")
        if len(self.prompt) < 1:
            raise ValueError("prompt must hold at least one token; got an empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")


def _check_count(name: str, value, least: int) -> None:
    if not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")


def _check_rate(name: str, rate: float) -> None:
    if not rate > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0 requests per second (math.inf: all at once); got {rate}")


def _child_seeds(seed: int, k: int) -> list[int]:
    """`k` independent seeds from one, so arrivals, lengths and prompts do not share a stream."""
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(k)]


def poisson_arrivals(rate_per_s: float, n: int, seed: int = 0) -> np.ndarray:
    """(n,) arrival times in seconds: cumulative exponential gaps of mean 1 / rate_per_s, the first
    one after 0; `rate_per_s=math.inf` puts every arrival at 0."""
    _check_rate("rate_per_s", rate_per_s)
    _check_count("n", n, 1)
    if rate_per_s == math.inf:
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1 / rate_per_s, n))


@functools.cache
def _validation_sources() -> tuple[tuple[bytes, np.ndarray], ...]:
    """(bytes, line starts) of every validation file; a line start is 0 or just after a newline."""
    root = corpus.stdlib_root()
    sources = []
    for name in corpus.VALIDATION:
        data = (root / name).read_bytes()
        after_newline = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1
        sources.append((data, np.concatenate([[0], after_newline[after_newline < len(data)]])))
    return tuple(sources)


def _check_lengths(lengths, longest: int, what: str) -> None:
    for length in lengths:
        if not isinstance(length, (int, np.integer)) or not 1 <= length <= longest:
            raise ValueError(f"prompt lengths must be integers in [1, {longest}] ({what}); got {length!r}")


def stdlib_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """One prompt per length: that many bytes of a validation file (chosen uniformly among those
    long enough), starting at a line start chosen uniformly among those that leave room."""
    sources = _validation_sources()
    _check_lengths(lengths, max(len(data) for data, _ in sources), "the longest validation file")
    rng = np.random.default_rng(seed)
    prompts = []
    for length in lengths:
        data, starts = sources[rng.choice([i for i, (d, _) in enumerate(sources) if len(d) >= length])]
        room = np.searchsorted(starts, len(data) - length, side="right")  # starts[:room] leave `length` bytes
        start = int(starts[rng.integers(room)])
        prompts.append(tokenizer.encode(data[start:start + length]).tolist())
    return prompts


def tokenized_prompts(lengths: list[int], encode, seed: int = 0) -> list[list[int]]:
    """One prompt per length in another tokenizer's ids (`encode`: str -> list of ids, a pretrained
    model's): that many tokens of one validation file's text, from a token chosen uniformly among
    those that leave room, the file chosen uniformly among those long enough."""
    files = [encode(data.decode("utf-8", "replace")) for data, _ in _validation_sources()]
    _check_lengths(lengths, max(len(ids) for ids in files), "the longest validation file, in these tokens")
    rng = np.random.default_rng(seed)
    prompts = []
    for length in lengths:
        ids = files[rng.choice([i for i, f in enumerate(files) if len(f) >= length])]
        start = int(rng.integers(len(ids) - length + 1))
        prompts.append(list(ids[start:start + length]))
    return prompts


def sharegpt_lengths(n: int, seed: int = 0, max_len: int = MAX_LEN, scale: float | None = None,
                     sigma: float = 1.0) -> list[tuple[int, int]]:
    """(prompt, output) token counts: log-normal with ShareGPT's means times `scale`, clipped so
    1 <= prompt, 1 <= output and prompt + output <= max_len (`accounting.synthetic_requests`).
    The default scale makes the unclipped mean of prompt + output MEAN_SHARE * max_len (256 of
    512: scale 0.513, means 82.7 and 173.3); clipping the long tail lowers the realized means (to
    about 80 and 146, 226 in all, with one request in ten clipped to fill max_len)."""
    if scale is None:
        scale = MEAN_SHARE * max_len / sum(accounting.DATASETS["sharegpt"])
    if not 0 <= sigma < math.inf:
        raise ValueError(f"sigma must be finite and >= 0; got {sigma}")
    requests = accounting.synthetic_requests("sharegpt", n, seed, max_len, sigma, scale=scale)
    return [(r.prompt, r.output) for r in requests]


def _sharegpt_requests(arrivals: np.ndarray, seed: int, max_len: int) -> list[TimedRequest]:
    """ShareGPT-like requests at `arrivals` (seconds), returned in arrival order."""
    length_seed, prompt_seed = _child_seeds(seed, 2)
    lengths = sharegpt_lengths(len(arrivals), length_seed, max_len)
    prompts = stdlib_prompts([prompt for prompt, _ in lengths], prompt_seed)
    order = np.argsort(arrivals, kind="stable")
    return [TimedRequest(float(arrivals[i]), prompts[i], lengths[i][1]) for i in order]


def sharegpt_like(n: int, rate_per_s: float, seed: int = 0, max_len: int = MAX_LEN) -> list[TimedRequest]:
    """`n` requests arriving as a Poisson stream of `rate_per_s`, with ShareGPT-like lengths
    (`sharegpt_lengths`) and prompts of real Python (`stdlib_prompts`)."""
    arrival_seed, request_seed = _child_seeds(seed, 2)
    return _sharegpt_requests(poisson_arrivals(rate_per_s, n, arrival_seed), request_seed, max_len)


def shared_prefix(n: int, rate_per_s: float, n_prefixes: int = 3, max_tokens: int = 32, seed: int = 0,
                  max_len: int = MAX_LEN, prefix_bytes: int = 320) -> list[TimedRequest]:
    """`n` Poisson arrivals whose prompts share `n_prefixes` module openings of at most
    `prefix_bytes` bytes (`radix_serving.shared_prefix_prompts`: prompts of up to prefix_bytes +
    126 bytes), each generating `max_tokens` tokens."""
    _check_count("n", n, 1)
    _check_rate("rate_per_s", rate_per_s)
    _check_count("max_tokens", max_tokens, 1)
    arrival_seed, prompt_seed = _child_seeds(seed, 2)
    prompts = [tokenizer.encode(p).tolist()
               for p in radix_serving.shared_prefix_prompts(n, n_prefixes, prefix_bytes, prompt_seed)]
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > max_len:
        raise ValueError(f"a prompt of {longest} tokens plus max_tokens={max_tokens} exceeds max_len={max_len}; "
                         "lower max_tokens or prefix_bytes")
    arrivals = poisson_arrivals(rate_per_s, n, arrival_seed)
    return [TimedRequest(float(t), p, max_tokens) for t, p in zip(arrivals, prompts)]


def burst(n: int, at_s: float = 0.0, background: int = 0, background_rate_per_s: float = 1.0, seed: int = 0,
          max_len: int = MAX_LEN) -> list[TimedRequest]:
    """`n` ShareGPT-like requests that all arrive at `at_s`, after (and among) `background`
    ShareGPT-like requests arriving as a Poisson stream of `background_rate_per_s` from time 0.
    In arrival order; a background request arriving exactly at `at_s` comes first."""
    _check_count("n", n, 1)
    _check_count("background", background, 0)
    if not 0 <= at_s < math.inf:
        raise ValueError(f"at_s must be finite and >= 0; got {at_s}")
    arrival_seed, request_seed = _child_seeds(seed, 2)
    steady = poisson_arrivals(background_rate_per_s, background, arrival_seed) if background else np.zeros(0)
    return _sharegpt_requests(np.concatenate([steady, np.full(n, float(at_s))]), request_seed, max_len)


def long_prompts_among_decodes(n_decodes: int = 8, decode_prompt: int = 32, decode_output: int = 384,
                               n_long: int = 4, long_output: int = 4, first_long_s: float = 0.5,
                               period_s: float = 1.0, seed: int = 0, max_len: int = MAX_LEN) -> list[TimedRequest]:
    """The chunked-prefill experiment (Sarathi-Serve, Agrawal et al., OSDI 2024): `n_decodes`
    requests arrive at 0 with `decode_prompt`-token prompts and generate `decode_output` tokens
    each, so they decode for a long time; meanwhile `n_long` requests with prompts of max_len -
    long_output tokens, generating `long_output` tokens, arrive at first_long_s + i * period_s.
    Without chunking, each long prefill stalls every decode for one long step. Lengths are fixed;
    `seed` picks the prompts' text."""
    _check_count("n_decodes", n_decodes, 1)
    _check_count("n_long", n_long, 1)
    _check_count("decode_prompt", decode_prompt, 1)
    _check_count("decode_output", decode_output, 1)
    if decode_prompt + decode_output > max_len:
        raise ValueError(f"decode_prompt + decode_output = {decode_prompt + decode_output} exceeds max_len={max_len}")
    if not isinstance(long_output, (int, np.integer)) or not 1 <= long_output < max_len:
        raise ValueError(f"long_output must be an integer in [1, {max_len - 1}]; got {long_output!r}")
    if not (0 <= first_long_s < math.inf and 0 < period_s < math.inf):
        raise ValueError(f"need finite first_long_s >= 0 and period_s > 0; got {first_long_s}, {period_s}")
    prompts = stdlib_prompts([decode_prompt] * n_decodes + [max_len - long_output] * n_long, seed)
    decodes = [TimedRequest(0.0, p, decode_output) for p in prompts[:n_decodes]]
    longs = [TimedRequest(first_long_s + i * period_s, p, long_output) for i, p in enumerate(prompts[n_decodes:])]
    return decodes + longs


def static_ceiling(output_lengths, batch: int) -> float:
    """E[max of `batch` lengths drawn with replacement] / E[length]: how much faster continuous
    batching can decode than static batching, where a batch runs until its longest member ends
    (batch * E[max] steps of slots for batch * E[length] tokens). Exact: with x_(1) <= ... <= x_(n)
    sorted, E[max] = sum_k x_(k) * ((k/n)^batch - ((k-1)/n)^batch)."""
    _check_count("batch", batch, 1)
    lengths = np.sort(np.asarray(output_lengths, dtype=np.float64).ravel())  # (n,)
    if lengths.size == 0 or not np.all((lengths > 0) & np.isfinite(lengths)):
        raise ValueError(f"output_lengths must be a non-empty set of finite lengths > 0; got {output_lengths!r}")
    k = np.arange(1, lengths.size + 1) / lengths.size
    below = np.concatenate([[0.0], k[:-1]])
    return float(lengths @ (k**batch - below**batch) / lengths.mean())
