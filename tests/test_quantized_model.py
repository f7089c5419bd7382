"""The real model quantized (issue 17): every matrix goes through one method, a quantized model's
three faces agree, the engine serves it with the tokens it would pick alone, int8 per channel
costs at most a hundredth of a bit per byte, sizes add up, and bad arguments are named."""
import numpy as np
import pytest
import torch
from _numerics import fp32_tolerance
from hypothesis import given, settings, strategies as st

from infra_lab import backend, model
from infra_lab.model import corpus, quantized
from infra_lab.model.quantized import QuantizedTransformer, calibration_inputs, quantize_model
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.model.transformer import Transformer, parts_of, rmsnorm
from infra_lab.quant.matmul import QuantizedMatrix
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams

FACES = ["numpy", "numba", "torch"]
SETTINGS = {"rtn": (4, 32), "gptq": (4, 32), "awq": (3, None), "smoothquant": (8, None)}  # method -> bits, group


def face(name: str) -> backend.Backend:
    return backend.resolve(name, "cpu") if name == "torch" else backend.resolve(name)


@pytest.fixture(scope="module")
def target():
    return model.load("target")


@pytest.fixture(scope="module")
def splits():
    return corpus.load()  # (train, validation)


@pytest.fixture(scope="module")
def calibration(target, splits):
    return calibration_inputs(target, windows=4, rows=512, train_bytes=splits[0])


@pytest.fixture(scope="module")
def quantized_models(target, calibration):
    return {method: quantize_model(target, method, *SETTINGS[method], calibration) for method in quantized.METHODS}


@pytest.fixture(scope="module")
def tokens(splits):
    return splits[1][1000:1064].astype(np.int64)


# ---- every matrix through one method -----------------------------------------------------------

class RoutedTorch(TorchTransformer):
    def __init__(self, config, weights, private: dict):
        super().__init__(config, weights)
        self.private = {name: torch.as_tensor(value) for name, value in private.items()}

    def mm(self, h, name):
        return h @ self.private[name]


class Routed(Transformer):
    """Multiplies by private copies of the matrices: with every matrix it holds zeroed, its logits
    stay the same only if no product bypasses linear (and, on torch, mm)."""

    def __init__(self, config, weights):
        super().__init__(config, {name: value.copy() for name, value in weights.items()})
        self.private = {key: value.copy() for key, value in self.matrices.items()}
        self.private_weights = {name: self.w[name].copy() for key in self.matrices for name in parts_of(key)}
        for value in [*self.matrices.values(), *(self.w[name] for name in self.private_weights)]:
            value.fill(0)

    def linear(self, x, key, backend):
        return x @ self.private[key]

    def to_torch(self):
        return RoutedTorch(self.config, self.w, self.private_weights)


@pytest.mark.numerics
@pytest.mark.parametrize("name", FACES)
def test_every_matrix_is_applied_through_linear(target, tokens, name):
    routed = Routed(target.config, target.w)
    assert not any(value.any() for value in routed.matrices.values())
    np.testing.assert_allclose(routed.forward(tokens, backend=face(name)), target.forward(tokens, backend=face(name)),
                               rtol=0, atol=1e-6)


@pytest.mark.numerics
def test_every_matrix_of_the_torch_model_is_applied_through_mm(target, tokens):
    routed = Routed(target.config, target.w).to_torch()
    with torch.no_grad():
        expected = target.to_torch()(torch.from_numpy(tokens)[None])
        np.testing.assert_allclose(routed(torch.from_numpy(tokens)[None]), expected, rtol=0, atol=1e-6)


# ---- calibration ---------------------------------------------------------------------------------

@pytest.mark.numerics
def test_calibration_holds_what_meets_each_matrix(target, calibration, splits):
    c = target.config
    assert set(calibration) == set(quantized.quantized_keys(c))
    widths = {"qkv": c.d_model, "wo": c.n_heads * c.head_dim, "gate_up": c.d_model, "w_down": c.d_ff}
    for key, inputs in calibration.items():
        assert inputs.shape == (512, widths[key.rsplit(".", 1)[1]]) and inputs.dtype == np.float32
    # layer 0's attention reads the normalized embedding of one byte of the training split
    embedded = rmsnorm(target.w["embed"], target.w["layers.0.attn_norm"])  # (vocab, d): every byte's
    distance = np.abs(calibration["layers.0.qkv"][:, None, :] - embedded[None]).max(-1)  # (rows, vocab)
    assert distance.min(1).max() < 1e-5
    again = calibration_inputs(target, windows=4, rows=512, train_bytes=splits[0])
    assert all(np.array_equal(again[key], calibration[key]) for key in calibration)


