"""Checks for chapter 11's exercises: GRPO's group advantages, its clipped loss with the KL
penalty, a bucketed weight sync, truncated importance weights, and last the reader's loss and
sync inside the real loop, training the warm-started model on reversed addition.

The references call the package: `rl.losses.group_advantages`, `rl.losses.policy_loss` with
`LossConfig.grpo` (the per-token factor of exercise 2 given to it as truncated importance
weights, and exercise 4's weights read back from its gradient), `rl.sync.plan`, `pack` and
`unpack`. The last check runs GRPO's loop from the package's public pieces (the engine's
rollouts, the verifier, `trainer.lay_out` and `token_logprobs`, `loop.serving_model`) with the
reader's `rl_loss` computing the loss of every step and the reader's `BucketSync` (defined beside
it) carrying the trainer's weights to the engine; each step's loss and gradient are compared with
the package's on the same batch, and the trained model must beat the warm start's pass@1 on
held-out problems by MARGIN. The run is made once per process for a given function and kept.
Modules that need torch are imported when a check runs, so the grader imports without torch.
"""
from __future__ import annotations

import numpy as np

from infra_lab.grading.ch07 import Schedule
from infra_lab.grading.checks import Check, register

CLIP_EPS, KL_WEIGHT, TIS_C = 0.2, 0.04, 2.0  # the last exercise's loss: DeepSeekMath's GRPO, and Yao et al.'s C
EPS = 1e-4  # added to a group's std (the package's, and TRL's)
# the last check's run: 10 GRPO steps of 16 problems x 8 samples from the warm start, the engine
# serving fp16 weights (so its log-probabilities differ from the trainer's and the importance
# weights are not all 1), pass@1 on 200 held-out problems before and after. The package's loss
# gains 0.11 here (0.465 -> 0.575 on the numba and the torch backends, and computed in float64;
# seeds 0 and 2 of the same run gain 0.05 and 0.11)
TRAIN = {"steps": 10, "prompts": 16, "group": 8, "lr": 1e-4, "seed": 1, "eval_problems": 200}
MARGIN = 0.03  # pass@1 must rise by this much: 6 of the 200 problems
# a step's loss and gradient against the package's on the same float32 batch (sums in another order)
STEP_RTOL, STEP_ATOL = 1e-4, 1e-6
SHARE_ATOL = 1e-6  # the package counts the share in float32


class WrongAdvantages(AssertionError):
    """Advantages that differ from GRPO's group normalization."""


class WrongLoss(AssertionError):
    """A loss, or its gradient, that differs from the package's."""


class WrongBuckets(AssertionError):
    """Buckets that differ from the package's layout, or weights that do not come back whole."""


class WrongWeights(AssertionError):
    """Importance weights that differ from min(pi_old / pi_rollout, C)."""


class NotLearning(AssertionError):
    """A run whose pass@1 did not rise by MARGIN."""


def _numpy(value, what: str) -> np.ndarray:
    """`value` (a tensor or an array) as float64 numpy; TypeError saying what came instead."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a tensor or an array of numbers; got {type(value).__name__}") from None


def _where(gap: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(np.nan_to_num(gap, nan=np.inf))), gap.shape))


# ---- exercise 1: group advantages -----------------------------------------------------------------

def group_advantages(rewards, scale):
    """Reference: (P, G) advantages, r - the group's mean, over (sample std + 1e-4) when `scale`."""
    from infra_lab.rl import losses

    return losses.group_advantages(rewards, scale=scale)


def _advantage_hint(rewards: np.ndarray, scale: bool, got: np.ndarray) -> str:
    """The likely cause, from the variants a reader may have written."""
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    variants = {"population": centered / (rewards.std(axis=1, ddof=0, keepdims=True) + EPS),
                "variance": centered / np.sqrt(rewards.var(axis=1, ddof=1, keepdims=True) + EPS),
                "scaled": centered / (rewards.std(axis=1, ddof=1, keepdims=True) + EPS),
                "whole table": (rewards - rewards.mean()) / ((rewards.std(ddof=1) + EPS) if scale else 1.0)}
    with np.errstate(divide="ignore", invalid="ignore"):
        variants["no eps"] = centered / rewards.std(axis=1, ddof=1, keepdims=True)

    def same(name):
        return np.allclose(got, variants[name], rtol=1e-6, atol=1e-9, equal_nan=True)

    if not scale and same("scaled"):
        return "scale=False (Dr. GRPO) leaves r - mean in reward units: no division by the std"
    if scale and np.allclose(got, centered, rtol=1e-6, atol=1e-9):
        return "scale=True (GRPO) divides r - mean by the group's std + 1e-4"
    if same("no eps"):
        return "a group of equal rewards has std 0: add 1e-4 to the std so that its advantages are 0, not NaN"
    if same("population"):
        return "use the sample std, which divides by G - 1 (numpy: ddof=1; torch's default), not by G"
    if same("variance"):
        return "add 1e-4 to the std itself, not to the variance under the square root"
    if same("whole table"):
        return "the mean and the std are each prompt's: over one row's G samples, not the whole table"
    return "per row p: A = (r - mean(r_p)) / (std(r_p) + 1e-4) with the sample std, or r - mean(r_p) unscaled"


