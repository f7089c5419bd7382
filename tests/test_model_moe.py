"""The mixture-of-experts model: its numpy, numba and torch steps equal the training forward, it
trains with each balancing method and saves in float16, and what it cannot do is named."""
import numpy as np
import pytest
import torch

from infra_lab import backend
from infra_lab.model import train
from infra_lab.model.config import CONFIGS
from infra_lab.model.quantized import quantize_model
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.model.transformer import Transformer
from infra_lab.model.weights import load


def random_moe(seed: int = 0) -> dict:
    weights = TorchTransformer(CONFIGS["moe"], seed=seed).numpy_weights()
    rng = np.random.default_rng(seed)
    for name in [n for n in weights if n.endswith("router_bias")]:  # a trained bias is not zero
        weights[name] = rng.uniform(-0.02, 0.02, weights[name].shape).astype(np.float32)
    return weights


def test_every_backend_steps_the_moe_model_as_the_training_forward_does():
    weights = random_moe()
    tokens = np.random.default_rng(1).integers(0, 256, 48)
    with torch.no_grad():
        expected = TorchTransformer(CONFIGS["moe"], weights)(torch.from_numpy(tokens)[None])[0].numpy()
    model = Transformer(CONFIGS["moe"], weights)
    for name in ("numpy", "numba", "torch"):
        with backend.using(name):
            assert np.allclose(model.forward(tokens), expected, atol=1e-4), name


@pytest.mark.parametrize("balancing", ["bias", "aux", "none"])
def test_training_moves_the_bias_only_when_asked_and_saves_float16(tmp_path, balancing):
    out = tmp_path / "moe.npz"
    figures = train.train("moe", out, steps=2, progress=False, eval_windows=2, balancing=balancing)
    weights, config, stored = load(out)
    assert config == CONFIGS["moe"] and stored["balancing"] == balancing
    with np.load(out) as archive:
        assert archive["layers.0.w_gate"].dtype == np.float16
    bias = weights["layers.0.router_bias"]
    assert (bias != 0).any() if balancing == "bias" else (bias == 0).all()
    assert np.allclose(np.sum(figures["loads_every_50_steps"][0], axis=1), 1)  # shares per layer


def test_the_aux_loss_is_the_switch_loss_plus_the_z_loss():
    model = TorchTransformer(CONFIGS["moe"], seed=0)
    model.record_routing = True
    model(torch.randint(0, 256, (2, 32)))
    assert len(model.routings) == CONFIGS["moe"].n_layers
    routing, logits = model.routings[0]
    from infra_lab.moe.routing import router_z_loss, switch_aux_loss

    assert train.balance_loss(model.routings[:1], "aux").item() == pytest.approx(
        train.AUX_WEIGHT * switch_aux_loss(routing.probs.detach().numpy(), routing.experts.numpy())
        + train.Z_WEIGHT * router_z_loss(logits.detach().numpy()), rel=1e-5)
    assert train.balance_loss(model.routings, "bias") == 0.0


def test_what_the_moe_model_cannot_do_is_named(tmp_path):
    model = Transformer(CONFIGS["moe"], random_moe())
    with pytest.raises(ValueError, match="quantizes dense models; moe is a mixture of 8 experts"):
        quantize_model(model, "rtn", 8)
    with pytest.raises(ValueError, match="unknown balancing 'loss'; choose one of none, aux, bias"):
        train.train("moe", tmp_path / "x.npz", steps=1, balancing="loss")
