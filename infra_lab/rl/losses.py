"""The policy-gradient losses of chapter 11, one module with a switch for each piece.

A batch holds B completions (sequences) padded to T token positions: P prompts with G samples
each, B = P * G, and sample i of prompt p is row p * G + i. Per token t of completion i the
trainer has logp = log pi_theta(o_i,t | q, o_i,<t) (the current weights, with grad), old_logp
(the weights that made the rollout, recomputed by the trainer, no grad), optionally ref_logp (a
frozen reference model) and rollout_logp (what the inference engine reported while sampling).
All log-probabilities are in nats.

The pieces, and where they come from:

- Group advantages (GRPO's outcome supervision: Shao et al. 2024, "DeepSeekMath: Pushing the
  Limits of Mathematical Reasoning in Open Language Models", arXiv:2402.03300, section 4.1.2):
  A_i = (r_i - mean(r)) / std(r) over the G samples of one prompt, the same A_i for every token
  of o_i. The std is the sample std (ddof=1), as TRL's GRPOTrainer computes it (torch's default
  `.std()`), plus eps = 1e-4 (TRL's constant) so a group of equal rewards gives A = 0, not NaN.
- The clipped surrogate min(rho A, clip(rho, 1 - eps, 1 + eps) A) with rho = pi_theta / pi_old
  (PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347).
- The KL penalty beta * KL(pi_theta || pi_ref), per token with the k3 estimator
  pi_ref / pi_theta - log(pi_ref / pi_theta) - 1 (DeepSeekMath eq. 4; Schulman 2020,
  "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html), beta = 0.04.
- GRPO's length normalization: 1/|o_i| per sequence, then the mean over the G sequences.
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
  arXiv:2503.20783) removes both GRPO's std division (a question-level difficulty bias) and the
  1/|o_i| (a response-level length bias: short correct answers get a bigger push per token, long
  wrong answers a smaller penalty per token), dividing every sequence's token sum by one
  constant, the generation budget, instead. `token_weights` computes the per-token push each
  normalization gives, to show that bias.
- REINFORCE with a group baseline (Williams 1992, "Simple statistical gradient-following
  algorithms for connectionist reinforcement learning"), in the form of nanochat's chat_rl
  (Karpathy 2025, github.com/karpathy/nanochat): objective logp * (r - mean r) per token, summed
  over every counted token of the batch and divided by their number; no ratio, no clipping, no KL.
- Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", fengyao.notion.site/off-policy-rl): the inference engine's sampler and
  the trainer disagree on the log-probabilities of the same weights (different kernels, precisions,
  batch shapes), so the rollout came from pi_rollout, not pi_old; each token's objective is
  multiplied by the detached weight min(pi_old / pi_rollout, C).

`policy_loss` returns the loss to minimize, -objective, where per counted token

    objective_t = w_t * (surrogate_t - beta * k3_t),   w_t = min(exp(old_logp - rollout_logp), C)

(w_t = 1 without TIS; surrogate_t = logp_t * A for "reinforce"), reduced over tokens by
`LossConfig.length_norm`. Note: the TIS weight multiplies the KL term too, as the k3 term is also
an estimate over tokens sampled by the engine (verl applies it to the policy-gradient term alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

KINDS = ("grpo", "dr_grpo", "reinforce")
LENGTH_NORMS = ("sequence", "constant", "token")
_SHOWN = 5  # how many bad positions an error message lists


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positions(bad: torch.Tensor) -> str:
    """The first few indices where `bad` (a bool tensor) is true, for an error message."""
    where = [tuple(int(i) for i in row) for row in torch.nonzero(bad)[:_SHOWN]]
    more = int(bad.sum()) - len(where)
    return ", ".join(map(str, where)) + (f" and {more} more" if more > 0 else "")


# ---- advantages and the KL estimator -------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """rewards (P, G) -> advantages (P, G): r - mean over each prompt's G samples, divided by
    (std + eps) when `scale` (GRPO) and left in reward units when not (Dr. GRPO, REINFORCE with a
    group baseline). std is the sample std (ddof=1, as TRL's GRPOTrainer); a group of equal
    rewards gives zeros. Flatten with `.reshape(-1)` for the (B,) per-sequence advantages (row
    p * G + i). Returns a new tensor; `rewards` is not modified. Non-float rewards (ints, bools)
    become torch's default float dtype."""
    rewards = torch.as_tensor(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be (P prompts, G samples); got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group size G={rewards.shape[1]}: a group baseline needs G >= 2 samples per prompt")
    if not isinstance(scale, bool):
        raise ValueError(f"scale must be True or False; got {scale!r}")
    if not _is_number(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0; got {eps!r}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = ~torch.isfinite(rewards)
    if bad.any():
        raise ValueError(f"rewards must be finite; NaN or inf at (prompt, sample) {_positions(bad)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (P, G), reward units
    if not scale:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)  # (P, G), in group stds


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref), per token (nats), for tokens sampled from pi:
    exp(d) - d - 1 with d = ref_logp - logp. Each term is >= 0 and 0 where the two agree; its mean
    over samples from pi is unbiased for the KL. expm1 keeps small d exact (no 1 + tiny - 1)."""
    d = ref_logp - logp
    return torch.expm1(d) - d


# ---- the configuration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LossConfig:
    """Which loss, and each of its switches. `kind` picks the per-token surrogate: the clipped
    ratio (PPO's) for "grpo" and "dr_grpo", logp * A for "reinforce". "dr_grpo" insists on its
    two fixes (scale_advantages=False, length_norm="constant"); "reinforce" has no ratio to clip
    (clip_eps=None). Start from a preset and override: `LossConfig.grpo(kl_weight=0)`."""
    kind: str = "grpo"
    scale_advantages: bool = True  # divide r - mean by the group's std (GRPO), or not (Dr. GRPO)
    clip_eps: float | None = 0.2  # ratio clipped to [1 - eps, 1 + eps]; None: no clipping
    kl_weight: float = 0.04  # beta on the k3 KL to the reference (DeepSeekMath); 0: off
    length_norm: str = "sequence"  # "sequence" (1/|o_i|), "constant" (1/max_tokens) or "token"
    max_tokens: int | None = None  # the constant of "constant": the generation budget, in tokens
    truncate_c: float | None = None  # C of truncated importance sampling; None: off

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if not isinstance(self.scale_advantages, bool):
            raise ValueError(f"scale_advantages must be True or False; got {self.scale_advantages!r}")
        if self.clip_eps is not None and not (_is_number(self.clip_eps) and 0 < self.clip_eps < 1):
            raise ValueError(f"clip_eps must be None (no clipping) or a number in (0, 1); got {self.clip_eps!r}")
        if not (_is_number(self.kl_weight) and self.kl_weight >= 0):
            raise ValueError(f"kl_weight must be a finite number >= 0 (0: no KL term); got {self.kl_weight!r}")
        if self.length_norm not in LENGTH_NORMS:
            raise ValueError(f"length_norm must be one of {LENGTH_NORMS}; got {self.length_norm!r}")
        if self.length_norm == "constant":
            if not (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                    and self.max_tokens > 0):
                raise ValueError(f"length_norm='constant' needs max_tokens, an int > 0 (the generation budget); "
                                 f"got {self.max_tokens!r}")
        elif self.max_tokens is not None:
            raise ValueError(f"max_tokens={self.max_tokens!r} is used only by length_norm='constant', "
                             f"not {self.length_norm!r}; leave it None")
        if self.truncate_c is not None and not (_is_number(self.truncate_c) and self.truncate_c > 0):
            raise ValueError(f"truncate_c must be None (no TIS) or a finite number > 0; got {self.truncate_c!r}")
        if self.kind == "dr_grpo" and (self.scale_advantages or self.length_norm != "constant"):
            raise ValueError(f"kind='dr_grpo' means scale_advantages=False and length_norm='constant'; got "
                             f"scale_advantages={self.scale_advantages!r}, length_norm={self.length_norm!r} "
                             f"(use LossConfig.dr_grpo(max_tokens), or kind='grpo' for other mixes)")
        if self.kind == "reinforce" and self.clip_eps is not None:
            raise ValueError(f"kind='reinforce' has no ratio to clip: clip_eps must be None; got {self.clip_eps!r} "
                             f"(use LossConfig.reinforce())")

    @classmethod
    def grpo(cls, **overrides) -> LossConfig:
        """DeepSeekMath's GRPO: std-scaled advantages, clip 0.2, beta 0.04, 1/|o_i| per sequence."""
        return cls(**{"kind": "grpo", "scale_advantages": True, "clip_eps": 0.2, "kl_weight": 0.04,
                      "length_norm": "sequence", **overrides})

    @classmethod
    def dr_grpo(cls, max_tokens: int, **overrides) -> LossConfig:
        """Dr. GRPO: no std, each sequence's token sum divided by the constant max_tokens (the
        generation budget), clip 0.2, no KL by default (the paper drops it for rule-based rewards)."""
        return cls(**{"kind": "dr_grpo", "scale_advantages": False, "clip_eps": 0.2, "kl_weight": 0.0,
                      "length_norm": "constant", "max_tokens": max_tokens, **overrides})

    @classmethod
    def reinforce(cls, **overrides) -> LossConfig:
        """nanochat's chat_rl: logp * (r - group mean) per token, mean over the batch's tokens,
        no ratio, no clipping, no KL."""
        return cls(**{"kind": "reinforce", "scale_advantages": False, "clip_eps": None, "kl_weight": 0.0,
                      "length_norm": "token", **overrides})

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """rewards (P, G) -> per-sequence advantages (B,) = (P * G,), with this config's scaling."""
        return group_advantages(rewards, scale=self.scale_advantages).reshape(-1)


# ---- the loss ------------------------------------------------------------------------------------

def _checked_mask(mask, shape) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor; got {type(mask).__name__}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, logp has {shape}")
    if mask.dtype != torch.bool:
        off = (mask != 0) & (mask != 1)
        if off.any():
            raise ValueError(f"mask must hold only 0 and 1; other values at (sequence, token) {_positions(off)}")
        mask = mask != 0
    if not mask.any():
        raise ValueError("mask counts no token (all zeros): nothing to train on")
    return mask


def _checked_logp(name: str, value, shape, counted: torch.Tensor, constant: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, logp has {shape} (B sequences, T tokens)")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a float tensor; got {value.dtype}")
    if constant and value.requires_grad:
        raise ValueError(f"{name} requires grad; it is a constant of the loss: pass {name}.detach()")
    bad = counted & ~torch.isfinite(value.detach())
    if bad.any():
        raise ValueError(f"{name} is NaN or inf at counted (sequence, token) {_positions(bad)}")
    return value


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                config: LossConfig, ref_logp: torch.Tensor | None = None,
                rollout_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimize (a scalar tensor, -objective) and its statistics (floats).

    logp (B, T): log pi_theta of each chosen token, current weights (with grad); old_logp (B, T):
    the same under the rollout's weights as the trainer computes them (no grad); advantages (B,):
    one per sequence (`LossConfig.advantages`); mask (B, T) bool or 0/1: the counted completion
    tokens; ref_logp (B, T): the frozen reference, needed when config.kl_weight > 0; rollout_logp
    (B, T): the inference engine's log-probs, needed when config.truncate_c is set. Values at
    padding (mask 0) are ignored, whatever they are, and get zero gradient. An empty completion
    (a row of zeros in the mask) counts as one sequence with objective 0 under "sequence" and
    "constant" norms (as TRL's clamp(min=1) of the length does).

    Stats: ratio_mean (mean pi_theta / pi_old over counted tokens), clip_fraction (share of counted
    tokens whose value the clip changed; 0 without clipping), kl_mean (mean k3 to the reference,
    NaN without ref_logp), tis_truncated_fraction (share of counted tokens whose weight hit C; 0
    without TIS) and tokens (the number of counted tokens)."""
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig; got {type(config).__name__}")
    if not isinstance(logp, torch.Tensor) or logp.ndim != 2:
        raise ValueError(f"logp must be a (B, T) tensor; got {getattr(logp, 'shape', type(logp).__name__)}")
    shape = tuple(logp.shape)
    counted = _checked_mask(mask, shape)  # (B, T) bool
    _checked_logp("logp", logp, shape, counted, constant=False)
    _checked_logp("old_logp", old_logp, shape, counted, constant=True)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages must be a ({shape[0]},) tensor, one per sequence; "
                         f"got {getattr(advantages, 'shape', type(advantages).__name__)}")
    if advantages.requires_grad:
        raise ValueError("advantages requires grad; it is a constant of the loss: pass advantages.detach()")
    bad = ~torch.isfinite(advantages)
    if bad.any():
        raise ValueError(f"advantages are NaN or inf at sequence(s) {_positions(bad)}")
    if config.kl_weight > 0 and ref_logp is None:
        raise ValueError(f"kl_weight={config.kl_weight} needs ref_logp (the reference model's log-probs); "
                         f"got None (set kl_weight=0 for no KL term)")
    if ref_logp is not None:
        _checked_logp("ref_logp", ref_logp, shape, counted, constant=True)
    if config.truncate_c is not None:
        if rollout_logp is None:
            raise ValueError(f"truncate_c={config.truncate_c} needs rollout_logp (the inference engine's "
                             f"log-probs); got None")
        _checked_logp("rollout_logp", rollout_logp, shape, counted, constant=True)

    # Padding takes value 0 in every input before any arithmetic, so whatever it held (-inf, NaN)
    # gives ratio 1, k3 0 and a zero gradient; torch.where passes no gradient to the padding.
    def counted_only(x):
        return torch.where(counted, x, x.new_zeros(()))

    logp_c = counted_only(logp)  # (B, T), nats
    old_c = counted_only(old_logp)
    adv = advantages.to(logp.dtype)[:, None]  # (B, 1): the same A for every token of a sequence

    ratio = torch.exp(logp_c - old_c)  # (B, T): pi_theta / pi_old per token
    clipped_tokens = torch.zeros(shape, dtype=torch.bool, device=logp.device)
    if config.kind == "reinforce":
        surrogate = logp_c * adv  # (B, T): the score-function form, gradient A * grad logp
    elif config.clip_eps is None:
        surrogate = ratio * adv
    else:
        eps = config.clip_eps
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
        with torch.no_grad():  # where the min picked the clipped value: A > 0 above 1 + eps, A < 0 below 1 - eps
            clipped_tokens = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))

    per_token = surrogate  # (B, T): the objective per token
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp_c, counted_only(ref_logp))  # (B, T), nats, >= 0
        if config.kl_weight > 0:
            per_token = per_token - config.kl_weight * kl

    truncated_tokens = torch.zeros(shape, dtype=torch.bool, device=logp.device)
    if config.truncate_c is not None:
        with torch.no_grad():  # the weight is a constant of the loss: no gradient flows through it
            raw_weight = torch.exp(old_c - counted_only(rollout_logp)).to(logp.dtype)  # (B, T): pi_old / pi_rollout
            truncated_tokens = raw_weight >= config.truncate_c
            weight = torch.clamp(raw_weight, max=config.truncate_c)
        per_token = per_token * weight

    per_token = counted_only(per_token)
    n_tokens = int(counted.sum())
    n_seqs = shape[0]
    if config.length_norm == "sequence":
        lengths = counted.sum(dim=1).clamp(min=1).to(logp.dtype)  # (B,), tokens; an empty one counts 1
        objective = (per_token.sum(dim=1) / lengths).mean()
    elif config.length_norm == "constant":
        longest = int(counted.sum(dim=1).max())
        if longest > config.max_tokens:
            raise ValueError(f"a completion counts {longest} tokens, more than max_tokens={config.max_tokens} "
                             f"(the generation budget length_norm='constant' divides by)")
        objective = per_token.sum() / (n_seqs * config.max_tokens)  # = mean over sequences of sum / max_tokens
    else:  # "token"
        objective = per_token.sum() / n_tokens

    with torch.no_grad():
        stats = {
            "ratio_mean": float(ratio[counted].mean()),
            "clip_fraction": float(clipped_tokens[counted].float().mean()),
            "kl_mean": float(kl[counted].mean()) if kl is not None else float("nan"),
            "tis_truncated_fraction": float(truncated_tokens[counted].float().mean()),
            "tokens": float(n_tokens),
        }
    return -objective, stats


# ---- the length bias, in numbers -----------------------------------------------------------------

class TokenWeights(NamedTuple):
    per_token: torch.Tensor  # (B,): d objective / d logp of each counted token of sequence i
    per_sequence: torch.Tensor  # (B,): per_token * L_i, the sequence's total push


def token_weights(lengths, advantages, length_norm: str, max_tokens: int | None = None) -> TokenWeights:
    """The gradient weight each length normalization puts on a sequence's tokens, on-policy (ratio
    1, so no clipping) and without KL: d objective / d logp_t for every token t of sequence i, a
    batch of sequences with lengths L_i (tokens) and advantages A_i:

        "sequence" A_i / (L_i B)     "constant" A_i / (max_tokens B)     "token" A_i / sum_j L_j

    Under "sequence" a short correct answer (A > 0, small L) gets a bigger push per token and a
    long wrong one (A < 0, large L) a smaller penalty per token: the length bias Dr. GRPO removes;
    "constant" weighs every token of every sequence alike. Equals the gradient of policy_loss's
    objective (-loss) for the same batch. Returns float64 tensors."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    advantages = torch.as_tensor(advantages, dtype=torch.float64)
    if lengths.ndim != 1 or advantages.shape != lengths.shape:
        raise ValueError(f"lengths and advantages must be (B,) alike; got {tuple(lengths.shape)} and "
                         f"{tuple(advantages.shape)}")
    if len(lengths) == 0 or (lengths < 1).any() or (lengths != lengths.round()).any():
        raise ValueError(f"lengths must be whole numbers >= 1, at least one; got {lengths.tolist()}")
    n_seqs = len(lengths)
    if length_norm == "sequence":
        per_token = advantages / (lengths * n_seqs)
    elif length_norm == "constant":
        if not (isinstance(max_tokens, int) and max_tokens >= lengths.max()):
            raise ValueError(f"length_norm='constant' needs max_tokens, an int >= the longest length "
                             f"{int(lengths.max())}; got {max_tokens!r}")
        per_token = advantages / (max_tokens * n_seqs)
    elif length_norm == "token":
        per_token = advantages / lengths.sum()
    else:
        raise ValueError(f"length_norm must be one of {LENGTH_NORMS}; got {length_norm!r}")
    return TokenWeights(per_token, per_token * lengths)
