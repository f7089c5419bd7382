"""Prefill/decode placement (chapter 06): the fleet of simulated engines against the step-time
model's own arithmetic, DistServe's placement search against trying every placement, goodput's
bisection against a known threshold, the KV transfer bill against the paper, and DistServe's
Figure 1 argument and vLLM's statement at the paper's settings."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import hardware, roofline
from infra_lab.model.cost import kv_bytes_per_token
from infra_lab.orchestration import pd_claims
from infra_lab.serving import goodput as goodputs, links, placement
from infra_lab.serving.pd_fleet import (SLO, Colocated, Disaggregated, FixedLengths, Instances, Serving,
                                        TensorParallelStepTime, poisson, step_time_model)
from infra_lab.serving.pd_fleet_loop import simulate, simulate_decode, simulate_prefill
from infra_lab.serving.simulator import StepTimeModel

A100, H100 = hardware.get("A100 SXM 80GB"), hardware.get("H100 SXM")
OPT = roofline.preset("opt-13b")
SERVING = Serving(OPT, compute_efficiency=0.5, memory_efficiency=0.5)
SHORT = FixedLengths(256, 8)


# ---- one request, timed by hand ----------------------------------------------------------------------

def decode_s(model: StepTimeModel, prompt: int, output: int) -> float:
    """The output's decode steps after the first token: step k runs token P + k - 1 over its context."""
    return sum(model.seconds([(prompt + k - 1, 1)]) for k in range(1, output))


@pytest.mark.parametrize("tp", [1, 2])
def test_one_request_disaggregated_takes_the_step_models_times_and_the_links(tp):
    prompt, output = 300, 5
    pair = Disaggregated(Instances(1, A100, tp), Instances(1, H100, tp), links.NETWORK_100G)
    run = simulate(pair, SERVING, [poisson(1.0, 1, FixedLengths(prompt, output))[0]])
    prefill_model, decode_model = step_time_model(SERVING, A100, tp), step_time_model(SERVING, H100, tp)
    transfer = links.NETWORK_100G.seconds(kv_bytes_per_token(OPT, "fp16") * prompt, lanes=tp)
    assert run.ttft_s[0] == pytest.approx(prefill_model.seconds([(0, prompt)]))
    assert run.transfer_s[0] == pytest.approx(transfer)
    assert run.tpot_s[0] * (output - 1) == pytest.approx(transfer + decode_s(decode_model, prompt, output))
    assert run.imported_blocks[0] == -(-prompt // SERVING.block_size)  # the decode pool holds the prompt's K and V
    assert run.blocks_in_use_after == 0


def test_one_request_colocated_is_its_prefill_then_its_decode_steps():
    prompt, output = 200, 6
    run = simulate(Colocated(Instances(1, A100)), SERVING, poisson(1.0, 1, FixedLengths(prompt, output)))
    model = step_time_model(SERVING, A100)
    assert run.ttft_s[0] == pytest.approx(model.seconds([(0, prompt)]))
    assert run.tpot_s[0] * (output - 1) == pytest.approx(decode_s(model, prompt, output))
    assert run.transfer_s[0] == 0 and run.imported_blocks[0] == 0


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 600)), min_size=1, max_size=12),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_tensor_parallel_time_is_the_roofline_of_tp_gpus_plus_two_ring_all_reduces_a_layer(sizes, tp):
    model = step_time_model(Serving(OPT), A100, tp)
    roofs = StepTimeModel(OPT, tp * A100.flops("fp16"), tp * A100.memory_bandwidth, "fp16")
    tokens = sum(new for _, new in sizes)
    ring = 2 * OPT.n_layers * 2 * (tp - 1) / tp * tokens * OPT.d_model * 2 / links.NVLINK_A100.bytes_per_s
    assert model.seconds(sizes) == pytest.approx(roofs.seconds(sizes) + ring, rel=1e-12)
    assert isinstance(model, TensorParallelStepTime) and (tp > 1 or model.seconds(sizes) == roofs.seconds(sizes))


