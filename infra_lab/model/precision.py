"""Training numerics in low precision (chapter 08): the small GPT's training step in fp32, in fp16
without and with dynamic loss scaling, and in bf16, from the same weights on the same batches.

fp16 has 5 exponent bits: a gradient below 2**-24 rounds to zero. Loss scaling multiplies the loss
by S, so the backward pass carries S*g, and divides the weight gradients by S before the step; the
dynamic scaler halves S and skips the step when a gradient overflows, and doubles S after a run of
clean steps (Micikevicius et al., "Mixed Precision Training", ICLR 2018). bf16 keeps fp32's 8
exponent bits and needs no scaling (Kalamkar et al., "A Study of BFLOAT16 for Deep Learning
Training", 2019). Weights, AdamW's state and the loss stay fp32 throughout ("master weights").

Low precision is torch.autocast on the model's device: matmuls and attention take fp16 (or bf16)
inputs and give fp16 outputs, accumulating in fp32 inside, as tensor cores do. On the CPU torch
(2.13) does this for real; tests/test_precision.py checks it.

Underflow, as counted here: at the same weights and batch, the entries of the activation gradients
(the gradient of the loss with respect to each matmul's and attention's output, the tensors of
Micikevicius et al.'s Figure 3) that an fp32 pass gives as nonzero but too small for fp16 (times the
loss scale, at most 2**-25, half the smallest subnormal, so they round to zero) and that are exactly
zero in the fp16 pass: gradient lost to the format's range, not values that were zero anyway.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from infra_lab.model import corpus
from infra_lab.model.config import CONFIGS
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.quant.formats import BF16, FP16

PRECISIONS = ("fp32", "fp16", "fp16-scaled", "bf16")
AUTOCAST_DTYPES = {"fp32": None, "fp16": torch.float16, "fp16-scaled": torch.float16, "bf16": torch.bfloat16}
FORMATS = {torch.float16: FP16, torch.bfloat16: BF16}
INITIAL_LOSS_SCALE = 2.0**16  # torch.amp.GradScaler's init_scale; NVIDIA Apex's dynamic scaler also starts there
FINAL_LOSS_STEPS = 10  # the final loss is the mean over this many last steps
TAPPED_OPERATIONS = {torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm,
                     torch.bmm, torch.Tensor.bmm, F.linear, F.scaled_dot_product_attention}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


@dataclass
class DynamicLossScaler:
    """The loss scale S and its rule: an overflow (any inf or NaN weight gradient) skips the step and
    multiplies S by `backoff`; `growth_interval` clean steps in a row multiply S by `growth`."""
    scale: float = INITIAL_LOSS_SCALE
    growth_interval: int = 2000  # clean steps before S grows (GradScaler's default)
    backoff: float = 0.5
    growth: float = 2.0
    clean_steps: int = 0  # since the last overflow or growth

    def __post_init__(self):
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be positive and finite; got {self.scale}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1; got {self.growth_interval}")

    def unscale(self, parameters: list[torch.Tensor]) -> bool:
        """Divide every weight gradient by S in place; True when all are finite (the step may go)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        for g in grads:
            g.div_(self.scale)
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0


class ActivationGradientTap(TorchFunctionMode):
    """Inside `with`, registers a hook on every matmul's and attention's output that keeps the
    gradient the backward pass gives it: `gradients[i]` belongs to the i-th such output of the
    forward pass, in the output's own dtype (fp16 under fp16 autocast)."""

    def __init__(self):
        super().__init__()
        self.gradients: dict[int, torch.Tensor] = {}
        self.outputs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in TAPPED_OPERATIONS and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self.keep, self.outputs))
            self.outputs += 1
        return out

    def keep(self, index: int, gradient: torch.Tensor) -> None:
        self.gradients[index] = gradient.detach()


