"""Train the small GPT with torch on the CPU: deterministic under a seed, with a progress bar.

AdamW with a linear warm-up and cosine decay over random 512-byte windows of the training set.
"""
from __future__ import annotations

import collections
import functools
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from infra_lab.model import corpus
from infra_lab.model.config import CONFIGS
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.model.weights import save
from infra_lab.moe import torch_moe
from infra_lab.moe.routing import update_bias

SCHEDULES = {  # steps, batch (windows of 512 bytes), peak learning rate
    "target": (2400, 8, 3e-3),  # about 15 minutes on 2 cores
    "draft": (2400, 8, 4e-3),  # about 5 minutes
    "moe": (2400, 8, 3e-3),
}
BALANCING = ("none", "aux", "bias")  # a mixture of experts' load balancing (moe.routing)
AUX_WEIGHT, Z_WEIGHT = 0.01, 0.001  # Switch Transformer's alpha (Fedus et al. 2022, 2.2); ST-MoE's z-loss weight
# DeepSeek-V3 moves its bias by gamma = 0.001 per step, from that step's loads, for its first 14.3T
# tokens (DeepSeek-AI 2024, 4.2). Chapter 09 also trains with gamma 10x faster and with the loads of
# the last 16 steps; both balance worse here (benchmarks/moe_balancing.py).
BIAS_RATE, BIAS_WINDOW = 0.001, 1


@torch.no_grad()
def bits_per_byte(model: TorchTransformer, data: np.ndarray, window: int = 512, max_windows: int | None = None) -> float:
    """Mean cross-entropy in bits per byte over non-overlapping windows of `data`."""
    usable = (len(data) - 1) // window
    if max_windows is not None:
        usable = min(usable, max_windows)
    if usable < 1:
        raise ValueError(f"need more than {window} bytes to evaluate; got {len(data)}")
    total, count = 0.0, 0
    for first in range(0, usable, 16):
        starts = np.arange(first, min(usable, first + 16)) * window
        x = torch.from_numpy(np.stack([data[s:s + window] for s in starts]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[s + 1:s + window + 1] for s in starts]).astype(np.int64))
        logits = model(x)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    return total / count / math.log(2)


def _restores_deterministic_algorithms(function):
    """`function` may turn on torch's deterministic kernels; the caller gets the setting it had."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        try:
            return function(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    return wrapped


@_restores_deterministic_algorithms
def train(size: str, out: Path, seed: int = 0, steps: int | None = None, progress: bool = True,
          eval_windows: int | None = None, balancing: str = "bias", bias_rate: float = BIAS_RATE,
          bias_window: int = BIAS_WINDOW, aux_weight: float = AUX_WEIGHT) -> dict:
    """Train the `size` model and save its weights to `out`; return the run's figures. A mixture
    of experts balances its experts' loads by `balancing`: "aux" (the Switch auxiliary loss, with
    ST-MoE's z-loss; the first weighed by `aux_weight`), "bias" (DeepSeek-V3's auxiliary-loss-free
    bias, moved by `bias_rate` from the loads of the last `bias_window` steps) or "none"."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(CONFIGS)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if balancing not in BALANCING:
        raise ValueError(f"unknown balancing {balancing!r}; choose one of {', '.join(BALANCING)}")
    if isinstance(bias_window, bool) or not isinstance(bias_window, int) or bias_window < 1:
        raise ValueError(f"the bias window must be a whole number of steps >= 1; got {bias_window!r}")
    from infra_lab import progress as progress_bars

    config = CONFIGS[size]
    total_steps, batch, peak_lr = SCHEDULES[size]
    total_steps = steps or total_steps
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    rng = np.random.default_rng(seed)
    train_bytes, validation = corpus.load()
    model = TorchTransformer(config, seed=seed)
    model.record_routing = config.n_experts > 1
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=peak_lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    loads = []  # every 50 steps: (layers, experts) shares of the step's assignments
    recent = collections.deque(maxlen=bias_window)  # the last steps' (layers, experts) counts
    warmup = max(1, total_steps // 20)
    started = time.perf_counter()
    bar = progress_bars.bar(range(total_steps), desc=f"training {size}", show=progress)
    for step in bar:
        lr = peak_lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train_bytes) - config.context - 1, size=batch)
        window = np.stack([train_bytes[s:s + config.context + 1] for s in starts]).astype(np.int64)
        x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
        model.routings.clear()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), y.reshape(-1))
        objective = loss + balance_loss(model.routings, balancing, aux_weight)
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if model.routings:
            counts = step_loads(model)
            recent.append(counts)
            if balancing == "bias":
                move_biases(model, sum(recent), bias_rate)
            if step % 50 == 0:
                loads.append((counts / counts.sum(1, keepdims=True)).tolist())
        if step % 50 == 0:
            bar.set_postfix(bits_per_byte=f"{loss.item() / math.log(2):.3f}")
    seconds = time.perf_counter() - started
    model.eval()
    figures = {"size": size, "steps": total_steps, "seed": seed, "train_seconds": seconds,
               "validation_bits_per_byte": bits_per_byte(model, validation, max_windows=eval_windows),
               "unigram_bits_per_byte": corpus.unigram_bits_per_byte(train_bytes, validation),
               "threads": torch.get_num_threads()}
    if config.n_experts > 1:
        figures |= {"balancing": balancing, "loads_every_50_steps": loads,
                    "bias_rate": bias_rate if balancing == "bias" else None,
                    "bias_window": bias_window if balancing == "bias" else None,
                    "aux_weight": aux_weight if balancing == "aux" else None,
                    "validation_loads": expert_loads(model, validation, max_windows=eval_windows).tolist()}
    save(model.numpy_weights(), config, out, figures, np.float16 if config.n_experts > 1 else np.float32)
    return figures


