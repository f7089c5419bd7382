"""The GPU face of extend attention, run on the CPU under Triton's interpreter, against the
float64 reference (random prefixes, chunks, block sizes, GQA groups). On a GPU the same kernel
is compiled; benchmarks/engine_core.py checks the model's tokens there."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run as numpy on the CPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from infra_lab.kernels import extend_attention as ea  # noqa: E402
from infra_lab.kernels.extend_attention_triton import extend_attention_triton  # noqa: E402
from conftest import relative_error, scattered_pool, tolerance  # noqa: E402


@pytest.mark.numerics
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 3), longest_chunk=st.integers(1, 70),
       longest_prefix=st.integers(0, 90), n_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       d=st.sampled_from([16, 24]), block_size=st.sampled_from([1, 5, 16]))
def test_triton_extend_kernel_agrees_with_the_reference(seed, batch, longest_chunk, longest_prefix, n_kv, group, d,
                                                        block_size):
    rng = np.random.default_rng(seed)
    args = scattered_pool(rng, rng.integers(1, longest_chunk + 1, batch), rng.integers(0, longest_prefix + 1, batch),
                          n_kv, group, d, block_size)
    got = extend_attention_triton(*(torch.from_numpy(np.asarray(x)) for x in args))
    reference = ea.extend_attention_numpy(*args)
    assert relative_error(got.numpy(), reference) <= tolerance(args, reference)  # float32's rounding, from the sizes


def test_triton_extend_kernel_names_tiles_that_tensor_cores_cannot_take():
    args = [torch.from_numpy(np.asarray(x)) for x in scattered_pool(np.random.default_rng(0), [3], [2], 1, 1, 16, 4)]
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        extend_attention_triton(*args, block_m=24)