def drive_advantages(function, rewards, scale):
    import torch

    answer = function(torch.from_numpy(rewards.copy()), scale)
    expected = _numpy(group_advantages(torch.from_numpy(rewards), scale), "the reference")
    got = _numpy(answer, "group_advantages' result")
    if got.shape != expected.shape:
        raise WrongAdvantages(f"advantages of shape {got.shape}, expected {expected.shape}: one per (prompt, "
                              "sample), like the rewards")
    if not np.allclose(got, expected, rtol=1e-6, atol=1e-9):
        p, g = _where(np.abs(got - expected))
        raise WrongAdvantages(f"advantage ({p}, {g}) is {got[p, g]:.6g}, expected {expected[p, g]:.6g} (rewards of "
                              f"prompt {p}: {rewards[p].tolist()}); {_advantage_hint(rewards, scale, got)}")
    return expected


def _advantages_case(kind, rng):
    what, scaled = kind.split(", ")
    prompts, group = int(rng.integers(1, 7)), 2 if what == "two samples" else int(rng.integers(2, 9))
    if what == "continuous":
        rewards = np.round(rng.normal(0.0, 2.0, (prompts, group)), 3)
    elif what == "partial credit":
        rewards = rng.choice([0.0, 0.5, 1.0], (prompts, group))
    elif what == "all equal":
        rewards = np.repeat(rng.choice([0.0, 1.0, 0.5], (prompts, 1)), group, axis=1)
    else:  # binary: a verifier's 0 or 1
        rewards = rng.integers(0, 2, (prompts, group)).astype(np.float64)
        if what == "binary with equal groups":
            rewards[rng.random(prompts) < 0.5] = float(rng.integers(0, 2))
    return rewards, scaled == "scaled"


_ADVANTAGE_KINDS = [f"{what}, {scaled}" for what in ("binary", "binary with equal groups", "continuous",
                                                     "all equal", "two samples", "partial credit")
                    for scaled in ("scaled", "unscaled")] * 2


# ---- exercise 2: GRPO's clipped loss with the KL penalty --------------------------------------------

def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights=None):
    """Reference: `policy_loss` under `LossConfig.grpo(clip_eps, beta)`."""
    return _grpo(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights)


def _grpo(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights, length_norm: str = "sequence"):
    """The package's GRPO loss. A per-token factor `weights` goes in as truncated importance
    sampling's: rollout log-probs old_logp - log(w), with C above every weight, so that
    min(pi_old / pi_rollout, C) is w."""
    import torch

    from infra_lab.rl.losses import LossConfig, policy_loss

    rollout_logp, c = None, None
    if weights is not None:
        counted = torch.where(mask.bool(), weights, torch.ones_like(weights))
        rollout_logp, c = old_logp - torch.log(counted), 2.0 * float(counted.max())
    config = LossConfig.grpo(clip_eps=clip_eps, kl_weight=beta, truncate_c=c, length_norm=length_norm)
    return policy_loss(logp, old_logp, advantages, mask, config, ref_logp=ref_logp, rollout_logp=rollout_logp)[0]


def _loss_and_gradient(function, case) -> tuple[float, np.ndarray]:
    """The loss `function` returns on a float64 case, and its gradient with respect to logp."""
    import torch

    logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights = case
    mine = torch.from_numpy(logp.copy()).requires_grad_()
    loss = function(mine, torch.from_numpy(old_logp.copy()), torch.from_numpy(ref_logp.copy()),
                    torch.from_numpy(advantages.copy()), torch.from_numpy(mask.copy()), clip_eps, beta,
                    None if weights is None else torch.from_numpy(weights.copy()))
    return _backward(loss, mine, "grpo_loss")


def _backward(loss, logp, what: str) -> tuple[float, np.ndarray]:
    import torch

    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WrongLoss(f"{what} must return the loss as a one-element tensor (a scalar); got {got}")
    if not loss.requires_grad:
        raise WrongLoss(f"{what}'s loss does not depend on logp through autograd (a .item(), a numpy step or a "
                        "detach on the way?): backward() must reach logp")
    loss.reshape(()).backward()
    gradient = logp.grad if logp.grad is not None else torch.zeros_like(logp)
    return float(loss.detach()), gradient.detach().double().numpy()


_LOSS_ARGS = ("logp", "old_logp", "ref_logp", "advantages", "mask", "clip_eps", "beta", "weights")