# ---- the quantized model -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("method", quantized.METHODS)
def test_the_three_faces_agree(target, quantized_models, tokens, method):
    float_model = target
    qm = quantized_models[method]
    logits = {name: qm.forward(tokens, backend=face(name)) for name in FACES}
    if method != "smoothquant":
        for name in FACES[1:]:
            np.testing.assert_allclose(logits[name], logits["numpy"], rtol=0, atol=1e-3)
        return
    # W8A8 rounds each token's activations: a difference of 1e-6 between the faces (their attention
    # kernels) can move a value across a rounding boundary, and attention carries that to the tokens
    # after it. So on the same inputs the products agree closely; across the whole model the faces
    # differ far less than W8A8 differs from the float model, and pick the same tokens.
    torch_model = qm.to_torch()
    for key, matrix in qm.quantized.items():
        x = np.random.default_rng(0).standard_normal((8, matrix.n_in)).astype(np.float32)
        reference = qm.linear(x, key, face("numpy"))  # exact integer sums, one rounding to float32
        # the same int8 codes of x on every face; numba's and torch's then take float32 dots of n_in
        # terms, each rounded up to four times on the way (x times its scale, a code times the
        # token's scale, a code times its weight scale, the reference's result): (n_in + 4) eps32
        # sum_i |x_i w_i|, worst case (measured: under 0.02 of it)
        bound = fp32_tolerance(matrix.n_in + 4, np.abs(x.astype(np.float64)) @ np.abs(matrix.dequantize()))
        assert np.all(np.abs(qm.linear(x, key, face("numba")) - reference) <= bound), key
        with torch.no_grad():
            parts = [torch_model.mm(torch.from_numpy(x), name).numpy() for name in parts_of(key)]
        assert np.all(np.abs(np.concatenate(parts, axis=1) - reference) <= bound), key
    quantization = np.abs(logits["numpy"] - float_model.forward(tokens, backend=face("numpy"))).mean()
    for name in FACES[1:]:
        assert np.abs(logits[name] - logits["numpy"]).mean() < 0.25 * quantization, name
        assert (logits[name].argmax(1) == logits["numpy"].argmax(1)).mean() >= 0.95, name


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("method", ["gptq", "smoothquant"])
@settings(max_examples=5, deadline=None)
@given(cuts=st.lists(st.integers(1, 63), max_size=3))
def test_cached_steps_equal_one_full_pass(quantized_models, tokens, method, cuts):
    qm, numba = quantized_models[method], face("numba")
    bounds = [0, *sorted(set(cuts)), len(tokens)]
    cache = qm.new_cache(backend=numba)
    pieces = np.concatenate([qm.forward(tokens[a:b], cache, numba) for a, b in zip(bounds, bounds[1:])])
    np.testing.assert_allclose(pieces, qm.forward(tokens, backend=numba), rtol=0, atol=1e-3 if method != "smoothquant"
                               else 0.5)


