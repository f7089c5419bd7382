"""bench_metrics: every metric of hand-made traces equals a hand computation; hypothesis checks
the module against a brute-force recomputation in plain Python; bad input names itself."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.orchestration import bench_metrics
from infra_lab.orchestration.bench_metrics import RequestTrace

# A: 3 text chunks, no usage: TTFT 0.1, E2E 0.6, TPOT (0.6 - 0.1) / 2 = 0.25, ITL 0.2 and 0.3
A = RequestTrace(0.0, (0.1, 0.3, 0.6), prompt_tokens=10)
# B: 2 chunks carrying 11 tokens: TTFT 0.5, E2E 1.5, TPOT 1.0 / 10 = 0.1, ITL 1.0
B = RequestTrace(1.0, (1.5, 2.5), completion_tokens=11, prompt_tokens=100, cached_tokens=40)
# C: one token: TTFT = E2E = 0.2, no TPOT, no ITL
C = RequestTrace(2.0, (2.2,), completion_tokens=1, prompt_tokens=50, cached_tokens=10)
D = RequestTrace(3.0, success=False, status=500, error="HTTP 500")
TRACES = [A, B, C, D]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_one_trace_by_hand():
    assert (A.output_tokens, A.ttft_s, A.e2el_s) == (3, 0.1, 0.6)
    assert close(A.tpot_s, 0.25) and all(map(close, A.itls_s, [0.2, 0.3]))
    assert (B.output_tokens, B.ttft_s, B.e2el_s, B.itls_s) == (11, 0.5, 1.5, [1.0])
    assert close(B.tpot_s, 0.1)
    assert C.tpot_s is None and C.itls_s == []


def test_counts_and_throughputs_by_hand():
    m = bench_metrics.compute(TRACES, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"], m["total_cached_tokens"]) == (160, 15, 50)
    assert close(m["prefix_hit_rate"], 50 / 160)
    assert close(m["request_throughput"], 0.75)
    assert close(m["output_throughput"], 3.75)
    assert close(m["total_token_throughput"], 175 / 4)
    assert m["request_goodput"] is None


def test_latency_statistics_by_hand():
    m = bench_metrics.compute(TRACES, duration_s=4.0, percentiles=[50, 90, 99])
    ttft = [100, 500, 200]
    assert close(m["mean_ttft_ms"], 800 / 3) and close(m["median_ttft_ms"], 200)
    assert close(m["std_ttft_ms"], math.sqrt(sum((x - 800 / 3) ** 2 for x in ttft) / 3))
    assert close(m["p99_ttft_ms"], 200 + 0.98 * 300)  # position 0.99 * 2 = 1.98 of [100, 200, 500]
    assert close(m["p50_ttft_ms"], 200)
    # TPOT is over requests with > 1 token: A 250 ms, B 100 ms
    assert close(m["mean_tpot_ms"], 175) and close(m["median_tpot_ms"], 175) and close(m["std_tpot_ms"], 75)
    assert close(m["p99_tpot_ms"], 100 + 0.99 * 150)
    # ITL pools every gap: A's 200 and 300 ms, B's 1000 ms
    assert close(m["mean_itl_ms"], 500) and close(m["median_itl_ms"], 300)
    assert close(m["p90_itl_ms"], 300 + 0.8 * 700)
    assert close(m["mean_e2el_ms"], (600 + 1500 + 200) / 3) and close(m["median_e2el_ms"], 600)


@pytest.mark.parametrize("slos, meeting", [
    (["ttft:300"], 2),  # A, C
    (["tpot:200"], 2),  # B, and C, which has no TPOT
    (["ttft:300", "tpot:200"], 1),  # C
    (["e2e:1000"], 2),  # A, C
    ({"ttft": 1000, "e2e": 2000}, 3),
    (["ttft:50"], 0),
])
def test_goodput_by_hand(slos, meeting):
    assert close(bench_metrics.compute(TRACES, 4.0, goodput=slos)["request_goodput"], meeting / 4)


def test_tpot_and_itl_differ_for_chunks_of_many_tokens():
    """One token at once, then two chunks of 10 tokens 10 s apart: TPOT 1 s, ITL 10 s."""
    trace = RequestTrace(0.0, (0.0, 10.0, 20.0), completion_tokens=21)
    m = bench_metrics.compute([trace], 20.0)
    assert close(m["mean_tpot_ms"], 1000) and close(m["mean_itl_ms"], 10_000)


def test_key_names_are_vllms():
    m = bench_metrics.compute([A], 1.0, percentiles=[99, 99.9])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99", "p99.9"):
            assert f"{stat}_{name}_ms" in m


def test_no_completed_request_reports_zeros():
    m = bench_metrics.compute([D], 1.0, goodput=["ttft:1"])
    assert (m["completed"], m["failed"], m["mean_ttft_ms"], m["p99_itl_ms"], m["request_goodput"]) == (0, 1, 0, 0, 0)


def test_rows_and_table():
    rows = bench_metrics.request_rows(TRACES)
    assert rows[0] == {"ttft_ms": 100.0, "e2el_ms": 600.0, "output_tokens": 3, "prompt_tokens": 10,
                       "cached_tokens": 0, "itl_ms": [200.0, 300.0]}
    assert rows[3] == {"success": False, "status": 500, "error": "HTTP 500"}
    table = bench_metrics.summary_table(bench_metrics.compute(TRACES, 4.0, goodput=["ttft:300"]))
    for label in ("Successful requests:", "Request goodput (req/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "P50 E2EL (ms):"):
        assert label in table
    assert "goodput" not in bench_metrics.summary_table(bench_metrics.compute(TRACES, 4.0))


# ---- against a brute-force recomputation ----------------------------------------------------------

def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _percentile(xs, p):
    """Linear interpolation between the closest ranks, written out."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    position = p / 100 * (len(xs) - 1)
    low = math.floor(position)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (position - low) * (xs[high] - xs[low])