def _package_loss(case, length_norm: str = "sequence", **change) -> float:
    """The package's loss on `case` with some of its arguments changed, and another length norm."""
    import torch

    args = dict(zip(_LOSS_ARGS, case)) | change
    tensors = [torch.from_numpy(args[name].copy()) for name in _LOSS_ARGS[:5]]
    weights = None if args["weights"] is None else torch.from_numpy(args["weights"].copy())
    return float(_grpo(*tensors, args["clip_eps"], args["beta"], weights, length_norm))


def _loss_hint(case, got: float) -> str:
    """The likely cause, from variants of the package's loss."""
    expected, weighted = _package_loss(case), case[-1] is not None
    hints = [(-expected, "the loss is minus the objective: minimize -(surrogate - beta * KL)"),
             (2 * _package_loss(case, beta=0.0) - expected,
              "the KL term is subtracted from the objective (added to the loss)"),
             (_package_loss(case, clip_eps=None),
              "clip the ratio to [1 - eps, 1 + eps] and take the smaller of the two terms"),
             (_package_loss(case, length_norm="token"),
              "normalize per sequence: each sequence's token sum over its own length |o_i|, then the mean over "
              "the B sequences (not one mean over every token)"),
             (_package_loss(case, mask=np.ones_like(case[4])),
              "the padding counted: leave the positions where mask is false out of the sums and of |o_i|")]
    if weighted:
        hints += [(_package_loss(case, weights=None), "multiply each token's objective by weights[i, t]"),
                  (_package_loss(case, beta=0.0) + _package_loss(case, weights=None)
                   - _package_loss(case, weights=None, beta=0.0),
                   "the weight multiplies the whole per-token term, the KL's included")]
    for other, hint in hints:
        if abs(other - expected) > 1e-9 and abs(got - other) <= 1e-8 + 1e-6 * abs(other):
            return hint
    return ("per token: min(rho A, clip(rho, 1 - eps, 1 + eps) A) - beta * (exp(d) - d - 1) with rho = "
            "exp(logp - old_logp) and d = ref_logp - logp, counted tokens only")


def drive_loss(function, *case):
    got, gradient = _loss_and_gradient(function, case)
    expected, expected_gradient = _loss_and_gradient(grpo_loss, case)
    if not abs(got - expected) <= 1e-9 + 1e-6 * abs(expected):
        raise WrongLoss(f"the loss is {got:.8g}, expected {expected:.8g}; {_loss_hint(case, got)}")
    if not np.allclose(gradient, expected_gradient, rtol=1e-6, atol=1e-10):
        i, t = _where(np.abs(gradient - expected_gradient))
        padding = "" if case[4][i, t] else ": a padding position, whose values must not count"
        raise WrongLoss(f"the loss is right but its gradient at (sequence {i}, token {t}) is "
                        f"{gradient[i, t]:.6g}, expected {expected_gradient[i, t]:.6g}{padding}; compute every "
                        "term from logp with torch operations (old_logp, ref_logp and the weights are constants)")
    return ("loss", expected), ("gradient", expected_gradient)


def _mask(rng, sequences: int, tokens: int) -> np.ndarray:
    """(B, T) bool: each sequence counts its first 1 to T tokens; the longest fills the width."""
    lengths = rng.integers(1, tokens + 1, sequences)
    lengths[int(rng.integers(0, sequences))] = tokens
    return np.arange(tokens)[None, :] < lengths[:, None]