def balance_loss(routings: list, balancing: str, aux_weight: float = AUX_WEIGHT) -> torch.Tensor | float:
    """The auxiliary losses "aux" adds, averaged over the MoE layers: Switch's balance loss and
    ST-MoE's z-loss; 0 for the other methods."""
    if balancing != "aux" or not routings:
        return 0.0
    aux = sum(torch_moe.switch_aux_loss(routing) for routing, _ in routings) / len(routings)
    z = sum(torch_moe.router_z_loss(logits) for _, logits in routings) / len(routings)
    return aux_weight * aux + Z_WEIGHT * z


@torch.no_grad()
def expert_loads(model: TorchTransformer, data: np.ndarray, window: int = 512,
                 max_windows: int | None = None) -> np.ndarray:
    """Each MoE layer's share of assignments per expert (layers, experts), routed as in generation
    (dropless), over non-overlapping windows of `data`: all of them, or `max_windows` spread
    evenly over it."""
    usable = (len(data) - 1) // window
    if usable < 1:
        raise ValueError(f"need more than {window} bytes to route; got {len(data)}")
    chosen = np.arange(usable) if max_windows is None or max_windows >= usable else \
        np.linspace(0, usable - 1, max_windows).round().astype(np.int64)
    was_recording, model.record_routing = model.record_routing, True
    counts = np.zeros((model.config.n_layers, model.config.n_experts))
    try:
        for first in range(0, len(chosen), 16):
            starts = chosen[first:first + 16] * window
            model.routings.clear()
            model(torch.from_numpy(np.stack([data[s:s + window] for s in starts]).astype(np.int64)))
            for i, (routing, _) in enumerate(model.routings):
                counts[i] += torch.bincount(routing.experts[routing.kept], minlength=model.config.n_experts).numpy()
    finally:
        model.routings.clear()
        model.record_routing = was_recording
    return counts / counts.sum(1, keepdims=True)


@torch.no_grad()
def step_loads(model: TorchTransformer) -> np.ndarray:
    """Each MoE layer's assignments per expert in the forward just run (layers, experts)."""
    return np.array([torch.bincount(routing.experts[routing.kept], minlength=model.config.n_experts).numpy()
                     for routing, _ in model.routings], np.float64)


@torch.no_grad()
def move_biases(model: TorchTransformer, loads: np.ndarray, rate: float) -> None:
    """Each MoE layer's bias moved by moe.routing.update_bias from its loads (layers, experts)."""
    for i, layer_loads in enumerate(loads):
        bias = model.w(f"layers.{i}.router_bias")
        bias.copy_(torch.from_numpy(update_bias(bias.numpy(), layer_loads, rate)))