def _std(xs):
    return math.sqrt(_mean([(x - _mean(xs)) ** 2 for x in xs])) if xs else 0.0


@st.composite
def traces(draw):
    send_s = draw(st.floats(0, 1000))
    if not draw(st.booleans()):
        return RequestTrace(send_s, success=False, status=draw(st.sampled_from([None, 429, 500])), error="x")
    first_s = draw(st.floats(0, 10))
    gaps_s = draw(st.lists(st.floats(0, 10), max_size=6))
    chunks = [send_s + first_s]
    for gap in gaps_s:
        chunks.append(chunks[-1] + gap)
    prompt = draw(st.integers(0, 1000))
    return RequestTrace(send_s, tuple(chunks), completion_tokens=draw(st.none() | st.integers(1, 100)),
                        prompt_tokens=prompt, cached_tokens=draw(st.integers(0, prompt)))


@given(st.lists(traces(), min_size=1, max_size=12), st.floats(0.01, 1000),
       st.lists(st.floats(0, 100), min_size=1, max_size=3),
       st.dictionaries(st.sampled_from(["ttft", "tpot", "e2e"]), st.floats(0, 20_000)))
def test_metrics_match_brute_force(batch, duration_s, percentiles, slos):
    m = bench_metrics.compute(batch, duration_s, percentiles, slos)
    done = [t for t in batch if t.success]
    ms = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    good = 0
    for t in done:
        out = t.completion_tokens if t.completion_tokens is not None else len(t.chunk_s)
        ttft, e2el = (t.chunk_s[0] - t.send_s) * 1000, (t.chunk_s[-1] - t.send_s) * 1000
        tpot = (e2el - ttft) / (out - 1) if out > 1 else None
        ms["ttft"].append(ttft)
        ms["e2el"].append(e2el)
        if tpot is not None:
            ms["tpot"].append(tpot)
        ms["itl"] += [(b - a) * 1000 for a, b in zip(t.chunk_s, t.chunk_s[1:])]
        measured = {"ttft": ttft, "tpot": tpot, "e2e": e2el}
        good += all(measured[k] is None or measured[k] <= v for k, v in slos.items())
    outputs = sum(t.completion_tokens if t.completion_tokens is not None else len(t.chunk_s) for t in done)
    inputs = sum(t.prompt_tokens for t in done)
    assert m["completed"] == len(done) and m["failed"] == len(batch) - len(done)
    assert m["total_output_tokens"] == outputs and m["total_input_tokens"] == inputs
    assert math.isclose(m["total_token_throughput"], (inputs + outputs) / duration_s)
    if slos:
        assert math.isclose(m["request_goodput"], good / duration_s)
    for name, values in ms.items():
        tolerance = dict(rel_tol=1e-9, abs_tol=1e-6)
        assert math.isclose(m[f"mean_{name}_ms"], _mean(values), **tolerance)
        assert math.isclose(m[f"median_{name}_ms"], _percentile(values, 50), **tolerance)
        assert math.isclose(m[f"std_{name}_ms"], _std(values), rel_tol=1e-6, abs_tol=1e-5)
        for p in percentiles:
            assert math.isclose(m[f"{bench_metrics.percentile_name(p)}_{name}_ms"], _percentile(values, p),
                                **tolerance)


