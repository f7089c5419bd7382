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


@pytest.mark.numerics
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


def test_expert_loads_are_shares_per_layer_and_leave_the_model_as_it_was():
    model = TorchTransformer(CONFIGS["moe"], random_moe())
    data = np.random.default_rng(2).integers(0, 256, 3 * 64 + 1).astype(np.uint8)
    shares = train.expert_loads(model, data, window=64, max_windows=3)
    assert shares.shape == (CONFIGS["moe"].n_layers, CONFIGS["moe"].n_experts)
    assert np.allclose(shares.sum(1), 1)
    # the count is the routing's: every layer's experts over the 3 windows, dropless
    model.record_routing = True
    with torch.no_grad():
        model(torch.from_numpy(data[:192].reshape(3, 64).astype(np.int64)))
    for layer, (routing, _) in enumerate(model.routings):
        counts = np.bincount(routing.experts.numpy().ravel(), minlength=CONFIGS["moe"].n_experts)
        assert np.allclose(shares[layer], counts / counts.sum())
    model.routings.clear()
    model.record_routing = False
    train.expert_loads(model, data, window=64, max_windows=3)
    assert not model.record_routing and model.routings == []
    with pytest.raises(ValueError, match="need more than 64 bytes"):
        train.expert_loads(model, data[:10], window=64)


@pytest.mark.numerics
def test_a_chooser_picks_the_experts_and_the_gate_weights_stay_differentiable():
    model = TorchTransformer(CONFIGS["moe"], random_moe())
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens)
    calls = []

    def same_as_the_package(logits, k, bias):  # the package's own choice, through the hook
        calls.append(logits.shape)
        return torch.sort(torch.softmax(logits, -1) + bias, dim=-1, descending=True, stable=True).indices[:, :k]

    model.choose_experts = same_as_the_package
    assert torch.allclose(model(tokens), expected, atol=1e-6)
    assert len(calls) == CONFIGS["moe"].n_layers

    model.choose_experts = lambda logits, k, bias: torch.zeros(logits.shape[0], k, dtype=torch.int64) + \
        torch.arange(k)  # always experts 0 .. k-1
    model.record_routing = True
    out = model(tokens)
    assert not torch.allclose(out, expected, atol=1e-3)
    assert all((routing.experts == torch.arange(2)).all() for routing, _ in model.routings)
    out.sum().backward()
    assert model.w("layers.0.router").grad is not None  # through the gate weights


@pytest.mark.slow
@pytest.mark.numerics
def test_the_shipped_moe_model_is_the_recorded_bias_run_and_far_better_balanced_than_none():
    """The shipped weights route validation text exactly as benchmarks/results/moe_balancing.json
    records for its "bias" run, up to float32's near-ties (so the chapter's table is this model's),
    and that run's busiest expert is nearer the mean, in every layer, than without balancing. The
    1.15 bar itself is reported there, met or not."""
    import json

    from infra_lab.model import corpus
    from infra_lab.model.weights import path_for

    weights, config, figures = load(path_for("moe"))
    assert figures["balancing"] == "bias" and path_for("moe").stat().st_size <= 12e6
    moe = TorchTransformer(config, weights)
    margins = []  # per call, layer after layer: each token's k-th score less its (k+1)-th

    def the_package_choice(logits, k, bias):  # torch_moe.route's own, recording how near each token came to a flip
        scores = torch.softmax(logits.float(), dim=-1) + (0 if bias is None else bias)
        order = torch.sort(scores, dim=-1, descending=True, stable=True)
        margins.append((order.values[:, k - 1] - order.values[:, k]).numpy())
        return order.indices[:, :k]

    moe.choose_experts = the_package_choice
    shares = train.expert_loads(moe, corpus.load()[1])  # every window
    from pathlib import Path

    results = json.loads((Path(__file__).parents[1] / "benchmarks/results/moe_balancing.json").read_text())
    # Exactly the recorded routing, but for tokens whose k-th and (k+1)-th scores another CPU's
    # float32 can swap: this model's float32 probabilities are within 1.7e-6 of float64's over
    # the validation text (measured), so two CPUs' within 3.5e-6; FLIP = 1e-5 leaves a factor 3.
    # Each such token moves one of the N k assignments of its layer: its shares by 1 / (N k).
    flip, k = 1e-5, config.experts_per_token
    by_layer = [np.concatenate(margins[i::config.n_layers]) for i in range(config.n_layers)]
    allowed = np.array([(m < flip).sum() / (len(m) * k) for m in by_layer])  # measured: at most 1.8e-4
    assert np.all(np.abs(shares - results["runs"]["bias"]["validation_loads_fp16"]) <= allowed[:, None] + 1e-12)
    unbalanced = np.array(results["runs"]["none"]["validation_loads_fp16"])
    assert (shares.max(1) < unbalanced.max(1)).all()
