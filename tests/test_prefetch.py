"""Software prefetch: the probe sums what a brute-force loop sums, with and without prefetching."""
import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab.kernels.prefetch import prefetch_l2, read_blocks


@pytest.mark.numerics
@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), tasks=st.integers(1, 5), per_task=st.integers(1, 6),
       block_floats=st.sampled_from([1, 10, 512, 700, 1500]))
def test_read_blocks_sums_the_named_blocks(seed, tasks, per_task, block_floats):
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((tasks * per_task + 2, block_floats)).astype(np.float32)
    tables = rng.permutation(len(pool))[: tasks * per_task].reshape(tasks, per_task)
    expected = np.array([pool[row].astype(np.float64).sum() for row in tables])
    for prefetch in (False, True):
        np.testing.assert_allclose(read_blocks(pool, tables, prefetch), expected, rtol=1e-4, atol=1e-3)


def test_prefetch_takes_only_a_1d_array_and_an_integer_index():
    @numba.njit
    def touch(array, index):
        prefetch_l2(array, index)

    touch(np.arange(10, dtype=np.int64), 3)  # any dtype: it only names an address
    with pytest.raises(numba.core.errors.TypingError):
        touch(np.zeros((2, 2), np.float32), 0)
    with pytest.raises(numba.core.errors.TypingError):
        touch(np.zeros(4, np.float32), 1.5)


def test_read_blocks_names_tables_outside_the_pool():
    pool = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match=r"blocks in \[0, 4\); got 0 to 4"):
        read_blocks(pool, np.array([[0, 4]]), True)
    with pytest.raises(ValueError, match="integer tables"):
        read_blocks(pool, np.array([[0.0, 1.0]]), True)
    with pytest.raises(ValueError, match="pool"):
        read_blocks(pool[0], np.array([[0]]), False)