def _log_probs(rng, shape, off_policy: float, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logp, old_logp, ref_logp) in nats, with finite nonsense at the padding."""
    old_logp = -rng.exponential(1.5, shape)
    logp = old_logp + rng.normal(0.0, off_policy, shape)
    ref_logp = old_logp + rng.normal(0.0, 0.3, shape)
    for array in (logp, old_logp, ref_logp):
        array[~mask] = rng.uniform(-20.0, 0.0, int((~mask).sum()))
    return logp, old_logp, ref_logp


def _loss_case(kind, rng):
    sequences, tokens = int(rng.integers(1, 9)), int(rng.integers(1, 8))
    mask = _mask(rng, sequences, tokens)
    off_policy = {"on-policy": 0.0, "near": 0.05, "off-policy": 0.4}[kind.split(", ")[0]]
    logp, old_logp, ref_logp = _log_probs(rng, (sequences, tokens), off_policy, mask)
    advantages = np.round(rng.normal(0.0, 1.0, sequences), 3)
    advantages[rng.random(sequences) < 0.2] = 0.0
    clip_eps = float(rng.choice([0.1, 0.2, 0.28]))
    beta = 0.0 if kind.endswith("no KL") else float(rng.choice([0.04, 0.1]))
    weights = rng.uniform(0.3, 2.0, (sequences, tokens)) if kind.endswith("weighted") else None
    return logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights


_LOSS_KINDS = ["off-policy", "on-policy", "off-policy, weighted", "near", "off-policy, no KL", "near, weighted",
               "on-policy, weighted", "off-policy"] * 3


# ---- exercise 3: a bucketed weight sync ------------------------------------------------------------

class Shapes(dict):
    """name -> shape, in the model's order: what a BucketSync is made from. `config`, which a
    reader need not use, is the model's, for the package's layout (`sync.plan`)."""

    config = None


class BucketSync:
    """Reference, through the package: `sync.plan`'s layout, buckets allocated once, `sync.pack`
    and `sync.unpack`."""

    def __init__(self, shapes: Shapes, bucket_bytes: int):
        from infra_lab.rl import sync

        self.layout = sync.plan(shapes.config, bucket_bytes)
        self.buckets = [np.empty(size, np.float32) for size in self.layout.sizes]

    def pack(self, weights: dict) -> list:
        from infra_lab.rl import sync

        sync.pack(self.layout, weights, self.buckets)
        return self.buckets

    def unpack(self, buckets: list) -> dict:
        from infra_lab.rl import sync

        return sync.unpack(self.layout, buckets)


def shapes_of(config) -> Shapes:
    from infra_lab.model.config import weight_shapes

    shapes = Shapes(weight_shapes(config))
    shapes.config = config
    return shapes


def _buckets(answer, what: str) -> list[np.ndarray]:
    if not isinstance(answer, (list, tuple)) or not all(isinstance(b, np.ndarray) for b in answer):
        raise WrongBuckets(f"{what} must return a list of numpy arrays (the buckets); got {type(answer).__name__}"
                           + (f" of {sorted({type(b).__name__ for b in answer})}" if isinstance(answer, (list, tuple))
                              else ""))
    bad = [i for i, b in enumerate(answer) if b.ndim != 1 or b.dtype != np.float32]
    if bad:
        b = answer[bad[0]]
        raise WrongBuckets(f"bucket {bad[0]} is {b.dtype}, shape {b.shape}: a bucket is one flat float32 array")
    return list(answer)


def _compare_buckets(got: list[np.ndarray], layout, weights: dict, bucket_bytes: int) -> None:
    from infra_lab.rl import sync

    expected = [np.empty(size, np.float32) for size in layout.sizes]
    sync.pack(layout, weights, expected)
    sizes = [b.size for b in got]
    if sizes != layout.sizes:
        limit = bucket_bytes // 4
        over = next((i for i, size in enumerate(sizes) if size > limit and size not in layout.sizes), None)
        if over is not None:
            hint = (f"bucket {over} holds {sizes[over]} floats, more than bucket_bytes // 4 = {limit}: a weight that "
                    "does not fit in the current bucket starts a new one")
        else:
            hint = ("take the weights in the order of `shapes`; each joins the current bucket while it fits (at most "
                    f"bucket_bytes // 4 = {limit} floats in all), else starts a new one; a weight larger than a "
                    "whole bucket gets one of its own, exactly its size")
        shown, wanted = (f"{x[:8]}{' ...' if len(x) > 8 else ''}" for x in (sizes, layout.sizes))
        raise WrongBuckets(f"{len(sizes)} buckets of {shown} floats, expected {len(layout.sizes)} of {wanted}; {hint}")
    for slot in layout.slots:
        if not np.array_equal(got[slot.bucket][slot.offset:slot.offset + slot.size], weights[slot.name].reshape(-1)):
            raise WrongBuckets(f"{slot.name} {slot.shape} belongs at bucket {slot.bucket}, floats {slot.offset} to "
                               f"{slot.offset + slot.size}, flattened in C order; the buckets hold something else "
                               "there")


def _compare_state(state, weights: dict, what: str) -> None:
    if not isinstance(state, dict) or set(state) != set(weights):
        names = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise WrongBuckets(f"unpack must return a dict with every weight's name; got {str(names)[:200]}")
    for name, value in weights.items():
        got = state[name]
        if not isinstance(got, np.ndarray) or got.shape != value.shape or got.dtype != np.float32:
            described = f"{got.dtype} {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
            raise WrongBuckets(f"unpack gave {name} as {described}, expected float32 {value.shape}")
        if not np.array_equal(got, value):
            raise WrongBuckets(f"{what}: {name} is not the weight that was packed")


def _draw_weights(shapes: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def drive_buckets(cls, config_args, bucket_bytes: int, seed: int):
    """Pack one set of weights, unpack them, pack a second set into the same buckets: the first
    set's unpacked copy must be untouched, the second must come back. An "engine" case packs the
    warm start's weights after a GRPO step and serves them from a live engine. `config_args`:
    "target", or a model's (n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab, n_experts)."""
    from infra_lab.model.config import CONFIGS, ModelConfig
    from infra_lab.rl import sync

    config = CONFIGS[config_args] if isinstance(config_args, str) else \
        ModelConfig("case", *config_args[:5], vocab=config_args[5], n_experts=config_args[6])
    shapes = shapes_of(config)
    layout = sync.plan(config, bucket_bytes)
    first = _stepped_weights() if isinstance(config_args, str) else _draw_weights(shapes, seed)
    second = _draw_weights(shapes, seed + 1)
    channel = cls(shapes, bucket_bytes)
    buckets = _buckets(channel.pack({k: v.copy() for k, v in first.items()}), "pack")
    _compare_buckets(buckets, layout, first, bucket_bytes)
    state = channel.unpack(buckets)
    _compare_state(state, first, "the round trip")
    if isinstance(config_args, str) and cls is not BucketSync:  # the package's own: tests serve it (a subclass)
        _serve(state, first)
    again = _buckets(channel.pack({k: v.copy() for k, v in second.items()}), "pack")
    if len(again) != len(buckets) or any(a is not b for a, b in zip(again, buckets)):
        raise WrongBuckets("the second pack returned new arrays: allocate the buckets once (in __init__) and "
                           "write every version into the same ones")
    _compare_buckets(again, layout, second, bucket_bytes)
    _compare_state(state, first, "after the next pack, the weights unpacked before changed (unpack must copy out "
                                 "of the buckets: the engine keeps what it is given, and the buckets are reused)")
    _compare_state(channel.unpack(again), second, "the second round trip")
    return ("buckets", layout.sizes), ("round trips", "exact"), ("unpacked", "copies")


