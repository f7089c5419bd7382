"""model.wide: the target's depth, 8 times as wide, 245 MB of float32 weights that no CPU cache
holds, random but the same for the same seed, and served by the engine like any model."""
import numpy as np
import pytest

from infra_lab.model.config import CONFIGS
from infra_lab.model.wide import WIDE, wide_model
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams


@pytest.mark.slow  # three 245 MB models and an engine: about 10 s here
def test_the_wide_model_is_the_target_widened_and_the_same_for_a_seed():
    target = CONFIGS["target"]
    assert (WIDE.n_layers, WIDE.n_kv_heads, WIDE.vocab) == (target.n_layers, target.n_kv_heads, target.vocab)
    assert (WIDE.d_model, WIDE.d_ff) == (8 * target.d_model, 8 * target.d_ff)
    assert 240e6 < 4 * WIDE.total_params < 250e6  # float32 bytes, beyond any CPU's last-level cache
    first, again, other = wide_model(0), wide_model(0), wide_model(1)
    assert all(np.array_equal(first.w[name], again.w[name]) for name in first.w)
    assert not np.array_equal(first.w["layers.0.wq"], other.w["layers.0.wq"])
    assert np.all(first.w["final_norm"] == 1) and abs(float(first.w["layers.0.w_up"].std()) - 0.02) < 1e-3
    engine = Engine(first, EngineConfig(max_batch=2, num_blocks=16))
    outputs = engine.generate([b"def f(x):\n", b"import os\n"], SamplingParams(max_tokens=3))
    assert [len(o) for o in outputs] == [3, 3]
