"""One ModelConfig for the shipped models and the roofline's presets; old weight files still load."""
import json

import numpy as np
import pytest

from infra_lab.model import weights
from infra_lab.model.config import CONFIGS, ModelConfig, weight_shapes
from infra_lab import roofline

OLD_FIELDS = ("name", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab", "context",
              "rope_theta")


@pytest.mark.parametrize("size", ["target", "draft"])
def test_shipped_weight_files_load_into_the_one_config(size):
    with np.load(weights.path_for(size)) as archive:
        stored = json.loads(bytes(archive["__meta__"]).decode())["config"]
    assert ModelConfig(**{field: stored[field] for field in OLD_FIELDS}) == CONFIGS[size]
    _, config, _ = weights.load(weights.path_for(size))
    assert config == CONFIGS[size] and config.n_experts == 1 and config.source == ""


@pytest.mark.parametrize("size", ["target", "moe"])
def test_weight_shapes_count_the_parameters(size):
    config = CONFIGS[size]
    norms = (2 * config.n_layers + 1) * config.d_model  # left out of total_params
    biases = config.n_layers * config.n_experts if config.n_experts > 1 else 0  # the balancing biases, too
    count = sum(int(np.prod(shape)) for shape in weight_shapes(config).values())
    assert count == config.total_params + norms + biases


def test_the_moe_model_has_the_targets_active_parameters():
    moe, target = CONFIGS["moe"], CONFIGS["target"]
    routers = moe.n_layers * moe.router_params
    assert moe.active_params - routers == target.active_params
    assert weight_shapes(moe)["layers.0.w_gate"] == (8, 128, 256)


def test_a_published_mixture_of_experts_gets_its_stacked_expert_shapes():
    mixtral = roofline.preset("mixtral-8x7b")
    shapes = weight_shapes(mixtral)
    assert shapes["layers.0.w_down"] == (8, mixtral.d_ff, mixtral.d_model)
    assert shapes["layers.31.router"] == (mixtral.d_model, 8)