def activation_gradients(model: TorchTransformer, x: torch.Tensor, y: torch.Tensor, precision: str,
                         loss_scale: float = 1.0) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward of x (B, T) against targets y (B, T) under `precision`: the loss (fp32,
    unscaled, nats per byte) and the activation gradients of loss * loss_scale, in forward order.
    The weight gradients are accumulated into .grad, as loss.backward() does."""
    dtype = AUTOCAST_DTYPES[check_precision(precision)]
    autocast = torch.autocast(x.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with ActivationGradientTap() as tap, autocast:
        logits = model(x)  # (B, T, vocab), fp16 or bf16 under autocast
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    (loss * loss_scale).backward()
    return loss.item(), [tap.gradients[i] for i in sorted(tap.gradients)]


def underflowed(reference: list[torch.Tensor], low_precision: list[torch.Tensor], loss_scale: float = 1.0) -> int:
    """How many entries were lost to underflow: exactly zero in `low_precision` (fp16 or bf16), where
    the fp32 `reference` times `loss_scale` is nonzero but at most half the format's smallest
    subnormal, so that storing it rounds it to zero. Entries that are zero in both, or that came out
    zero through rounding elsewhere while their fp32 value was in range, are not counted."""
    if len(reference) != len(low_precision):
        raise ValueError(f"need the same tensors on both sides; got {len(reference)} and {len(low_precision)}")
    lost = 0
    for r, g in zip(reference, low_precision):
        if g.dtype not in FORMATS:
            raise ValueError(f"low_precision holds {g.dtype}; expected one of {', '.join(map(str, FORMATS))}")
        flushes_below = FORMATS[g.dtype].min_subnormal / 2 / loss_scale  # |r| <= this rounds to zero
        lost += int(((g == 0) & (r != 0) & (r.abs() <= flushes_below)).sum())
    return lost


def gradient_exponents(gradients: list[torch.Tensor]) -> dict[int, int]:
    """Histogram of log2 |g|: e -> how many finite nonzero entries have 2**e <= |g| < 2**(e+1).
    Zeros and infinities are left out. fp16 holds 2**-24 (smallest subnormal) up to 65504."""
    lowest = -150  # below fp32's smallest subnormal, 2**-149
    counts = torch.zeros(300, dtype=torch.int64)
    for g in gradients:
        g = g.detach().float().flatten()
        g = g[(g != 0) & torch.isfinite(g)]
        exponents = torch.frexp(g).exponent.long() - 1  # |g| = m 2^(e+1), m in [0.5, 1)
        counts += torch.bincount(exponents - lowest, minlength=len(counts)).cpu()
    return {e + lowest: int(n) for e, n in enumerate(counts.tolist()) if n}


@dataclass
class StepResult:
    loss: float  # fp32 cross-entropy of the batch before the step, nats per byte
    stepped: bool  # False when the scaler skipped the step for an overflow
    loss_scale: float  # S used in this step's backward (1 without a scaler)
    underflowed: int | None = None  # activation-gradient entries lost to underflow, when counted
    gradients: list[torch.Tensor] = field(default_factory=list, repr=False)  # activation gradients


def train_step(model: TorchTransformer, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               precision: str, scaler: DynamicLossScaler | None = None, count_underflow: bool = False) -> StepResult:
    """One AdamW step on batch x, y (B, T) with the weights kept in fp32; gradients clipped to norm 1.
    "fp16-scaled" takes a `scaler`, and the other precisions none."""
    if (check_precision(precision) == "fp16-scaled") != (scaler is not None):
        raise ValueError(f"precision {precision!r} {'needs' if scaler is None else 'takes no'} loss scaler")
    parameters = list(model.parameters())
    lost = None
    if count_underflow:  # an fp32 pass from the same weights first, to tell lost values from true zeros
        _, reference = activation_gradients(model, x, y, "fp32")
        optimizer.zero_grad(set_to_none=True)
    loss_scale = scaler.scale if scaler else 1.0
    loss, gradients = activation_gradients(model, x, y, precision, loss_scale)
    if count_underflow:
        lost = underflowed(reference, gradients, loss_scale)
    finite = scaler.unscale(parameters) if scaler else True
    if finite:
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
    if scaler:
        scaler.update(finite)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, finite, loss_scale, lost, gradients)


@contextlib.contextmanager
def deterministic_algorithms(device: torch.device):
    """torch's deterministic kernels inside, the setting as it was outside. Without them training on
    the CPU is not bit-reproducible (a backward reduction depends on thread timing)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")  # CUDA: warn (cuBLAS needs an env var)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def learning_rate(step: int, steps: int, peak_lr: float) -> float:
    """train.py's schedule: linear warm-up over the first steps/20, then cosine decay towards zero."""
    return peak_lr * min(1.0, (step + 1) / max(1, steps // 20)) * 0.5 * (1 + math.cos(math.pi * step / steps))


def train_run(precision: str, steps: int = 200, seed: int = 0, batch: int = 8, context: int = 256,
              peak_lr: float = 1e-3, growth_interval: int = 2000, initial_scale: float = INITIAL_LOSS_SCALE,
              count_underflow: bool = True, device: str = "cpu", progress: bool = False) -> dict:
    """Train the target model for `steps` steps under `precision` and return the run's figures.

    The seed fixes the initial weights and the batches (random `context`-byte windows of the training
    split), so runs of different precisions see the same data from the same start. The optimizer is
    train.py's (AdamW, gradients clipped to norm 1, its schedule shortened), at a peak learning rate of
    1e-3: at 3e-3 the loss after 200 steps moves by 1-2% when the initial weights move by 2**-11, as
    much as the precisions differ, and at 1e-3 by about 0.1%. The fp16 runs count underflow (an extra
    fp32 pass per step) unless `count_underflow` is False.

    Returns: losses (per step, nats per byte, of the batch before the step), final_loss (the mean of
    the last FINAL_LOSS_STEPS), seconds; the last step's activation_gradient_entries and
    gradient_exponents (see `gradient_exponents`; times S for the scaled run); underflowed (per step)
    for fp16; loss_scales (per step) and skipped_steps for fp16-scaled.
    """
    check_precision(precision)
    config = CONFIGS["target"]
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    if not 1 <= context <= config.context:
        raise ValueError(f"context must be in 1..{config.context}; got {context}")
    from infra_lab import progress as progress_bars

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_bytes, _ = corpus.load()
    model = TorchTransformer(config, seed=seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = DynamicLossScaler(initial_scale, growth_interval) if precision == "fp16-scaled" else None
    count_underflow = count_underflow and AUTOCAST_DTYPES[precision] == torch.float16
    results: list[StepResult] = []
    started = time.perf_counter()
    with deterministic_algorithms(torch.device(device)):
        for step in progress_bars.bar(range(steps), desc=f"training in {precision}", show=progress):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, peak_lr)
            starts = rng.integers(0, len(train_bytes) - context - 1, size=batch)
            window = torch.from_numpy(np.stack([train_bytes[s:s + context + 1] for s in starts]).astype(np.int64))
            x, y = window[:, :-1].to(device), window[:, 1:].to(device)  # (B, T) each
            results.append(train_step(model, optimizer, x, y, precision, scaler, count_underflow))
            last_gradients, results[-1].gradients = results[-1].gradients, []  # 14M entries at 8 x 256
    seconds = time.perf_counter() - started
    losses = [r.loss for r in results]
    figures = {"precision": precision, "seed": seed, "steps": steps, "batch": batch, "context": context,
               "peak_lr": peak_lr, "losses": losses, "final_loss": float(np.mean(losses[-FINAL_LOSS_STEPS:])),
               "seconds": seconds, "threads": torch.get_num_threads(),
               "activation_gradient_entries": sum(g.numel() for g in last_gradients),
               "gradient_exponents": gradient_exponents(last_gradients)}
    if count_underflow:
        figures["underflowed"] = [r.underflowed for r in results]
    if scaler:
        figures |= {"loss_scales": [r.loss_scale for r in results],
                    "skipped_steps": sum(not r.stepped for r in results)}
    return figures
