"""parallel.tensor on 2 and 4 gloo processes: the tensor-parallel model's logits, one block's output
and every weight's gradient equal the single-process model's, the bytes its all-reduces move equal
the Megatron count from the shapes, and bad splits or disagreeing ranks fail with a named error on
every rank instead of hanging. The shard helpers are checked as properties.

The exactness runs compute in float64 on both sides: in float32 the two orders of summation
differ by 2.5e-6 on one CPU and 1.1e-5 on another, where float64's differ by about 1e-15."""
from dataclasses import asdict

import pytest
import torch
from _numerics import FP64_RELATIVE
from _ranks import error_of
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.model.config import CONFIGS, ModelConfig
from infra_lab.parallel import tensor
from infra_lab.processes import run_on_ranks

TP4 = ModelConfig("tp4", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128)
DTYPE = torch.float64
ELEMENT = torch.empty((), dtype=DTYPE).element_size()  # bytes of one activation the all-reduces move


def disagreeing_forward(batch_by_rank: list[int]) -> None:
    """The tensor-parallel forward with a different batch on each rank."""
    import torch.distributed as dist

    model = tensor.TensorParallelTransformer(tensor.build_model(asdict(TP4), 0))
    model(torch.zeros(batch_by_rank[dist.get_rank()], 4, dtype=torch.int64))


def checks_on_two_ranks() -> dict:
    """One spawn for every two-process check (each spawn costs seconds): the shipped target model,
    a forward whose ranks disagree on the batch, and the timing run."""
    return {"exactness": tensor.exactness_rank(7, "target", 2, 16, DTYPE),
            "disagreement": error_of(disagreeing_forward, [2, 3]),
            "timing": tensor.timing_rank(0, asdict(TP4), 2, 16, 2)}


def checks_on_four_ranks() -> dict:
    """A small model whose heads and KV heads 4 divides, and the target, whose 2 KV heads it does not."""
    return {"exactness": tensor.exactness_rank(7, asdict(TP4), 2, 8, DTYPE),
            "split_error": error_of(tensor.exactness_rank, 0, "target", 1, 4)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(checks_on_two_ranks, 2, timeout_s=30)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(checks_on_four_ranks, 4, timeout_s=30)


@pytest.mark.numerics
@pytest.mark.parametrize("world, batch, tokens", [(2, 2, 16), pytest.param(4, 2, 8, marks=pytest.mark.slow)])
def test_tensor_parallel_equals_one_process_and_moves_the_modelled_bytes(world, batch, tokens, request):
    results = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[world])
    for rank, result in enumerate(r["exactness"] for r in results):
        for gap in ("logits_gap", "block_gap", "sharded_grad_gap", "replicated_grad_gap"):
            # float64 both sides, relative to the reference's largest value: measured below 1e-14
            assert result[gap] < FP64_RELATIVE, (rank, gap, result[gap])
        n_layers, d = result["n_layers"], result["d_model"]
        assert result["all_reduces"] == tensor.ALL_REDUCES_PER_BLOCK * n_layers
        assert result["bytes"] == n_layers * tensor.bytes_per_block(batch, tokens, d, world, ELEMENT) > 0


def test_bytes_per_block_is_four_ring_all_reduces_of_the_activations():
    # 2 (N - 1) / N of B T d floats, four times: on 4 ranks, 6 B T d elements of 4 bytes
    assert tensor.bytes_per_block(2, 8, 64, 4) == 6 * 2 * 8 * 64 * 4
    assert tensor.bytes_per_block(2, 8, 64, 1) == 0


def test_ranks_that_disagree_on_shapes_fail_with_the_same_named_error(two_ranks):
    messages = [r["disagreement"] for r in two_ranks]
    assert messages[0] == messages[1]
    assert "disagree on batch (rank 0: 2, rank 1: 3)" in messages[0]


@pytest.mark.slow  # the 4-process spawn: over 10 s here
def test_a_world_size_that_does_not_divide_the_kv_heads_fails_on_every_rank(four_ranks):
    for result in four_ranks:
        assert result["split_error"].startswith("4 processes cannot split n_kv_heads = 2 of target")
        assert result["split_error"].endswith("allowed: 1, 2")


