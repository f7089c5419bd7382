"""The real model quantized (chapter 08): a method and a format applied to the small model's weight
matrices, served by the same engine through the same `step`.

The four layers' matrices are quantized, the fused ones as one matrix each (qkv, gate_up): per-output
quantization of a fused matrix is that of its parts, and AWQ and SmoothQuant then give q, k and v one
shared input scale, as AWQ does. The embedding and the LM head stay in float, as GPTQ and AWQ leave
them, and count at fp16 in the size; `head_bits` rounds the LM head too (to nearest, per channel),
as llama.cpp's files keep it (SmolLM2's Q4_1 file: its tied head in 8 bits). Methods:
round-to-nearest ("rtn"); GPTQ (Frantar et al., 2023) and AWQ (Lin et al., 2024), fitted to the
activations that meet each matrix on windows of the training split; SmoothQuant (Xiao et al.,
2023), W8A8: int8 weights, and activations quantized per token at inference. A quantized model
holds its codes, not the float matrices they stand for (DequantizedWeights).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import numpy as np

from infra_lab import backend as backends
from infra_lab.model.config import ModelConfig, weight_shapes
from infra_lab.model.transformer import LAYER_MATRICES, Transformer, parts_of, split_fused
from infra_lab.quant import matmul as qmatmul
from infra_lab.quant.matmul import QuantizedMatrix

METHODS = ("rtn", "awq", "gptq", "smoothquant")
METHOD_BITS = {"rtn": (8, 4, 3), "awq": (8, 4, 3), "gptq": (8, 4, 3), "smoothquant": (8,)}
NEEDS_CALIBRATION = ("awq", "gptq", "smoothquant")
CALIBRATION_WINDOWS = 32  # random 512-byte windows of the training split: 16,384 tokens
CALIBRATION_ROWS = 4096  # of those tokens, the ones kept (the same for every matrix): GPTQ's and AWQ's samples
WINDOW = 512  # bytes (tokens) per window: the model's context


HEAD = "lm_head"  # quantized only when quantize_model is given head_bits


def quantized_keys(config: ModelConfig) -> list[str]:
    """The matrices quantize_model quantizes: every layer's qkv, wo, gate_up and w_down (not lm_head)."""
    return [f"layers.{i}.{name}" for i in range(config.n_layers) for name in LAYER_MATRICES]


# ---- calibration: what meets each matrix --------------------------------------------------------

class _Recorder(Transformer):
    """The float model, keeping the rows `keep` of every input its matrices meet in one step."""

    def __init__(self, model: Transformer):
        super().__init__(model.config, model.w)
        self.keep = np.arange(0)
        self.seen: dict[str, list[np.ndarray]] = {}

    def linear(self, x, key, backend):
        self.seen.setdefault(key, []).append(np.array(x[self.keep], np.float32))
        return super().linear(x, key, backend)


