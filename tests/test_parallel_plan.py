"""The cluster cost model behind chapter 10's explorer (parallel.plan): its parts behave as their
sources say, GPT-3's 34 days come out of Narayanan et al.'s formula, and bad layouts are named."""
import itertools

import pytest

from infra_lab.parallel import memory, plan

SHAPE = plan.SHAPES["GPT-3 6.7B"]


def test_gpt3_175b_on_1024_a100s_takes_about_34_days():
    # Narayanan et al. 2021, section 5.1: 300B tokens, 140 TFLOP/s per GPU, "about 34 days"
    assert round(plan.training_days(300e9, 175e9, 1024, 140e12)) == 34


def test_parameter_counts_follow_the_gpt3_table():
    # Brown et al. 2020, Table 2.1: the named sizes, to the table's rounding
    expected = {"GPT-3 XL 1.3B": 1.3e9, "GPT-3 2.7B": 2.7e9, "GPT-3 6.7B": 6.7e9, "GPT-3 175B": 175e9}
    for name, shape in plan.SHAPES.items():
        assert shape.params == pytest.approx(expected[name], rel=0.03), name


@pytest.mark.parametrize("stage, tensor, pipeline, recompute",
                         list(itertools.product(memory.STAGES, (1, 8), (1, 4), (False, True))))
def test_every_part_is_non_negative_and_memory_matches_the_memory_model(stage, tensor, pipeline, recompute):
    setting = plan.Plan(SHAPE, stage=stage, tensor=tensor, pipeline=pipeline, recompute=recompute)
    split = plan.time_split(setting)
    assert all(v >= 0 for v in split.values())
    assert (split["pipeline bubble"] == 0) == (pipeline == 1)
    assert (split["tensor-parallel communication"] == 0) == (tensor == 1)
    held = plan.memory_per_gpu(setting)
    assert held == memory.per_rank(SHAPE.params, SHAPE.layers, SHAPE.hidden, SHAPE.heads, 2048, 1, setting.data, stage,
                                   tensor, pipeline, 512 // setting.data, "1f1b", recompute)


def test_recomputation_costs_a_third_more_compute_and_saves_activations():
    plain, again = (plan.Plan(SHAPE, recompute=r) for r in (False, True))
    assert plan.time_split(again)["compute"] == pytest.approx(plan.time_split(plain)["compute"] * 8 / 6)
    assert plan.memory_per_gpu(again)["activations"] < plan.memory_per_gpu(plain)["activations"] / 10


def test_more_micro_batches_shrink_the_bubble():
    # smaller micro-batches, more of them: the bubble's (p - 1) / m of the compute shrinks
    settings = [plan.Plan(SHAPE, pipeline=4, micro_batch=b) for b in (32, 8, 2, 1)]
    assert [s.micro_batches for s in settings] == [1, 4, 16, 32]
    bubbles = [plan.time_split(s)["pipeline bubble"] for s in settings]
    assert bubbles == sorted(bubbles, reverse=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor": 16}, "tensor parallelism stays within a node"),
    ({"tensor": 3}, "tensor x pipeline = 3 x 1 must divide the 64 GPUs"),
    ({"pipeline": 64}, "64 pipeline stages cannot share 32 layers"),
    ({"micro_batch": 3}, "does not split into 64 data-parallel ranks x micro-batches of 3"),
    ({"gpu": "B200"}, "unknown GPU 'B200'"),
])
def test_bad_layouts_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan.time_split(plan.Plan(SHAPE, **kwargs))