@pytest.mark.parametrize("config, world, name", [
    (CONFIGS["target"], 4, "n_kv_heads = 2"), (TP4, 3, "n_heads = 4"),
    (ModelConfig("odd_ff", n_layers=1, d_model=32, n_heads=2, n_kv_heads=2, d_ff=63), 2, "d_ff = 63"),
])
def test_check_divides_names_the_size_the_world_does_not_divide(config, world, name):
    with pytest.raises(ValueError, match=f"{world} processes cannot split {name}"):
        tensor.check_divides(config, world)


def test_check_divides_refuses_experts_and_bad_world_sizes():
    with pytest.raises(ValueError, match="8 experts"):
        tensor.check_divides(CONFIGS["moe"], 2)
    with pytest.raises(ValueError, match="got 0"):
        tensor.check_divides(TP4, 0)
    tensor.check_divides(TP4, 4)


def test_the_timing_run_reports_ratios(two_ranks):
    timings = [r["timing"] for r in two_ranks]
    assert timings[0]["mlp_single_s"] == timings[1]["mlp_single_s"] > 0
    for name in ("mlp", "block"):
        assert timings[0][f"{name}_ratio"] == timings[0][f"{name}_parallel_s"] / timings[0][f"{name}_single_s"]


@st.composite
def split_matrices(draw):
    world = draw(st.integers(1, 6))
    rows, columns = world * draw(st.integers(1, 5)), world * draw(st.integers(1, 5))
    w = torch.randn(rows, columns, generator=torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16))))
    return w, world


@given(split_matrices())
def test_column_shards_concatenate_to_the_matrix_and_multiply_to_slices_of_its_product(case):
    w, world = case
    shards = [tensor.shard_columns(w, rank, world) for rank in range(world)]
    assert all(s.shape == (w.shape[0], w.shape[1] // world) for s in shards)
    assert torch.equal(torch.cat(shards, dim=1), w)
    x = torch.randn(3, w.shape[0])
    torch.testing.assert_close(torch.cat([tensor.column_parallel_linear(x, s) for s in shards], dim=1), x @ w)


@given(split_matrices())
def test_row_shards_concatenate_to_the_matrix_and_their_partial_products_sum_to_its_product(case):
    w, world = case
    shards = [tensor.shard_rows(w, rank, world) for rank in range(world)]
    assert all(s.shape == (w.shape[0] // world, w.shape[1]) for s in shards)
    assert torch.equal(torch.cat(shards, dim=0), w)
    x = torch.randn(3, w.shape[0])
    pieces = x.chunk(world, dim=1)  # (3, in / N) each: what the column-parallel matrix before gives each rank
    torch.testing.assert_close(sum(p @ s for p, s in zip(pieces, shards)), x @ w)


@given(st.integers(2, 6), st.integers(1, 30))
def test_shards_name_the_size_the_world_does_not_divide(world, size):
    w = torch.zeros(size, size)
    if size % world:
        with pytest.raises(ValueError, match=f"cannot split {size} columns over {world} processes"):
            tensor.shard_columns(w, 0, world)
        with pytest.raises(ValueError, match=f"cannot split {size} rows over {world} processes"):
            tensor.shard_rows(w, 0, world)
    else:
        assert tensor.shard_rows(w, world - 1, world).shape == (size // world, size)


def test_shards_refuse_bad_ranks_and_non_matrices():
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\); got 2"):
        tensor.shard_columns(torch.zeros(4, 4), 2, 2)
    with pytest.raises(ValueError, match=r"got shape \(4,\)"):
        tensor.shard_rows(torch.zeros(4), 0, 2)


def test_shard_by_name_splits_block_matrices_and_replicates_the_rest():
    w = torch.arange(16.0).reshape(4, 4)
    assert torch.equal(tensor.shard("layers.3.wq", w, 1, 2), w[:, 2:])
    assert torch.equal(tensor.shard("layers.0.w_down", w, 1, 2), w[2:])
    assert tensor.shard("embed", w, 1, 2) is w