def calibration_inputs(model: Transformer, windows: int = CALIBRATION_WINDOWS, rows: int = CALIBRATION_ROWS,
                       seed: int = 0, train_bytes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Key -> the inputs (rows, n_in) float32 that meet each quantized matrix (quantized_keys), from
    `windows` random 512-byte windows of the training split (corpus.load()[0], never validation;
    `train_bytes` saves reading it again) run through the float model on numba, one step per 8
    windows. Of their windows * 512 tokens, `rows` chosen at random (the same tokens for every
    matrix) are kept, which keeps GPTQ's Hessians and AWQ's search fast."""
    from infra_lab.model import corpus

    if isinstance(model, QuantizedTransformer):
        raise ValueError(f"calibrate on the float model, not on a quantized one ({model.name})")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be an int >= 1; got {windows!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= windows * WINDOW:
        raise ValueError(f"rows must be an int in [1, {windows * WINDOW}] (windows * {WINDOW} tokens); got {rows!r}")
    data = corpus.load()[0] if train_bytes is None else np.asarray(train_bytes, np.uint8)
    if len(data) <= WINDOW:
        raise ValueError(f"need more than {WINDOW} training bytes; got {len(data)}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - WINDOW, windows)
    kept = np.sort(rng.choice(windows * WINDOW, rows, replace=False))  # token rows over all windows
    recorder, numba = _Recorder(model), backends.resolve("numba")
    for first in range(0, windows, 8):
        chunk = np.stack([data[s:s + WINDOW] for s in starts[first:first + 8]]).astype(np.int64)  # (B, 512)
        base = first * WINDOW
        recorder.keep = kept[(kept >= base) & (kept < base + chunk.size)] - base
        _prefill(recorder, chunk, numba)
    return {key: np.concatenate(recorder.seen[key]) for key in quantized_keys(model.config)}


def _prefill(model: Transformer, windows: np.ndarray, backend: backends.Backend) -> np.ndarray:
    """Logits (B * T, vocab) for B whole sequences (B, T) in one step of a paged pool."""
    n_seqs, length = windows.shape
    pool = model.new_paged_cache(n_seqs * -(-length // 16), 16, backend=backend)
    seqs = [pool.new_sequence() for _ in range(n_seqs)]
    pool.reserve_all(seqs, [length] * n_seqs)
    return model.step(windows.reshape(-1), pool.step_metadata(seqs, [length] * n_seqs), pool, backend)


# ---- quantizing ----------------------------------------------------------------------------------

def quantize_model(model: Transformer, method, bits: int, group: int | None = None,
                   calibration: dict | None = None, *, head_bits: int | None = None, progress: bool = False,
                   **options) -> QuantizedTransformer:
    """`model` with its layers' matrices quantized by `method` (METHODS) to `bits` with a scale per
    `group` inputs of each output (None: per channel). awq, gptq and smoothquant fit each matrix to
    `calibration` (calibration_inputs' dict), made with its defaults when None; rtn needs none.
    `method` may also be a function of one's own, `method(weights (n_in, n_out), inputs (n, n_in),
    bits, group) -> QuantizedMatrix` (chapter 08's last exercise), calibrated like gptq and named
    after the function. `options` go to the method: gptq's damp, awq's grid, smoothquant's alpha.
    `head_bits` (8, 4 or 3) rounds the LM head to nearest, one scale per output; None leaves it
    float. The model is not changed; a bad argument is named before any work is done."""
    if isinstance(model, QuantizedTransformer):
        raise ValueError(f"quantize the float model, not a quantized one ({model.name})")
    if model.config.n_experts > 1:
        raise ValueError(f"quantize_model quantizes dense models; {model.config.name} is a mixture of "
                         f"{model.config.n_experts} experts")
    custom = method if callable(method) else None
    if custom is not None:
        method = getattr(custom, "__name__", "custom")
        if method in METHODS:
            method = f"{method} (own)"
    elif method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, or a function "
                         f"(weights, inputs, bits, group) -> QuantizedMatrix; got {method!r}")
    allowed_bits = METHOD_BITS.get(method, METHOD_BITS["gptq"])
    if isinstance(bits, bool) or bits not in allowed_bits:
        *most, last = allowed_bits
        allowed = f"{', '.join(map(str, most))} or {last}" if most else str(last)
        why = " (W8A8: int8 weights and activations)" if method == "smoothquant" else ""
        raise ValueError(f"{method} quantizes to {allowed} bits{why}; got bits={bits!r}")
    if head_bits is not None and (isinstance(head_bits, bool) or head_bits not in qmatmul.MATRIX_BITS):
        raise ValueError(f"head_bits must be one of {', '.join(map(str, qmatmul.MATRIX_BITS))}, or None for a "
                         f"float LM head; got {head_bits!r}")
    calibrated = custom is not None or method in NEEDS_CALIBRATION
    keys = quantized_keys(model.config)
    _check_group(method, bits, group, {key: model.matrices[key].shape[0] for key in keys})
    if method == "rtn" and options:
        raise ValueError(f"rtn takes no options; got {', '.join(sorted(options))}")
    if calibrated:
        calibration = calibration_inputs(model) if calibration is None else calibration
        missing = [key for key in keys if key not in calibration]
        if missing:
            raise ValueError(f"{method} needs calibration inputs for every quantized matrix; missing "
                             f"{', '.join(missing)} (calibration_inputs(model) makes them all)")
    from infra_lab import progress as progress_bars

    quantized = {}
    for key in progress_bars.bar(keys, desc=f"{method} int{bits}", show=progress):
        try:
            inputs = calibration[key] if calibrated else None
            quantized[key] = (_own(custom, model.matrices[key], inputs, bits, group, options) if custom else
                              _quantize_one(model.matrices[key], method, bits, group, inputs, options))
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
    if head_bits is not None:
        quantized[HEAD] = QuantizedMatrix.quantize(model.matrices[HEAD], head_bits)
    return QuantizedTransformer(model.config, model.w, quantized, method, model.figures)


def _check_group(method: str, bits: int, group, n_ins: dict[str, int]) -> None:
    if group is None:
        return
    if method == "smoothquant":
        raise ValueError(f"smoothquant's weights are int8 with one scale per output channel: group must be None; "
                         f"got {group!r}")
    common = math.gcd(*n_ins.values())
    allowed = [g for g in range(1, common + 1) if common % g == 0 and (bits == 8 or g % 2 == 0)]
    bad = next((key for key, n_in in n_ins.items() if isinstance(group, bool) or not isinstance(group, int)
                or group < 1 or n_in % group or (bits != 8 and group % 2)), None)
    if bad is not None:
        raise ValueError(f"group must divide every quantized row (the {n_ins[bad]} inputs of {bad}, among "
                         f"others){' and be even for packed codes' if bits != 8 else ''}: one of "
                         f"{', '.join(map(str, allowed))}, or None; got {group!r}")


def _own(function, weights: np.ndarray, inputs: np.ndarray, bits: int, group, options: dict) -> QuantizedMatrix:
    """A function of one's own, given copies, so it cannot change the model; it must return a
    QuantizedMatrix of the matrix's shape at `bits`."""
    matrix = function(weights.copy(), inputs.copy(), bits, group, **options)
    if not isinstance(matrix, QuantizedMatrix):
        raise ValueError(f"{getattr(function, '__name__', 'the method')} must return a QuantizedMatrix "
                         f"(QuantizedMatrix.from_values(values, scales, bits, group)); got {type(matrix).__name__}")
    if (matrix.n_in, matrix.n_out) != weights.shape or matrix.bits != bits:
        raise ValueError(f"{getattr(function, '__name__', 'the method')} returned a {matrix.bits}-bit "
                         f"({matrix.n_in}, {matrix.n_out}) matrix for a {bits}-bit {weights.shape} one")
    return matrix


def _quantize_one(weights: np.ndarray, method: str, bits: int, group, inputs, options: dict) -> QuantizedMatrix:
    if method == "rtn":
        return QuantizedMatrix.quantize(weights, bits, group)
    if method == "gptq":
        from infra_lab.quant.gptq import gptq

        return gptq(weights, inputs, bits, group, **options)
    if method == "awq":
        from infra_lab.quant.awq import awq

        return awq(weights, inputs, bits, group, **options)
    from infra_lab.quant.smoothquant import smooth

    return smooth(weights, inputs, **options)


# ---- the quantized model -------------------------------------------------------------------------

class QuantizedTransformer(Transformer):
    """A Transformer whose layers' matrices (given head_bits, its LM head too) are read quantized:
    the same `step`, `forward`, `decode_batch` and caches. On numpy and numba `linear` multiplies
    with quant.matmul (SmoothQuant: with the activations quantized per token too); on torch the
    model is a TorchTransformer of the dequantized weights, fake-quantizing SmoothQuant's
    activations the same way. `self.w` gives the effective (dequantized) weights, the model this
    one computes, dequantizing the quantized ones when asked (DequantizedWeights)."""

    def __init__(self, config: ModelConfig, weights: dict, quantized: dict[str, QuantizedMatrix], method: str,
                 figures: dict | None = None):
        if not isinstance(method, str) or not method:
            raise ValueError(f"method must name the method (one of {', '.join(map(repr, METHODS))}, or one's "
                             f"own); got {method!r}")
        shapes = weight_shapes(config)
        for key, matrix in quantized.items():
            parts = parts_of(key)  # the matrix's shape from its parts', with no copy of the floats
            if key not in [*quantized_keys(config), HEAD] or \
                    (matrix.n_in, matrix.n_out) != (shapes[parts[0]][0], sum(shapes[p][1] for p in parts)):
                raise ValueError(f"quantized matrices must be among the layers' matrices and the LM head, with their "
                                 f"shapes ({', '.join(quantized_keys(config))}, {HEAD}); got {key} "
                                 f"({matrix.n_in}, {matrix.n_out})")
        if HEAD in quantized and quantized[HEAD].input_scale is not None:
            raise ValueError("the quantized LM head takes its input as it comes: it must have no input_scale")
        kinds = {(m.bits, m.group if m.group != m.n_in else None) for key, m in quantized.items() if key != HEAD}
        if len(kinds) != 1:
            raise ValueError(f"a quantized model has one format (bits, group) for all its quantized matrices; got "
                             f"{sorted(kinds, key=str) or 'no matrices'}")
        if method == "smoothquant" and kinds != {(8, None)}:
            raise ValueError(f"smoothquant is W8A8: its matrices must be int8 per channel; got (bits, group) {kinds}")
        effective = dict(weights)
        for key, matrix in quantized.items():
            effective |= split_fused(config, key, matrix.dequantize())
        super().__init__(config, effective, figures)
        del effective
        self.method = method
        self.quantized: dict[str, QuantizedMatrix] = dict(quantized)
        for key in quantized:  # linear reads these quantized, never as floats
            del self.matrices[key]
        parts = {name for key in quantized for name in parts_of(key)}
        self.w = DequantizedWeights(config, {n: v for n, v in self.w.items() if n not in parts}, self.quantized)
        # W8A8: x * input_scale is quantized per token, then meets the int8 codes alone
        self._input_scales = {key: np.ones(m.n_in, np.float32) if m.input_scale is None else m.input_scale
                              for key, m in quantized.items() if method == "smoothquant" and key != HEAD}
        self._codes_only = {key: dataclasses.replace(quantized[key], input_scale=None) for key in self._input_scales}

    def prepare_weights(self, state: dict, version: int, check: bool = True):
        if hasattr(self, "quantized"):  # built already: new weights must be quantized, not loaded
            raise ValueError("a quantized model's weights are its quantized matrices: quantize the new weights "
                             "(quantize_model) and serve that model, rather than load them into this one")
        return super().prepare_weights(state, version, check)

    def linear(self, x: np.ndarray, key: str, backend: backends.Backend) -> np.ndarray:
        matrix = self.quantized.get(key)
        if matrix is None:
            return super().linear(x, key, backend)
        if key not in self._input_scales:  # weight-only: the activations meet the codes as they are
            return qmatmul.matmul(x, matrix, backend)
        from infra_lab.quant import smoothquant

        if backend.name == "numpy":
            return smoothquant.matmul_w8a8(x, matrix)
        return qmatmul.matmul(smoothquant.fake_quantize_activations(x * self._input_scales[key]),
                              self._codes_only[key], backend)

    def to_torch(self):
        """The torch face: a TorchTransformer of the effective weights; for SmoothQuant one that
        fake-quantizes each matrix's scaled input per token first."""
        if self.method != "smoothquant":
            return super().to_torch()
        scales = {name: scale for key, scale in self._input_scales.items() for name in parts_of(key)}
        return _activation_quantized_class()(self.config, self.w, scales)

    @property
    def n_params(self) -> int:
        return sum(v.size for v in self.w.floats.values()) + sum(m.n_in * m.n_out for m in self.quantized.values())

    @property
    def bits(self) -> int:
        """The layers' matrices' bits (head_bits: the LM head's, when it is quantized)."""
        return self._a_layer_matrix().bits

    @property
    def group(self) -> int | None:
        """Inputs per scale in the layers' matrices; None for one scale per output channel."""
        matrix = self._a_layer_matrix()
        return None if matrix.group == matrix.n_in else matrix.group

    @property
    def head_bits(self) -> int | None:
        return self.quantized[HEAD].bits if HEAD in self.quantized else None

    def _a_layer_matrix(self) -> QuantizedMatrix:
        return next(m for key, m in self.quantized.items() if key != HEAD)

    @property
    def name(self) -> str:
        """Like "gptq int4 g32", "rtn int8 per-channel", "smoothquant w8a8" or, with the LM head
        quantized, "rtn int4 g32, head int8"."""
        head = "" if self.head_bits is None else f", head int{self.head_bits}"
        if self.method == "smoothquant":
            return "smoothquant w8a8" + head
        return f"{self.method} int{self.bits} {'per-channel' if self.group is None else f'g{self.group}'}{head}"

    def describe(self) -> str:
        return (f"{self.name}: {self.weight_bytes / 1e6:.3f} MB of weights ({self.fp16_bytes / self.weight_bytes:.2f}x "
                f"smaller than fp16, {self.fp32_bytes / self.weight_bytes:.2f}x than fp32)")

    @property
    def weight_bytes(self) -> float:
        """The model's size packed: quantized matrices at their packed_nbytes, everything else at fp16."""
        quantized_params = sum(m.n_in * m.n_out for m in self.quantized.values())
        return sum(m.packed_nbytes for m in self.quantized.values()) + 2 * (self.n_params - quantized_params)

    @property
    def fp32_bytes(self) -> int:
        """The float model's size at fp32, for comparison."""
        return 4 * self.n_params

    @property
    def fp16_bytes(self) -> int:
        return 2 * self.n_params


class DequantizedWeights(Mapping):
    """A quantized model's `w`: name -> array, every weight of the model it computes. The weights
    left in float are held as they are; a quantized matrix's parts are dequantized from its codes
    when asked for (to_torch, a test), so that the model holds only its codes in memory."""

    def __init__(self, config: ModelConfig, floats: dict[str, np.ndarray], quantized: dict[str, QuantizedMatrix]):
        self.config, self.floats, self.quantized = config, floats, quantized
        self._owner = {name: key for key in quantized for name in parts_of(key)}  # part -> its matrix's key
        self._names = [name for name in weight_shapes(config) if name in floats or name in self._owner]

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.floats:
            return self.floats[name]
        if name not in self._owner:
            raise KeyError(name)
        key = self._owner[name]
        return split_fused(self.config, key, self.quantized[key].dequantize())[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@functools.cache
def _activation_quantized_class():
    """TorchTransformer whose mm rounds h * input_scale per token to int8 and back, then divides
    the input scale out again, since the effective weights hold it (diag(input_scale) W_q): the
    product is round(h * input_scale) @ W_q, as in W8A8."""
    import torch

    from infra_lab.model.torch_model import TorchTransformer

    class ActivationQuantizedTorchTransformer(TorchTransformer):
        def __init__(self, config: ModelConfig, weights: dict, input_scales: dict[str, np.ndarray]):
            super().__init__(config, weights)
            self.scaled = frozenset(input_scales)  # weight names whose inputs are quantized
            for name, scale in input_scales.items():
                self.register_buffer(_buffer(name), torch.as_tensor(scale, dtype=torch.float32))

        def mm(self, h: torch.Tensor, name: str) -> torch.Tensor:
            if name in self.scaled:
                scale = getattr(self, _buffer(name))  # (n_in,)
                h = fake_quantize_torch(h * scale) / scale
            return super().mm(h, name)

    return ActivationQuantizedTorchTransformer


def _buffer(name: str) -> str:
    return "input_scale__" + name.replace(".", "__")


def fake_quantize_torch(x, bits: int = 8):
    """x (..., n) rounded to `bits` per token (one scale per row: max |x| / q_max) and back, in torch."""
    q_max = 2 ** (bits - 1) - 1
    step = x.abs().amax(-1, keepdim=True) / q_max  # (..., 1)
    step = step.where(step > 0, step.new_ones(()))
    return (x / step).round().clamp(-q_max, q_max) * step


def bits_per_byte(model: Transformer, data: np.ndarray, max_windows: int | None = None) -> float:
    """Mean cross-entropy in bits per byte of `model` (a Transformer or QuantizedTransformer) over
    non-overlapping 512-byte windows of `data`, through its torch face on the CPU (train.bits_per_byte)."""
    from infra_lab.model import train

    return train.bits_per_byte(model.to_torch().eval(), np.asarray(data, np.uint8), max_windows=max_windows)
