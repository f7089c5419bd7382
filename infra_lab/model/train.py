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

SCHEDULES = {  # steps, batch (windows of 512 bytes), peak learning rate
    "target": (2400, 8, 3e-3),  # about 15 minutes on 2 cores
    "draft": (2400, 8, 4e-3),  # about 5 minutes
}


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
          eval_windows: int | None = None) -> dict:
    """Train the `size` model and save its weights to `out`; return the run's figures."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(CONFIGS)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    from infra_lab import progress as progress_bars

    config = CONFIGS[size]
    total_steps, batch, peak_lr = SCHEDULES[size]
    total_steps = steps or total_steps
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    rng = np.random.default_rng(seed)
    train_bytes, validation = corpus.load()
    model = TorchTransformer(config, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
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
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            bar.set_postfix(bits_per_byte=f"{loss.item() / math.log(2):.3f}")
    seconds = time.perf_counter() - started
    model.eval()
    figures = {"size": size, "steps": total_steps, "seed": seed, "train_seconds": seconds,
               "validation_bits_per_byte": bits_per_byte(model, validation, max_windows=eval_windows),
               "unigram_bits_per_byte": corpus.unigram_bits_per_byte(train_bytes, validation),
               "threads": torch.get_num_threads()}
    save(model.numpy_weights(), config, out, figures)
    return figures
