"""One ModelConfig for the shipped models and the roofline's presets; old weight files still load."""
import json

import numpy as np
import pytest

from infra_lab.model import weights
from infra_lab.model.config import CONFIGS, ModelConfig, weight_shapes
from infra_lab import roofline

OLD_FIELDS = ("name", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab", "context",
              "rope_theta")


@pytest.mark.parametrize("size", sorted(CONFIGS))
def test_shipped_weight_files_load_into_the_one_config(size):
    with np.load(weights.path_for(size)) as archive:
        stored = json.loads(bytes(archive["__meta__"]).decode())["config"]
    assert ModelConfig(**{field: stored[field] for field in OLD_FIELDS}) == CONFIGS[size]
    _, config, _ = weights.load(weights.path_for(size))
    assert config == CONFIGS[size] and config.n_experts == 1 and config.source == ""


def test_weight_shapes_count_the_dense_parameters():
    config = CONFIGS["target"]
    norms = (2 * config.n_layers + 1) * config.d_model  # left out of total_params
    count = sum(int(np.prod(shape)) for shape in weight_shapes(config).values())
    assert count == config.total_params + norms


def test_weight_shapes_of_a_mixture_of_experts_are_refused_by_name():
    with pytest.raises(ValueError, match="mixtral-8x7b has n_experts=8"):
        weight_shapes(roofline.preset("mixtral-8x7b"))
