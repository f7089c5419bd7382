"""The memory model of training (parallel.memory): ZeRO's Figure 1 and volumes, shards against a
brute-force layout, activations from Korthikanti et al., and named errors."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.parallel import memory


def test_zero_figure_1_to_the_papers_rounding():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12
    figure = memory.zero_figure_1()
    assert [round(figure[s], 1) for s in memory.STAGES] == [120.0, 31.4, 16.6, 1.9]


def test_zero_volumes_are_two_two_and_three_psi():
    psi = 7_500_000_000
    assert [memory.communication_volume(psi, 64, s) for s in memory.STAGES] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=8), st.integers(1, 9), st.sampled_from(memory.STAGES),
       st.sampled_from(list(memory.PRECISIONS.values())))
def test_state_bytes_match_a_brute_force_layout(units, world, stage, precision):
    # lay every unit out padded to a multiple of world and hand out slices, one element at a time
    owned = [0] * world
    for size in units:
        padded = world * math.ceil(size / world)
        for element in range(padded):
            owned[element // (padded // world)] += 1
    assert len(set(owned)) == 1
    held = memory.state_bytes(units, world, stage, precision)
    full = sum(units)
    assert held["parameters"] == (owned[0] if stage == 3 else full) * precision.parameter_bytes
    assert held["gradients"] == (owned[0] if stage >= 2 else full) * precision.gradient_bytes
    assert held["optimizer states"] == (owned[0] if stage >= 1 else full) * precision.optimizer_bytes


def test_each_stage_holds_no_more_than_the_one_before():
    for world in (1, 2, 4, 64):
        totals = [sum(memory.state_bytes(10**9, world, s).values()) for s in memory.STAGES]
        assert totals == sorted(totals, reverse=True)


def test_activations_follow_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96
    assert memory.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert memory.activation_bytes_per_layer(s, b, h, a, tensor=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert memory.activation_bytes_per_layer(s, b, h, a, recompute=True) == 2 * s * b * h
    fp32 = memory.activation_bytes_per_layer(s, b, h, a, precision=memory.FP32)
    assert fp32 == 2 * memory.activation_bytes_per_layer(s, b, h, a)


def test_pipeline_in_flight_and_per_rank():
    assert memory.in_flight("gpipe", 4, 16) == 16 and memory.in_flight("1f1b", 4, 16) == 4
    assert memory.in_flight("1f1b", 4, 2) == 2
    one = memory.per_rank(10**9, 8, 1024, 16, 1024, 1)
    split = memory.per_rank(10**9, 8, 1024, 16, 1024, 1, pipeline=4, micro_batches=8)
    assert split["parameters"] == one["parameters"] // 4
    assert split["activations"] == pytest.approx(one["activations"] / 4 * 4)  # 2 layers, 4 micro-batches in flight


@pytest.mark.parametrize("call, message", [
    (lambda: memory.state_bytes(10, 2, 4), "unknown ZeRO stage 4"),
    (lambda: memory.state_bytes(10, 0, 1), "the world size must be a whole number >= 1; got 0"),
    (lambda: memory.state_bytes(10, 2, True), "unknown ZeRO stage True"),
    (lambda: memory.per_rank(100, 6, 64, 4, 32, 1, pipeline=4), "4 pipeline stages cannot share 6 layers"),
    (lambda: memory.in_flight("zigzag", 2, 2), "unknown schedule 'zigzag'"),
    (lambda: memory.in_flight("1f1b", 2, 0), "the micro-batch count must be a whole number >= 1; got 0"),
    (lambda: memory.activation_bytes_per_layer(128, 1, 96, 6, tensor=4), "tensor-parallel size of 4 must divide"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