@given(st.lists(traces(), min_size=1, max_size=12))
def test_tpot_weights_requests_and_itl_pools_gaps(batch):
    """Mean ITL is total gap time over the number of gaps; mean TPOT a mean over requests."""
    m = bench_metrics.compute(batch, 1.0)
    gaps = [g for t in batch if t.success for g in t.itls_s]
    tpots = [t.tpot_s for t in batch if t.success and t.tpot_s is not None]
    assert math.isclose(m["mean_itl_ms"], 1000 * sum(gaps) / len(gaps) if gaps else 0, rel_tol=1e-9, abs_tol=1e-6)
    assert math.isclose(m["mean_tpot_ms"], 1000 * sum(tpots) / len(tpots) if tpots else 0, rel_tol=1e-9,
                        abs_tol=1e-6)


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, named", [
    (["itl:50"], "'itl'.*ttft, tpot, e2e"),
    (["ttft:-5"], "-5"),
    (["ttft:inf"], "inf"),
    (["ttft:fast"], "fast"),
    (["ttft"], "METRIC:MS.*'ttft'"),
    (["ttft:5", "ttft:6"], "twice"),
])
def test_bad_goodput_names_the_value(spec, named):
    with pytest.raises(ValueError, match=named):
        bench_metrics.parse_goodput(spec)


@pytest.mark.parametrize("text, named", [("50,101", "101"), ("50,x", "'x'"), ("-1", "-1"), ("", "''")])
def test_bad_percentiles_name_the_value(text, named):
    with pytest.raises(ValueError, match=named):
        bench_metrics.parse_percentiles(text)


@pytest.mark.parametrize("duration_s", [0.0, -1.0, math.inf, math.nan])
def test_bad_duration_names_the_value(duration_s):
    with pytest.raises(ValueError, match=f"duration_s.*{duration_s}"):
        bench_metrics.compute([A], duration_s)


@pytest.mark.parametrize("kwargs, named", [
    (dict(send_s=0.0, chunk_s=()), "at least one output chunk"),
    (dict(send_s=1.0, chunk_s=(0.5,)), "send_s=1.0"),
    (dict(send_s=0.0, chunk_s=(0.2, 0.1)), "non-decreasing"),
    (dict(send_s=0.0, chunk_s=(0.1,), prompt_tokens=5, cached_tokens=6), "cached_tokens=6"),
    (dict(send_s=0.0, chunk_s=(0.1,), prompt_tokens=-1), "prompt_tokens.*-1"),
    (dict(send_s=0.0, chunk_s=(0.1,), completion_tokens=-2), "completion_tokens.*-2"),
    (dict(send_s=math.nan), "send_s.*nan"),
])
def test_bad_trace_names_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        RequestTrace(**kwargs)