def _stepped_weights() -> dict:
    """The warm start's weights after one GRPO step of the package's trainer (made once)."""
    return dict(_stepped())


_STEPPED: list = []


def _stepped() -> dict:
    if not _STEPPED:
        from infra_lab.rl import rollout as rollouts, task, warm_start
        from infra_lab.rl.layouts import step_problems
        from infra_lab.rl.loop import RunConfig, rollout_engine
        from infra_lab.rl.trainer import Trainer

        warm = warm_start.load_warm()
        config = RunConfig(prompts=8, group=4, lr=1e-3)
        problems = step_problems(task.split()[0], config, 0)
        batch = rollouts.rollout(rollout_engine(warm, config, len(problems[0].prompt)), problems, config.group,
                                 task.max_answer_tokens(), seed=0)
        trainer = Trainer(warm, config.loss_config(), lr=config.lr)
        trainer.step(batch, task.score(task.verify, batch.sample_problems, batch.texts).values)
        _STEPPED.append({name: np.ascontiguousarray(value, np.float32) for name, value in trainer.state().items()})
    return _STEPPED[0]


def _serve(state: dict, weights: dict) -> None:
    """A live engine on the warm start takes `state` as version 1; its greedy answers must be a
    fresh engine's on `weights`."""
    from infra_lab.model.transformer import Transformer
    from infra_lab.rl import evaluate, task, warm_start
    from infra_lab.serving.engine import Engine

    warm = warm_start.load_warm()
    problems = task.split()[1][:16]
    engine = Engine(warm)
    evaluate.answers(engine, problems)  # it serves the warm start first
    engine.update_weights(state, 1)
    served = evaluate.answers(engine, problems)
    fresh = evaluate.answers(Engine(Transformer(warm.config, {k: v.copy() for k, v in weights.items()})), problems)
    if served != fresh:
        first = next(i for i, (a, b) in enumerate(zip(served, fresh)) if a != b)
        raise WrongBuckets(f"after your sync the engine answers {problems[first].prompt!r} with {served[first]!r}; "
                           f"a fresh engine on the trainer's weights answers {fresh[first]!r}")


def _buckets_case(kind, rng):
    if kind.startswith("engine"):
        return "target", int(rng.choice([1 << 16, 1 << 20])), int(rng.integers(0, 2**31))
    d_model, heads = int(rng.choice([8, 16, 32])), int(rng.choice([1, 2, 4]))
    kv_heads = int(rng.choice([h for h in (1, 2, 4) if heads % h == 0]))
    n_layers, d_ff, vocab = int(rng.integers(1, 4)), int(rng.choice([16, 32, 64])), int(rng.choice([16, 64, 256]))
    experts = int(rng.choice([2, 4])) if kind == "experts" else 1
    largest = max(vocab * d_model, d_ff * d_model * experts)
    if kind == "small":  # below the smallest weight: every weight in a bucket of its own
        bucket_bytes = int(rng.integers(4, 4 * d_model))
    elif kind == "one bucket":  # a model of 3 layers has fewer than 50 weights
        bucket_bytes = 4 * largest * 50 + int(rng.integers(0, 4))
    else:
        bucket_bytes = int(rng.integers(4 * d_model, 8 * largest))
    return (n_layers, d_model, heads, kv_heads, d_ff, vocab, experts), bucket_bytes, int(rng.integers(0, 2**31))


_BUCKET_KINDS = ["mixed", "mixed", "small", "mixed", "one bucket", "experts", "mixed", "engine"] * 3


# ---- exercise 4: truncated importance weights --------------------------------------------------------