def test_every_request_of_a_fleet_finishes_and_leaves_every_pool_free():
    arrivals = poisson(30.0, 80, FixedLengths(400, 12), seed=3)
    fleet = Disaggregated(Instances(2, A100), Instances(2, A100))
    run = simulate(fleet, SERVING, arrivals)
    assert run.complete and not np.isnan(run.finish_s).any() and run.blocks_in_use_after == 0
    assert (run.ttft_s > 0).all() and (run.tpot_s > 0).all() and (run.transfer_s > 0).all()
    assert (run.imported_blocks == -(-400 // SERVING.block_size)).all()
    assert run.steps > 0 and run.steps_per_s > 0
    alone = simulate_prefill(Instances(2, A100), SERVING, arrivals)
    assert np.allclose(alone.ttft_s, run.ttft_s)  # the decode side never slows the prefill side
    decode = simulate_decode(Instances(2, A100), SERVING, arrivals)
    assert (decode.ttft_s == 0).all() and (decode.tpot_s > 0).all()


# ---- DistServe's search against every placement ------------------------------------------------------

rates = st.one_of(st.just(0.0), st.floats(0.01, 50))  # req/s of one instance; 0: it meets no objective
goodput_tables = st.builds(
    placement.PhaseGoodputs,
    st.dictionaries(st.sampled_from([1, 2, 4, 8]), rates, min_size=1),
    st.dictionaries(st.sampled_from([1, 2, 4, 8]), rates, min_size=1),
    st.sampled_from([1.0, 2.16, 0.5]), st.sampled_from([1.0, 1.75]))


@given(table=goodput_tables, budget=st.integers(1, 24))
def test_best_placement_equals_the_best_of_every_placement_in_the_budget(table, budget):
    try:
        brute = placement.brute_force_placement(table, budget)
    except ValueError:
        with pytest.raises(ValueError, match="cannot buy one prefill and one decode instance"):
            placement.best_placement(table, budget)
        return
    assert placement.best_placement(table, budget) == brute
    assert brute.cost <= budget + 1e-9


@given(table=goodput_tables, rate=st.floats(0.1, 500))
def test_algorithm1_meets_the_rate_with_the_fewest_instances_of_each_phases_best_degree(table, rate):
    if min(max(table.prefill.values()), max(table.decode.values())) == 0:
        return
    chosen = placement.algorithm1(table, rate)
    g_p, g_d = table.prefill[chosen.prefill_tp], table.decode[chosen.decode_tp]
    assert g_p / chosen.prefill_tp == max(g / tp for tp, g in table.prefill.items())
    assert g_d / chosen.decode_tp == max(g / tp for tp, g in table.decode.items())
    assert chosen.rate_req_s >= rate * (1 - 1e-12)
    assert (chosen.prefill_count - 1) * g_p < rate and (chosen.decode_count - 1) * g_d < rate


def test_the_search_on_a_simulated_grid_finds_the_best_of_every_placement_simulated():
    """Budget 3 A100s: the search's pick from the phases alone, against the best of all three
    placements (1:1, 2:1, 1:2) each simulated as a fleet. Algorithm 1 composes the phases as if
    k instances served k times one; a fleet's shared dispatch serves a little more, so the
    comparison allows the bisection's resolution on each side and a pooling margin of 10%."""
    bisection = goodputs.Bisection(n=60, rel_tol=0.05, max_runs=8)
    slo = SLO(ttft_s=0.25, tpot_s=0.035)
    table, _ = placement.phase_goodputs(SERVING, SHORT, slo, A100, A100, tps=(1,), bisection=bisection)
    chosen = placement.best_placement(table, 3)
    simulated = {(p, d): goodputs.goodput(Disaggregated(Instances(p, A100), Instances(d, A100)), SERVING, SHORT, slo,
                                          bisection).per_gpu for p, d in ((1, 1), (2, 1), (1, 2))}
    tolerance = (1 + bisection.rel_tol) ** 2 * 1.1
    assert simulated[chosen.prefill_count, chosen.decode_count] * tolerance >= max(simulated.values())


# ---- goodput's bisection against a known threshold ---------------------------------------------------

@given(threshold=st.floats(0.05, 500), guess=st.floats(0.01, 1000), rel_tol=st.sampled_from([0.01, 0.03, 0.1]))
def test_max_rate_brackets_a_known_threshold_within_its_tolerance(threshold, guess, rel_tol):
    search = goodputs.max_rate(lambda rate: 1.0 if rate <= threshold else 0.0, guess, rel_tol=rel_tol, max_runs=60)
    assert threshold / (1 + rel_tol) <= search.rate_req_s <= threshold
    assert len(search.runs) <= 2 + abs(math.log2(threshold / guess)) + math.log2(1 / math.log2(1 + rel_tol)) + 2


def test_a_stream_is_the_same_requests_compressed_at_any_rate():
    slow, fast = poisson(1.0, 50, SHORT, seed=7), poisson(4.0, 50, SHORT, seed=7)
    assert [a.at_s / 4 for a in slow] == pytest.approx([a.at_s for a in fast])
    assert [(a.prompt, a.output) for a in slow] == [(a.prompt, a.output) for a in fast]


# ---- the KV transfer bill ------------------------------------------------------------------------------

def test_a_512_token_opt_66b_request_carries_the_1_13_gb_distserve_counts():
    config = roofline.preset("opt-66b")
    nbytes = links.request_kv_bytes(config, 512, "fp16")
    assert nbytes == 2 * config.n_layers * config.d_model * 2 * 512  # K and V, every layer, 2 bytes each
    assert nbytes / links.GIB == pytest.approx(pd_claims.KV_BILL_PAPER_GB, abs=0.005)  # the paper's GB are GiB
    bill = pd_claims.kv_bill()
    for row in bill["links"]:
        link = links.link(row["link"])
        assert row["transfer_s"] == pytest.approx(link.latency_s + nbytes / link.bytes_per_s)
        assert row["hides_under_step"] == (row["transfer_s"] <= bill["decode_step_s"])
    assert links.NVLINK_A100.bytes_per_s == 300e9 and links.NETWORK_400G.bytes_per_s == 50e9


# ---- bad input, named ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: Disaggregated(Instances(1, A100), Instances(0, A100)), "count must be >= 1.*got 0"),
    (lambda: Instances(2, A100, tp=0), "tp must be an integer >= 1; got 0"),
    (lambda: poisson(-1.0, 10, SHORT), "rate_per_s must be > 0.*got -1.0"),
    (lambda: Serving(OPT, policy="static"), "policy must be one of 'prefill-first', 'continuous', 'chunked'"),
    (lambda: Serving(OPT, memory_efficiency=1.5), r"memory_efficiency must be in \(0, 1\]; got 1.5"),
    (lambda: SLO(ttft_s=-0.1), "ttft_s must be > 0 seconds"),
    (lambda: goodputs.Bisection(n=0), "n must be an integer >= 1"),
    (lambda: placement.PhaseGoodputs({}, {1: 1.0}), "prefill needs the goodput of at least one"),
    (lambda: placement.best_placement(placement.PhaseGoodputs({4: 1.0}, {4: 1.0}), 6), "cannot buy one prefill"),
    (lambda: placement.algorithm1(placement.PhaseGoodputs({1: 1.0}, {1: 1.0}), -2), "rate_req_s must be > 0"),
    (lambda: links.request_kv_bytes(OPT, 0), "prompt_tokens must be an integer >= 1; got 0"),
    (lambda: step_time_model(SERVING, hardware.get("TPU v5e"), 2), "no intra-node link known for 'TPU v5e'"),
    (lambda: links.link("NVLink 9"), "unknown link 'NVLink 9'; known links: NVLink 3"),
    (lambda: hardware.get("B200"), "unknown device 'B200'"),
    (lambda: simulate("2P1D", SERVING, poisson(1.0, 1, SHORT)), "placement must be a pd_fleet.Colocated"),
])
def test_bad_input_is_named_with_what_is_allowed(make, message):
    with pytest.raises((ValueError, KeyError, TypeError), match=message):
        make()


