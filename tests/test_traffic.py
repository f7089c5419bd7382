"""Timed request streams: seeded, within the context, real held-out Python, and an exact static-batching ceiling."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.kv import accounting
from infra_lab.model import corpus
from infra_lab.serving import radix_serving, traffic
from infra_lab.serving.traffic import TimedRequest

SOURCES = [(corpus.stdlib_root() / name).read_bytes() for name in corpus.VALIDATION]


def _at_a_line_start(window: bytes) -> bool:
    """Whether `window` occurs in a validation file starting at 0 or just after a newline."""
    for data in SOURCES:
        at = data.find(window)
        while at >= 0:
            if at == 0 or data[at - 1:at] == b"\n":
                return True
            at = data.find(window, at + 1)
    return False


def _within(requests, max_len=traffic.MAX_LEN):
    return all(len(r.prompt) >= 1 and r.max_tokens >= 1 and len(r.prompt) + r.max_tokens <= max_len
               for r in requests)


def test_every_stream_is_seeded():
    makers = [lambda s: traffic.sharegpt_like(40, 4.0, seed=s), lambda s: traffic.shared_prefix(20, 2.0, seed=s),
              lambda s: traffic.burst(10, 3.0, background=10, seed=s),
              lambda s: traffic.long_prompts_among_decodes(seed=s)]
    for make in makers:
        assert make(3) == make(3)
        assert make(3) != make(4)
    assert traffic.stdlib_prompts([50, 7], seed=1) == traffic.stdlib_prompts([50, 7], seed=1)
    assert np.array_equal(traffic.poisson_arrivals(2.0, 30, seed=5), traffic.poisson_arrivals(2.0, 30, seed=5))


def test_poisson_gaps_have_mean_one_over_the_rate():
    arrivals = traffic.poisson_arrivals(5.0, 100_000, seed=0)
    gaps = np.diff(arrivals, prepend=0.0)
    assert arrivals[0] > 0 and np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.02)  # the mean's spread is 0.3%: fixed seed, no flake
    assert gaps.std() == pytest.approx(1 / 5.0, rel=0.03)  # exponential: std = mean
    assert np.array_equal(traffic.poisson_arrivals(math.inf, 4), np.zeros(4))


@given(n=st.integers(1, 50), seed=st.integers(0, 2**32 - 1), max_len=st.integers(2, 2048),
       sigma=st.floats(0, 2.5))
def test_sharegpt_lengths_fit_max_len(n, seed, max_len, sigma):
    lengths = traffic.sharegpt_lengths(n, seed, max_len, sigma=sigma)
    assert len(lengths) == n
    assert all(p >= 1 and o >= 1 and p + o <= max_len for p, o in lengths)


def test_sharegpt_lengths_are_scaled_to_the_context():
    lengths = np.array(traffic.sharegpt_lengths(20_000, seed=0))  # (n, 2)
    scale = traffic.MEAN_SHARE * traffic.MAX_LEN / sum(accounting.DATASETS["sharegpt"])
    assert lengths[:, 0].mean() == pytest.approx(161.31 * scale, rel=0.1)  # clipping trims the tail a little
    assert 0.4 * traffic.MAX_LEN < lengths.sum(axis=1).mean() <= traffic.MEAN_SHARE * traffic.MAX_LEN
    assert (lengths[:, 1] > lengths[:, 0]).mean() > 0.6  # ShareGPT answers run longer than questions


def test_synthetic_requests_scale_keeps_the_default_and_scales_the_means():
    assert accounting.synthetic_requests("sharegpt", 50, seed=2, scale=1.0) == \
        accounting.synthetic_requests("sharegpt", 50, seed=2)
    half = accounting.synthetic_requests("alpaca", 20_000, seed=0, scale=0.5)
    assert np.mean([r.output for r in half]) == pytest.approx(58.45 / 2, rel=0.08)


def test_prompts_are_windows_of_validation_files_at_line_starts():
    lengths = [1, 2, 17, 160, 511, 5000, max(len(s) for s in SOURCES)]
    prompts = traffic.stdlib_prompts(lengths, seed=0)
    assert [len(p) for p in prompts] == lengths
    for prompt in prompts:
        assert _at_a_line_start(bytes(prompt))
    for request in traffic.sharegpt_like(30, 10.0, seed=1):
        assert _at_a_line_start(bytes(request.prompt))


def test_tokenized_prompts_are_windows_of_a_file_in_another_tokenizers_ids():
    def words(text: str) -> list[int]:  # a stand-in tokenizer: one id per word, its length
        return [len(w) for w in text.split()]

    files = [words(data.decode("utf-8", "replace")) for data in SOURCES]
    lengths = [1, 7, 40, 300]
    prompts = traffic.tokenized_prompts(lengths, words, seed=3)
    assert [len(p) for p in prompts] == lengths
    for prompt in prompts:
        assert any(ids[i:i + len(prompt)] == prompt for ids in files for i in range(len(ids) - len(prompt) + 1))
    assert traffic.tokenized_prompts(lengths, words, seed=3) == prompts
    longest = max(len(ids) for ids in files)
    for bad in (0, longest + 1, 2.5):
        with pytest.raises(ValueError, match=f"in \\[1, {longest}\\].*got {bad!r}"):
            traffic.tokenized_prompts([bad], words)


def test_sharegpt_like_arrives_in_order_within_the_context():
    requests = traffic.sharegpt_like(200, 8.0, seed=0)
    assert len(requests) == 200 and _within(requests)
    times = [r.arrival_s for r in requests]
    assert times == sorted(times) and times[0] > 0
    assert [r.arrival_s for r in traffic.sharegpt_like(5, math.inf)] == [0.0] * 5
    assert _within(traffic.sharegpt_like(50, 1.0, max_len=128), 128)


def test_shared_prefix_uses_the_radix_chapters_prompts():
    requests = traffic.shared_prefix(12, 3.0, n_prefixes=2, max_tokens=40, seed=2)
    texts = [bytes(r.prompt) for r in requests]
    openings = {radix_serving.module_opening(s, 320) for s in SOURCES[:2]}
    assert all(any(t.startswith(o) for o in openings) for t in texts)
    assert all(r.max_tokens == 40 for r in requests) and _within(requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)


def test_burst_lands_all_at_once_after_the_background():
    requests = traffic.burst(16, at_s=2.0, background=30, background_rate_per_s=10.0, seed=0)
    assert len(requests) == 46 and _within(requests)
    times = [r.arrival_s for r in requests]
    assert times == sorted(times)
    assert times.count(2.0) == 16
    alone = traffic.burst(5)
    assert [r.arrival_s for r in alone] == [0.0] * 5


def test_long_prompts_arrive_while_the_others_decode():
    requests = traffic.long_prompts_among_decodes(n_decodes=6, n_long=3, first_long_s=0.25, period_s=0.5)
    decodes, longs = requests[:6], requests[6:]
    assert all(r.arrival_s == 0 and len(r.prompt) == 32 and r.max_tokens == 384 for r in decodes)
    assert [r.arrival_s for r in longs] == [0.25, 0.75, 1.25]
    assert all(len(r.prompt) == traffic.MAX_LEN - 4 and r.max_tokens == 4 for r in longs)
    assert _within(requests)
    assert all(_at_a_line_start(bytes(r.prompt)) for r in requests)


def test_static_ceiling_of_a_tiny_case_by_hand():
    # lengths 1, 2, 3; batch 2: the maxima of the 9 ordered pairs sum to 22, the mean length is 2
    assert traffic.static_ceiling([1, 2, 3], 2) == pytest.approx(22 / 9 / 2)
    assert traffic.static_ceiling([3, 1, 2], 1) == pytest.approx(1.0)
    assert traffic.static_ceiling([7, 7, 7], 16) == pytest.approx(1.0)


@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=4), batch=st.integers(1, 4))
def test_static_ceiling_matches_enumerating_every_batch(lengths, batch):
    maxima = [max(draw) for draw in itertools.product(lengths, repeat=batch)]
    assert traffic.static_ceiling(lengths, batch) == pytest.approx(np.mean(maxima) / np.mean(lengths))


def test_static_ceiling_matches_monte_carlo_and_grows_with_the_batch():
    outputs = [o for _, o in traffic.sharegpt_lengths(500, seed=0)]
    rng = np.random.default_rng(0)
    sampled = rng.choice(outputs, size=(100_000, 8)).max(axis=1).mean() / np.mean(outputs)
    assert traffic.static_ceiling(outputs, 8) == pytest.approx(sampled, rel=0.01)
    ceilings = [traffic.static_ceiling(outputs, b) for b in (1, 2, 4, 8, 32)]
    assert ceilings[0] == pytest.approx(1.0) and np.all(np.diff(ceilings) > 0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="rate_per_s must be > 0.*got 0"):
        traffic.poisson_arrivals(0, 5)
    with pytest.raises(ValueError, match="rate_per_s must be > 0.*got nan"):
        traffic.sharegpt_like(5, math.nan)
    with pytest.raises(ValueError, match="n must be an integer >= 1; got 0"):
        traffic.poisson_arrivals(1.0, 0)
    with pytest.raises(ValueError, match=r"prompt lengths must be integers in \[1, \d+\].*got 0"):
        traffic.stdlib_prompts([5, 0])
    with pytest.raises(ValueError, match="sigma must be finite and >= 0; got -1"):
        traffic.sharegpt_lengths(5, sigma=-1)
    with pytest.raises(ValueError, match="scale must be a positive finite number; got 0"):
        traffic.sharegpt_lengths(5, scale=0)
    with pytest.raises(ValueError, match="need n >= 1 and max_len >= 2; got n=5, max_len=1"):
        traffic.sharegpt_lengths(5, max_len=1)
    with pytest.raises(ValueError, match="plus max_tokens=200 exceeds max_len=512"):
        traffic.shared_prefix(10, 1.0, max_tokens=200)
    with pytest.raises(ValueError, match="n must be an integer >= 1; got 0"):
        traffic.shared_prefix(0, 1.0)
    with pytest.raises(ValueError, match="at_s must be finite and >= 0; got -1"):
        traffic.burst(3, at_s=-1)
    with pytest.raises(ValueError, match="background must be an integer >= 0; got -2"):
        traffic.burst(3, background=-2)
    with pytest.raises(ValueError, match="decode_prompt \\+ decode_output = 544 exceeds max_len=512"):
        traffic.long_prompts_among_decodes(decode_prompt=160)
    with pytest.raises(ValueError, match=r"long_output must be an integer in \[1, 511\]; got 512"):
        traffic.long_prompts_among_decodes(long_output=512)
    with pytest.raises(ValueError, match="need finite first_long_s >= 0 and period_s > 0; got 0.5, 0"):
        traffic.long_prompts_among_decodes(period_s=0)
    with pytest.raises(ValueError, match="batch must be an integer >= 1; got 0"):
        traffic.static_ceiling([1, 2], 0)
    with pytest.raises(ValueError, match="output_lengths must be a non-empty set of finite lengths > 0"):
        traffic.static_ceiling([3, 0], 2)
    with pytest.raises(ValueError, match="output_lengths must be a non-empty"):
        traffic.static_ceiling([], 2)
    with pytest.raises(ValueError, match="arrival_s must be finite and >= 0; got -0.5"):
        TimedRequest(-0.5, [1], 1)
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        TimedRequest(0.0, [], 1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1; got 0"):
        TimedRequest(0.0, [1], 0)
