"""moe.placement: DeepSeek EPLB's worked example, reproduced; every placement holds every expert,
as many replicas as it counts, the same number of slots per GPU, and all of the load."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra_lab.moe.placement import balanced_packing, contiguous_loads, gpu_loads, place, replicate


def test_the_eplb_readme_example():  # deepseek-ai/EPLB, README: 2 layers, 12 experts, 16 replicas
    loads = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    placement = place(loads, replicas=16, groups=4, nodes=2, gpus=8)
    assert placement.slot_expert.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                              [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert (placement.replicas == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), experts_per_group=st.integers(1, 4), groups=st.sampled_from([1, 2, 4]),
       nodes=st.sampled_from([1, 2]), gpus_per_node=st.integers(1, 3), extra_per_gpu=st.integers(0, 2))
def test_every_placement_holds_every_expert_and_all_the_load(seed, experts_per_group, groups, nodes, gpus_per_node,
                                                             extra_per_gpu):
    if groups % nodes:
        nodes = 1
    experts = experts_per_group * groups
    gpus = nodes * gpus_per_node
    replicas = -(-experts // gpus) * gpus + extra_per_gpu * gpus  # at least one slot per expert
    loads = np.random.default_rng(seed).integers(0, 200, (2, experts))
    placement = place(loads, replicas, groups, nodes, gpus)
    for layer in range(2):
        held = np.bincount(placement.slot_expert[layer], minlength=experts)
        assert (held >= 1).all() and (held == placement.replicas[layer]).all()
    assert np.allclose(gpu_loads(loads, placement, gpus).sum(1), loads.sum(1))
    assert np.allclose(contiguous_loads(loads, 1)[:, 0], loads.sum(1))


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=12), packs=st.integers(1, 4))
def test_packing_is_greedy_and_even(weights, packs):
    weights = np.array(weights[:len(weights) // packs * packs] or [0] * packs, np.float64)
    pack_of, rank = balanced_packing(weights, packs)
    assert (np.bincount(pack_of, minlength=packs) == len(weights) // packs).all()
    loads, sizes = [0.0] * packs, [0] * packs  # replay: heaviest first, lightest open pack, lower on ties
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        pack = min((p for p in range(packs) if sizes[p] < len(weights) // packs), key=lambda p: (loads[p], p))
        assert (pack_of[item], rank[item]) == (pack, sizes[pack])
        loads[pack] += weights[item]
        sizes[pack] += 1


def test_replicas_go_to_the_highest_load_per_copy():
    slots, counts = replicate(np.array([10.0, 30.0, 12.0]), 6)  # 30 -> 15 -> 12 vs 15: 30 again -> 10 vs 12
    assert slots.tolist() == [0, 1, 2, 1, 1, 2] and counts.tolist() == [1, 3, 2]


@pytest.mark.parametrize("args, message", [
    ((np.ones((1, 12)), 16, 5, 1, 8), "5 groups must divide the 12 experts"),
    ((np.ones((1, 12)), 16, 4, 3, 6), "3 nodes must divide the 4 groups"),
    ((np.ones((1, 12)), 18, 4, 2, 8), "8 GPUs must divide the 18 replicas"),
    ((np.ones((1, 12)), 8, 4, 2, 8), "8 replicas cannot hold the 12 experts once each"),
    ((np.ones(12), 16, 4, 2, 8), r"loads must be \(layers, experts\)"),
    ((np.ones((1, 12)), 16, 0, 1, 8), "groups must be an integer >= 1; got 0"),
])
def test_bad_input_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        place(*args)
    with pytest.raises(ValueError, match="5 GPUs cannot split the 12 experts into contiguous runs"):
        contiguous_loads(np.ones((1, 12)), 5)
