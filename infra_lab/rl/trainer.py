"""The trainer: torch, on the same weights the engine serves. It computes its own log-probabilities
of the rollout's tokens with a full forward (it never trusts the engine's: those come from other
kernels, perhaps in another precision, which is the mismatch chapter 11 measures), then one
optimizer step on the loss of `losses`.

A frozen reference model (the warm start) anchors the KL term, as in DeepSeekMath's GRPO."""
from __future__ import annotations

import time
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from infra_lab.model.torch_model import TorchTransformer
from infra_lab.model.transformer import Transformer
from infra_lab.rl.losses import LossConfig, policy_loss
from infra_lab.rl.rollout import Rollout


@dataclass
class Scored:
    """A rollout laid out for the trainer: completion token j of sequence i at [i, j]."""
    tokens: torch.Tensor  # (B, L) prompt then completion, padded with 0
    index: torch.Tensor  # (B, Tc) where completion token j's log-prob sits among the L - 1 predictions
    mask: torch.Tensor  # (B, Tc) bool: a real completion token
    rollout_logp: torch.Tensor  # (B, Tc) the engine's log-probs (0 on padding)


def lay_out(rollout: Rollout) -> Scored:
    prompts = [p for p in rollout.prompts for _ in range(rollout.group)]
    lengths = [len(p) + len(c) for p, c in zip(prompts, rollout.completions)]
    width = max(map(len, rollout.completions)) or 1
    tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.int64)
    index = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    rollout_logp = torch.zeros(len(prompts), width, dtype=torch.float32)
    for i, (prompt, completion, logp) in enumerate(zip(prompts, rollout.completions, rollout.logprobs)):
        sequence = prompt + completion
        tokens[i, :len(sequence)] = torch.tensor(sequence)
        # the prediction at position t is of token t + 1: completion token j is predicted at len(prompt) - 1 + j
        index[i] = (len(prompt) - 1 + torch.arange(width)).clamp(max=max(lengths) - 2)
        mask[i, :len(completion)] = True
        rollout_logp[i, :len(completion)] = torch.tensor(logp, dtype=torch.float32)
    return Scored(tokens, index, mask, rollout_logp)


def token_logprobs(model: TorchTransformer, scored: Scored) -> torch.Tensor:
    """(B, Tc) log pi(token) of every completion token under `model`, by one full forward."""
    logits = model(scored.tokens[:, :-1])  # (B, L - 1, vocab)
    every = -F.cross_entropy(logits.transpose(1, 2), scored.tokens[:, 1:], reduction="none")  # (B, L - 1)
    return every.gather(1, scored.index)


@dataclass
class StepStats:
    loss: float
    reward_mean: float
    ratio_mean: float
    clip_fraction: float
    kl_mean: float
    tis_truncated_fraction: float
    tokens: int
    mismatch_abs_mean: float  # mean |engine log-prob - trainer log-prob| over the tokens, same weights
    mismatch_abs_max: float
    seconds: float


def contiguous(weights: dict) -> dict:
    """Row-major copies: the engine keeps some matrices as transposed views, which torch would
    train in their strided order (slower)."""
    return {name: np.ascontiguousarray(value) for name, value in weights.items()}


def differing_fields(a, b) -> list[str]:
    return [f"{f.name}: {getattr(a, f.name)!r} against {getattr(b, f.name)!r}" for f in fields(a)
            if getattr(a, f.name) != getattr(b, f.name)]


class Trainer:
    def __init__(self, model: Transformer, loss: LossConfig, lr: float = 3e-4, reference: Transformer | None = None,
                 betas: tuple[float, float] = (0.9, 0.99), grad_clip: float = 1.0, updates_per_batch: int = 1):
        """Train a torch copy of `model`'s weights with `loss`; `reference` (default: `model` as it
        is now) is the frozen anchor of the KL term and must be the same architecture. Each batch
        takes `updates_per_batch` optimizer steps (DeepSeekMath's mu; 1 keeps it on-policy)."""
        if reference is not None and reference.config != model.config:
            raise ValueError("the reference model must have the policy's config; they differ in "
                             + "; ".join(differing_fields(reference.config, model.config)))
        if not (isinstance(lr, (int, float)) and 0 < lr < 1):
            raise ValueError(f"lr must be a number in (0, 1); got {lr!r}")
        if isinstance(updates_per_batch, bool) or not isinstance(updates_per_batch, int) or updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be a whole number >= 1; got {updates_per_batch!r}")
        self.config, self.loss, self.grad_clip, self.updates = model.config, loss, grad_clip, updates_per_batch
        self.policy = TorchTransformer(model.config, contiguous(model.w))
        self.reference = TorchTransformer(model.config, contiguous((reference or model).w)).requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr, betas=betas, weight_decay=0.0)
        self.version = int(model.version)

    def state(self) -> dict[str, np.ndarray]:
        """The policy's weights by name (copies), for the engine."""
        return {name: value.copy() for name, value in self.policy.numpy_weights().items()}

    def step(self, rollout: Rollout, rewards: np.ndarray) -> StepStats:
        """One training step on a rollout and its (B,) rewards; the version goes up by one. Bad
        rewards (NaN, the wrong count) raise before anything changes."""
        started = time.perf_counter()
        rewards = np.asarray(rewards, dtype=np.float64)
        if rewards.shape != (len(rollout.completions),):
            raise ValueError(f"expected {len(rollout.completions)} rewards, one per completion; got shape "
                             f"{rewards.shape}")
        advantages = self.loss.advantages(torch.from_numpy(rewards).reshape(-1, rollout.group)).float()  # (B,)
        scored = lay_out(rollout)
        with torch.no_grad():
            ref_logp = token_logprobs(self.reference, scored) if self.loss.kl_weight > 0 else None
            # one update per batch: the first forward's values are the old policy's, so it is not run twice
            old_logp = token_logprobs(self.policy, scored) if self.updates > 1 else None
        for update in range(self.updates):
            logp = token_logprobs(self.policy, scored)
            if old_logp is None:
                old_logp = logp.detach()
            if update == 0:
                gap = (old_logp - scored.rollout_logp).abs()[scored.mask]
            loss, stats = policy_loss(logp, old_logp, advantages, scored.mask, self.loss, ref_logp=ref_logp,
                                      rollout_logp=scored.rollout_logp)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
            self.optimizer.step()
        self.version += 1
        return StepStats(loss.item(), float(rewards.mean()), stats["ratio_mean"], stats["clip_fraction"],
                         stats["kl_mean"], stats["tis_truncated_fraction"], int(stats["tokens"]),
                         float(gap.mean()) if gap.numel() else 0.0, float(gap.max()) if gap.numel() else 0.0,
                         time.perf_counter() - started)