def tis_weights(old_logp, rollout_logp, mask, c):
    """Reference: ((B, T) weights min(exp(old_logp - rollout_logp), C), 0 at padding; the share of
    counted tokens whose weight reached C), read from `policy_loss`: on-policy (ratio 1), no clip,
    no KL, advantages 1 and a mean over tokens, the gradient with respect to logp is -w_t / tokens."""
    import torch

    from infra_lab.rl.losses import LossConfig, policy_loss

    logp = old_logp.detach().clone().requires_grad_()
    config = LossConfig.grpo(clip_eps=None, kl_weight=0.0, length_norm="token", truncate_c=c)
    ones = torch.ones(len(logp), dtype=logp.dtype)
    loss, stats = policy_loss(logp, old_logp, ones, mask, config, rollout_logp=rollout_logp)
    loss.backward()
    return (-logp.grad * stats["tokens"]).detach() + 0.0, stats["tis_truncated_fraction"]  # + 0.0: no -0


def drive_weights(function, old_logp, rollout_logp, mask, c):
    import torch

    answer = function(torch.from_numpy(old_logp.copy()), torch.from_numpy(rollout_logp.copy()),
                      torch.from_numpy(mask.copy()), c)
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise WrongWeights(f"return (weights, truncated_share); got {type(answer).__name__}")
    weights, share = _numpy(answer[0], "weights"), answer[1]
    expected, expected_share = tis_weights(torch.from_numpy(old_logp), torch.from_numpy(rollout_logp),
                                           torch.from_numpy(mask), c)
    expected = expected.numpy()
    if weights.shape != expected.shape:
        raise WrongWeights(f"weights of shape {weights.shape}, expected {expected.shape}: one per token, like old_logp")
    if not np.allclose(weights, expected, rtol=1e-9, atol=1e-12):
        i, t = _where(np.abs(weights - expected))
        if not mask[i, t]:
            hint = "a padding position (mask False), which gets weight 0"
        elif np.isclose(weights[i, t], np.exp(rollout_logp[i, t] - old_logp[i, t]), rtol=1e-9) or \
                np.isclose(weights[i, t], min(np.exp(rollout_logp[i, t] - old_logp[i, t]), c), rtol=1e-9):
            hint = "the weight is pi_old / pi_rollout = exp(old_logp - rollout_logp), not its inverse"
        elif weights[i, t] > c:
            hint = f"truncate: the weight is at most C = {c}"
        else:
            hint = "w = min(exp(old_logp - rollout_logp), C)"
        raise WrongWeights(f"the weight at (sequence {i}, token {t}) is {weights[i, t]:.8g}, expected "
                           f"{expected[i, t]:.8g}: {hint}")
    share = float(_numpy(share, "truncated_share"))
    if not abs(share - expected_share) <= SHARE_ATOL:
        raw = np.exp(np.where(mask, old_logp - rollout_logp, 0.0))
        variants = [(float((raw >= c)[mask].sum() / mask.size),
                     f"count only the {int(mask.sum())} counted tokens, not all {mask.size} positions"),
                    (float((raw > c)[mask].mean()),
                     "a weight that reaches C counts: exp(old_logp - rollout_logp) >= C")]
        hint = next((why for value, why in variants if abs(value - expected_share) > SHARE_ATOL
                     and abs(share - value) <= SHARE_ATOL),
                    "the share of counted tokens whose raw weight exp(old_logp - rollout_logp) is >= C")
        raise WrongWeights(f"truncated_share is {share:.6g}, expected {expected_share:.6g}: {hint}")
    return ("weights", expected), ("truncated share", expected_share)


def _weights_case(kind, rng):
    sequences, tokens = int(rng.integers(1, 9)), int(rng.integers(1, 8))
    mask = _mask(rng, sequences, tokens)
    old_logp = -rng.exponential(1.5, (sequences, tokens))
    gap = {"fp16 engine": 0.002, "int8 engine": 0.05, "int4 engine": 0.7, "on-policy": 0.0}[kind]
    rollout_logp = old_logp + rng.normal(0.0, gap, old_logp.shape)
    for array in (old_logp, rollout_logp):
        array[~mask] = rng.uniform(-30.0, 0.0, int((~mask).sum()))
    c = 1.0 if kind == "on-policy" else float(rng.choice([1.5, 2.0, 3.0]))
    return old_logp, rollout_logp, mask, c


_WEIGHT_KINDS = ["int4 engine", "fp16 engine", "int8 engine", "int4 engine", "on-policy", "int4 engine"] * 4


# ---- exercise 5: the reader's loss and sync train the real model --------------------------------------