def greedy(qm, prompt: list[int], n: int, chosen) -> list[int]:
    """n tokens picked greedily through forward, one contiguous cache."""
    cache = qm.new_cache(backend=chosen)
    out = [int(qm.forward(prompt, cache, chosen)[-1].argmax())]
    while len(out) < n:
        out.append(int(qm.forward(out[-1:], cache, chosen)[-1].argmax()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method, name", [("gptq", "numba"), ("awq", "torch"), ("smoothquant", "numba")])
def test_the_engine_serves_a_quantized_model(quantized_models, method, name):
    qm, chosen = quantized_models[method], face(name)
    prompts = [list(b"def main():\n    "), list(b"import os\n"), list(b"class Stack:\n")]
    engine = Engine(qm, EngineConfig(policy="continuous", max_batch=4, token_budget=64, num_blocks=16, block_size=4),
                    backend=chosen)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert outputs == [greedy(qm, prompt, 8, chosen) for prompt in prompts]


@pytest.mark.slow
def test_bits_per_byte_through_torch_equals_the_numpy_face(quantized_models, splits):
    validation = splits[1]
    windows = 2
    for qm in quantized_models.values():
        bits = 0.0
        for w in range(windows):
            logits = qm.forward(validation[w * 512:(w + 1) * 512], backend=face("numpy"))  # (512, vocab)
            targets = validation[w * 512 + 1:(w + 1) * 512 + 1]
            shifted = logits - logits.max(1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
            bits -= log_probs[np.arange(512), targets].sum() / np.log(2)
        tolerance = 2e-3 if qm.method == "smoothquant" else 1e-4  # W8A8's rounding flips (test_the_three_faces_agree)
        assert abs(quantized.bits_per_byte(qm, validation, max_windows=windows) - bits / (512 * windows)) < tolerance


def test_int8_per_channel_costs_at_most_a_hundredth_of_a_bit_per_byte(target, splits):
    """The issue's bar, checked on 64 windows (the full validation split, 650 windows: see the report)."""
    rtn8 = quantize_model(target, "rtn", 8)
    loss = quantized.bits_per_byte(rtn8, splits[1], max_windows=64) - quantized.bits_per_byte(target, splits[1],
                                                                                              max_windows=64)
    assert abs(loss) <= 0.005


@pytest.mark.slow
def test_sizes_and_names(target, quantized_models):
    c = target.config
    rtn8, rtn3 = quantize_model(target, "rtn", 8), quantize_model(target, "rtn", 3, 32)
    layer_params = sum(target.matrices[key].size for key in quantized.quantized_keys(c))
    rest = target.n_params - layer_params  # embedding, LM head, norms: fp16
    outputs = sum(target.matrices[key].shape[1] for key in quantized.quantized_keys(c))
    assert rtn8.weight_bytes == layer_params + 2 * outputs + 2 * rest  # int8 codes, one fp16 scale per output
    assert rtn3.weight_bytes == layer_params * 3 / 8 + 2 * layer_params / 32 + 2 * rest
    assert rtn3.weight_bytes < quantized_models["rtn"].weight_bytes < rtn8.weight_bytes < rtn8.fp16_bytes
    assert rtn8.fp32_bytes == 2 * rtn8.fp16_bytes == 4 * target.n_params
    assert [rtn8.name, rtn3.name, quantized_models["gptq"].name, quantized_models["smoothquant"].name] == [
        "rtn int8 per-channel", "rtn int3 g32", "gptq int4 g32", "smoothquant w8a8"]
    assert rtn8.describe().startswith("rtn int8 per-channel: ")
    for key in ("embed", "lm_head", "final_norm"):
        assert np.array_equal(rtn3.w[key], target.w[key])  # left in float
    for key in quantized.quantized_keys(c):  # the effective weights are the dequantized ones
        np.testing.assert_array_equal(np.concatenate([rtn3.w[n] for n in parts_of(key)], axis=1),
                                      rtn3.quantized[key].dequantize())


@pytest.mark.numerics
def test_head_bits_rounds_the_lm_head_too(target, tokens):
    """head_bits=8: the LM head read as int8 per channel on every face (as llama.cpp's files keep
    it), the embedding left in float, the weight-only path for the head under SmoothQuant too."""
    rtn = quantize_model(target, "rtn", 4, 32, head_bits=8)
    head = rtn.quantized["lm_head"]
    assert (head.bits, head.group, rtn.head_bits, rtn.bits, rtn.group) == (8, target.config.d_model, 8, 4, 32)
    assert rtn.name == "rtn int4 g32, head int8" and quantize_model(target, "rtn", 4, 32).head_bits is None
    np.testing.assert_array_equal(rtn.w["lm_head"], head.dequantize())
    np.testing.assert_array_equal(rtn.w["embed"], target.w["embed"])
    rtn8 = quantize_model(target, "rtn", 8, head_bits=8)
    assert rtn8.weight_bytes == quantize_model(target, "rtn", 8).weight_bytes - target.w["lm_head"].size + \
        2 * target.config.vocab  # int8 codes and one fp16 scale per output, in place of fp16 weights
    logits = {name: rtn.forward(tokens, backend=face(name)) for name in FACES}
    for name in FACES[1:]:
        np.testing.assert_allclose(logits[name], logits["numpy"], rtol=0, atol=1e-3)
    with pytest.raises(ValueError, match="head_bits must be one of 3, 4, 8, or None for a float LM head; got 16"):
        quantize_model(target, "rtn", 4, 32, head_bits=16)


# ---- bad arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("method, bits, group, message", [
    ("nf4", 4, None, "method must be one of 'rtn', 'awq', 'gptq', 'smoothquant', or a function "
                     r"\(weights, inputs, bits, group\) -> QuantizedMatrix; got 'nf4'"),
    ("rtn", 5, None, "rtn quantizes to 8, 4 or 3 bits; got bits=5"),
    ("gptq", True, None, "gptq quantizes to 8, 4 or 3 bits; got bits=True"),
    ("smoothquant", 4, None, r"smoothquant quantizes to 8 bits \(W8A8: int8 weights and activations\); got bits=4"),
    ("smoothquant", 8, 32, "smoothquant's weights are int8 with one scale per output channel: group must be None"),
    ("rtn", 4, 48, r"group must divide every quantized row \(the 128 inputs of layers.0.qkv, among others\) and be "
                   "even for packed codes: one of 2, 4, 8, 16, 32, 64, 128, or None; got 48"),
    ("rtn", 4, 1, "one of 2, 4, 8, 16, 32, 64, 128, or None; got 1"),
    ("awq", 8, 0, "one of 1, 2, 4, 8, 16, 32, 64, 128, or None; got 0"),
])
def test_bad_formats_are_named(target, calibration, method, bits, group, message):
    with pytest.raises(ValueError, match=message):
        quantize_model(target, method, bits, group, calibration)


@pytest.mark.slow
def test_bad_calibration_and_options_are_named(target, calibration, quantized_models):
    partial = {key: value for key, value in calibration.items() if key != "layers.2.wo"}
    with pytest.raises(ValueError, match=r"gptq needs calibration inputs for every quantized matrix; missing "
                                         r"layers.2.wo \(calibration_inputs\(model\) makes them all\)"):
        quantize_model(target, "gptq", 4, 32, partial)
    narrow = calibration | {"layers.1.w_down": calibration["layers.1.w_down"][:, :128]}
    with pytest.raises(ValueError, match=r"layers.1.w_down: calibration inputs must be \(n_samples, 512\) for a "
                                         r"\(512, 128\) matrix; got \(512, 128\)"):
        quantize_model(target, "awq", 4, 32, narrow)
    with pytest.raises(ValueError, match="rtn takes no options; got damp"):
        quantize_model(target, "rtn", 4, damp=0.1)
    with pytest.raises(ValueError, match=r"quantize the float model, not a quantized one \(gptq int4 g32\)"):
        quantize_model(quantized_models["gptq"], "rtn", 4)
    with pytest.raises(ValueError, match=r"calibrate on the float model, not on a quantized one \(rtn int4 g32\)"):
        calibration_inputs(quantized_models["rtn"], windows=1, rows=8)
    with pytest.raises(ValueError, match="windows must be an int >= 1; got 0"):
        calibration_inputs(target, windows=0)
    with pytest.raises(ValueError, match=r"rows must be an int in \[1, 1024\] \(windows \* 512 tokens\); got 2000"):
        calibration_inputs(target, windows=2, rows=2000)


def test_a_quantized_model_takes_only_its_layers_matrices(target):
    matrix = quantize_model(target, "rtn", 8).quantized["layers.0.wo"]
    with pytest.raises(ValueError, match=r"quantized matrices must be among the layers' matrices and the LM head, "
                                         r"with their shapes \(layers.0.qkv, .*, lm_head\); got lm_head \(128, 128\)"):
        QuantizedTransformer(target.config, target.w, {"layers.0.wo": matrix, "lm_head": matrix}, "rtn")
    mixed = {"layers.0.wo": matrix, "layers.1.wo": quantize_model(target, "rtn", 4).quantized["layers.1.wo"]}
    with pytest.raises(ValueError, match=r"one format \(bits, group\) for all its quantized matrices; got "
                                         r"\[\(4, None\), \(8, None\)\]"):
        QuantizedTransformer(target.config, target.w, mixed, "rtn")
    with pytest.raises(ValueError, match="got no matrices"):
        QuantizedTransformer(target.config, target.w, {}, "rtn")
    with pytest.raises(ValueError, match=r"smoothquant is W8A8: its matrices must be int8 per channel; got \(bits, "
                                         r"group\) \{\(4, None\)\}"):
        QuantizedTransformer(target.config, target.w, {"layers.1.wo": mixed["layers.1.wo"]}, "smoothquant")


def test_a_method_of_ones_own_quantizes_like_the_named_one(target, calibration):
    keys = quantized.quantized_keys(target.config)
    original = {key: target.matrices[key].copy() for key in keys}
    seen = []

    def my_rtn(weights, inputs, bits, group):
        seen.append(inputs.shape[1])
        result = QuantizedMatrix.quantize(weights, bits, group)
        weights[:] = 0  # a copy: the model's own matrix must not change
        return result

    mine = quantize_model(target, my_rtn, 4, 32, calibration)
    named = quantize_model(target, "rtn", 4, 32)
    assert mine.name == "my_rtn int4 g32"
    assert seen == [calibration[key].shape[1] for key in keys]
    assert all(np.array_equal(mine.w[k], named.w[k]) for k in named.w)
    assert all(np.array_equal(target.matrices[k], original[k]) for k in keys)

    def wrong(weights, inputs, bits, group):
        return weights

    with pytest.raises(ValueError, match=r"layers.0.qkv: wrong must return a QuantizedMatrix .*; got ndarray"):
        quantize_model(target, wrong, 4, 32, calibration)

    def eight_bits(weights, inputs, bits, group):
        return QuantizedMatrix.quantize(weights, 8)

    with pytest.raises(ValueError, match=r"layers.0.qkv: eight_bits returned a 8-bit \(128, 256\) matrix for a 4-bit "
                                         r"\(128, 256\) one"):
        quantize_model(target, eight_bits, 4, 32, calibration)