def test_a_model_that_does_not_fit_is_left_out_of_the_search():
    big = Serving(roofline.preset("opt-66b"))
    assert not placement.fits(big, A100, 1) and placement.fits(big, A100, 2)


# ---- the claims at the paper's settings -----------------------------------------------------------------

def test_without_an_slo_colocated_serves_at_least_as_many_requests_per_gpu_as_disaggregated():
    """vLLM's documentation: disaggregated prefill does not improve throughput. 100 requests at
    once at Figure 1's settings, until the last one finishes."""
    serving, at_once = pd_claims.figure1_serving(), poisson(math.inf, 100, pd_claims.FIGURE1_LENGTHS)
    one, two = Instances(1, A100), Instances(2, A100)
    per_gpu = {name: simulate(p, serving, at_once).throughput_req_s / p.gpus for name, p in (
        ("colocated", Colocated(one)), ("1P1D", Disaggregated(one, one)), ("2P1D", Disaggregated(two, one)),
        ("1P2D", Disaggregated(one, two)))}
    assert per_gpu["colocated"] >= max(v for k, v in per_gpu.items() if k != "colocated")


@pytest.mark.slow
def test_two_prefill_gpus_and_one_decode_gpu_serve_twice_the_goodput_per_gpu_of_one_colocated():
    """DistServe's Figure 1: OPT-13B, 512 tokens in and 64 out, one A100, P90 TTFT 0.4 s and TPOT
    0.04 s; at MFU and MBU fitted to the paper's prefill-only and decode-only figures, the
    colocated and 2P1D goodputs are the simulator's predictions. The mean over three seeds."""
    result = pd_claims.figure1_ratio(goodputs.Bisection(n=200, seeds=(0, 1, 2), rel_tol=0.05, max_runs=8))
    assert result["ratio"] >= 2.0