def rl_loss(logp, old_logp, ref_logp, rollout_logp, rewards, mask):
    """Reference: GRPO (clip 0.2, beta 0.04) with truncated importance sampling (C = 2) on one
    batch, from its (P, G) rewards, through the package's loss."""
    from infra_lab.rl.losses import LossConfig, policy_loss

    config = LossConfig.grpo(clip_eps=CLIP_EPS, kl_weight=KL_WEIGHT, truncate_c=TIS_C)
    advantages = config.advantages(rewards).to(logp.dtype)
    return policy_loss(logp, old_logp, advantages, mask, config, ref_logp=ref_logp, rollout_logp=rollout_logp)[0]


def _rl_inputs(case):
    import torch

    logp, old_logp, ref_logp, rollout_logp, rewards, mask = case
    return [torch.from_numpy(a.copy()) for a in (old_logp, ref_logp, rollout_logp, rewards, mask)]


def _step_gap(got: float, gradient: np.ndarray, expected: float, expected_gradient: np.ndarray,
              rtol: float, atol: float) -> str | None:
    """What differs between two losses and their gradients, or None."""
    if not abs(got - expected) <= atol + rtol * abs(expected):
        return f"the loss is {got:.8g}, expected {expected:.8g}"
    gap = np.abs(gradient - expected_gradient)
    if not gap.max(initial=0.0) <= atol * 1e-3 + rtol * np.abs(expected_gradient).max(initial=0.0):
        i, t = _where(gap)
        return (f"the loss is right but its gradient at (sequence {i}, token {t}) is {gradient[i, t]:.6g}, "
                f"expected {expected_gradient[i, t]:.6g}")
    return None


def _rl_hint() -> str:
    return ("advantages from your group_advantages(rewards, True), flattened row by row (sequence p * G + i), the "
            f"weights from your tis_weights(old_logp, rollout_logp, mask, {TIS_C}), then your grpo_loss with clip_eps "
            f"{CLIP_EPS} and beta {KL_WEIGHT}")


def drive_rl_case(function, kind, *case):
    """A random case: the reader's loss against the package's on a float64 batch. A step case:
    the i-th step of the real run. The training case: pass@1 after the run."""
    import torch

    if kind == "random":
        results = []
        for candidate in (function, rl_loss):
            logp = torch.from_numpy(case[0].copy()).requires_grad_()
            loss = candidate(logp, *_rl_inputs(case))
            results.append(_backward(loss, logp, "rl_loss"))
        gap = _step_gap(*results[0], *results[1], 1e-6, 1e-9)
        if gap:
            raise WrongLoss(f"{gap}; {_rl_hint()}")
        return "loss and gradient", results[1][0]
    if function is rl_loss:  # the reference: tests/test_ch11_checks.py trains with the package's own
        return ("step", kind, "the package's loss and gradient") if kind != "train" else _TRAINED
    run = trained(function)
    if kind == "train":
        if run["error"]:
            raise NotLearning(f"the run stopped: {run['error']}")
        before, after = run["before"], run["after"]
        if not after >= before + MARGIN:
            raise NotLearning(f"after {TRAIN['steps']} steps pass@1 on {TRAIN['eval_problems']} held-out problems went "
                              f"from {before:.3f} to {after:.3f}; GRPO's loss raises it by at least {MARGIN}")
        return _TRAINED
    step = int(kind.split()[1])
    if step >= len(run["steps"]):
        raise WrongLoss(f"the run stopped before step {step}: {run['error']}")
    if run["steps"][step]:
        raise WrongLoss(f"step {step} of the real run: {run['steps'][step]}; {_rl_hint()}")
    return "step", kind, "the package's loss and gradient"


_TRAINED = ("trained", f"pass@1 up by at least {MARGIN} after {TRAIN['steps']} steps")
_RUNS: dict = {}


def trained(function) -> dict:
    """The run of `function` (made once per process): per step None or what differed from the
    package's loss, the error that stopped it if any, pass@1 before and after."""
    if function not in _RUNS:
        found = getattr(function, "__globals__", {}).get("BucketSync")
        if not callable(found):
            raise NameError("define BucketSync (exercise 3) beside rl_loss: the check carries the trainer's weights "
                            "to the engine with it")
        _RUNS[function] = _train(function, found)
    return _RUNS[function]


def _warm_pass(problems: tuple) -> float:
    return _WARM_PASS.setdefault(problems, _evaluate(None, list(problems)))


_WARM_PASS: dict = {}


def _run_config():
    from infra_lab.rl.loop import RunConfig

    return RunConfig(loss="grpo", kl_weight=KL_WEIGHT, truncate_c=TIS_C, engine_weights="fp16", **TRAIN)


def _evaluate(model, problems) -> float:
    from infra_lab.rl import evaluate, warm_start
    from infra_lab.rl.loop import evaluation_engine, serving_model

    if model is None:
        warm = warm_start.load_warm()
        model = serving_model(warm.w, 0, warm, "fp16")
    return evaluate.pass_at_1(evaluation_engine(model, _run_config()), problems)


