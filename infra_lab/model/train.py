"""Train the small GPT with torch on the CPU: deterministic under a seed, with a progress bar.

AdamW with a linear warm-up and cosine decay over random 512-byte windows of the training set.
"""
from __future__ import annotations

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
BIAS_RATE = 0.001  # DeepSeek-V3's bias update speed gamma for its first 14.3T tokens (DeepSeek-AI 2024, 4.2)


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


def train(size: str, out: Path, seed: int = 0, steps: int | None = None, progress: bool = True,
          eval_windows: int | None = None, balancing: str = "bias") -> dict:
    """Train the `size` model and save its weights to `out`; return the run's figures. A mixture
    of experts balances its experts' loads by `balancing`: "aux" (the Switch auxiliary loss, with
    ST-MoE's z-loss), "bias" (DeepSeek-V3's auxiliary-loss-free bias) or "none"."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(CONFIGS)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if balancing not in BALANCING:
        raise ValueError(f"unknown balancing {balancing!r}; choose one of {', '.join(BALANCING)}")
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
        objective = loss + balance_loss(model.routings, balancing)
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if model.routings:
            counts = balance_step(model, balancing)
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
        figures |= {"balancing": balancing, "loads_every_50_steps": loads}
    save(model.numpy_weights(), config, out, figures, np.float16 if config.n_experts > 1 else np.float32)
    return figures


def balance_loss(routings: list, balancing: str) -> torch.Tensor | float:
    """The auxiliary losses "aux" adds, averaged over the MoE layers: Switch's balance loss and
    ST-MoE's z-loss; 0 for the other methods."""
    if balancing != "aux" or not routings:
        return 0.0
    aux = sum(torch_moe.switch_aux_loss(routing) for routing, _ in routings) / len(routings)
    z = sum(torch_moe.router_z_loss(logits) for _, logits in routings) / len(routings)
    return AUX_WEIGHT * aux + Z_WEIGHT * z


@torch.no_grad()
def balance_step(model: TorchTransformer, balancing: str) -> np.ndarray:
    """Each MoE layer's assignments per expert this step (layers, experts); with "bias", each
    layer's bias moved by moe.routing.update_bias."""
    counts = []
    for i, (routing, _) in enumerate(model.routings):
        load = torch.bincount(routing.experts[routing.kept], minlength=model.config.n_experts).numpy()
        counts.append(load)
        if balancing == "bias":
            bias = model.w(f"layers.{i}.router_bias")
            bias.copy_(torch.from_numpy(update_bias(bias.numpy(), load, BIAS_RATE)))
    return np.array(counts, np.float64)