def _train(function, bucket_class) -> dict:
    """GRPO's colocated loop from the package's pieces, with `function` as the loss and
    `bucket_class` as the trainer-to-engine sync (1 MiB buckets)."""
    import torch

    from infra_lab.rl import rollout as rollouts, sync, task, warm_start
    from infra_lab.rl.layouts import step_problems
    from infra_lab.rl.loop import rollout_engine, serving_model
    from infra_lab.rl.trainer import Trainer, lay_out, token_logprobs

    config = _run_config()
    warm = warm_start.load_warm()
    train, held = task.split(config.digits)
    problems_held = tuple(held[:config.eval_problems])
    run = {"steps": [], "error": None, "before": float("nan"), "after": float("nan")}
    trainer = Trainer(warm, config.loss_config(), lr=config.lr)  # its policy, frozen reference and AdamW
    model = serving_model(warm.w, 0, warm, config.engine_weights)
    try:
        channel = bucket_class(shapes_of(warm.config), sync.BUCKET_BYTES)
    except Exception as error:  # noqa: BLE001 (the reader's class: its failure is the finding)
        run["error"] = f"BucketSync(shapes, {sync.BUCKET_BYTES}) raised {type(error).__name__}: {error}"
        return run
    for step in range(config.steps):
        problems = step_problems(train, config, step)
        batch = rollouts.rollout(rollout_engine(model, config, len(problems[0].prompt)), problems, config.group,
                                 task.max_answer_tokens(config.digits), seed=config.seed * 100_003 + step)
        rewards = torch.from_numpy(task.score(task.verify, batch.sample_problems, batch.texts).values)
        scored = lay_out(batch)
        with torch.no_grad():
            ref_logp = token_logprobs(trainer.reference, scored)
        logp = token_logprobs(trainer.policy, scored)
        old_logp = logp.detach()
        inputs = (old_logp, ref_logp, scored.rollout_logp, rewards.reshape(-1, config.group), scored.mask)
        results = []
        try:
            for candidate in (function, rl_loss):
                leaf = old_logp.clone().requires_grad_()
                results.append(_backward(candidate(leaf, *[x.clone() for x in inputs]), leaf, "rl_loss"))
        except Exception as error:  # noqa: BLE001
            run["error"] = f"at step {step}, rl_loss raised {type(error).__name__}: {error}"
            return run
        if not np.isfinite(results[0][1]).all():
            run["error"] = f"at step {step} the gradient of your loss is NaN or inf"
            return run
        run["steps"].append(_step_gap(*results[0], *results[1], STEP_RTOL, STEP_ATOL))
        trainer.optimizer.zero_grad(set_to_none=True)
        logp.backward(torch.from_numpy(results[0][1]).to(logp.dtype))  # the reader's gradient trains
        torch.nn.utils.clip_grad_norm_(trainer.policy.parameters(), trainer.grad_clip)
        trainer.optimizer.step()
        weights = trainer.state()
        try:
            state = channel.unpack(channel.pack({name: value.copy() for name, value in weights.items()}))
            _compare_state(state, weights, "the trainer's weights after your BucketSync")
        except Exception as error:  # noqa: BLE001
            run["error"] = f"at step {step} BucketSync failed: {type(error).__name__}: {error}"
            return run
        model = serving_model(state, step + 1, warm, config.engine_weights)
    run["before"], run["after"] = _warm_pass(problems_held), _evaluate(model, list(problems_held))
    return run


def _rl_case(kind, rng):
    if kind != "random":
        return (kind,)
    prompts, group, tokens = int(rng.integers(1, 5)), int(rng.integers(2, 7)), int(rng.integers(1, 7))
    mask = _mask(rng, prompts * group, tokens)
    logp, old_logp, ref_logp = _log_probs(rng, mask.shape, float(rng.choice([0.0, 0.4])), mask)
    rollout_logp = old_logp + rng.normal(0.0, 0.7, mask.shape)
    rollout_logp[~mask] = 0.0
    rewards = rng.integers(0, 2, (prompts, group)).astype(np.float64)
    rewards[rng.random(prompts) < 0.3] = 1.0
    return kind, logp, old_logp, ref_logp, rollout_logp, rewards, mask


_RL_KINDS = ["random"] * 13 + [f"step {i}" for i in range(TRAIN["steps"])] + ["train"]

register(Check("ch11.group_advantages", group_advantages, Schedule(_ADVANTAGE_KINDS, _advantages_case),
               drive=drive_advantages))
register(Check("ch11.grpo_loss", grpo_loss, Schedule(_LOSS_KINDS, _loss_case), drive=drive_loss))
register(Check("ch11.BucketSync", BucketSync, Schedule(_BUCKET_KINDS, _buckets_case), drive=drive_buckets))
register(Check("ch11.tis_weights", tis_weights, Schedule(_WEIGHT_KINDS, _weights_case), drive=drive_weights))
register(Check("ch11.rl_loss", rl_loss, Schedule(_RL_KINDS, _rl_case), drive=drive_rl_case))
