"""Chapter 11's checks: the package's own answers pass, plausible wrong answers fail and say why,
and the last check trains the warm-started model with the reader's loss and weight sync in the
real loop: the package's loss passes every step and raises pass@1, a loss without the importance
weights fails the steps by name."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from infra_lab.grading import ch11, checks, notebooks
from infra_lab.grading.ch11 import BucketSync  # noqa: F401 - the last check finds it beside rl_loss
from infra_lab.rl import losses

ROOT = Path(__file__).resolve().parent.parent


def run(name, candidate, spec=None):
    return checks._run(spec or checks._lookup(f"ch11.{name}"), candidate)


def fails(name, wrong, says, spec=None):
    result = run(name, wrong, spec)
    assert result.passed < result.total
    assert result.line.startswith(f"FAIL ch11.{name} ") and says in result.first_failure, result.first_failure
    return result


def without(name, *kinds):
    """The check called `name` without its cases of `kinds` (the served and trained ones)."""
    spec = checks._lookup(f"ch11.{name}")
    schedule = spec.draw_case
    kept = [k for k in schedule.kinds if not k.startswith(kinds)]
    return checks.Check(spec.name, spec.reference, ch11.Schedule(kept, schedule.draw), len(kept), spec.rtol,
                        spec.atol, spec.drive)


def test_the_packages_own_answers_pass():
    # each wrapped, so that the checks run them as a reader's answer (not the reference itself)
    assert run("group_advantages", lambda r, s: ch11.group_advantages(r, s)).line == \
        "PASS ch11.group_advantages 24/24"
    assert run("grpo_loss", lambda *a: ch11.grpo_loss(*a)).line == "PASS ch11.grpo_loss 24/24"
    assert run("tis_weights", lambda *a: ch11.tis_weights(*a)).line == "PASS ch11.tis_weights 24/24"
    fast = without("BucketSync", "engine")
    assert run("BucketSync", type("Package", (ch11.BucketSync,), {}), fast).passed == fast.n_cases == 21
    randoms = without("rl_loss", "step", "train")
    assert run("rl_loss", lambda *a: ch11.rl_loss(*a), randoms).passed == randoms.n_cases == 13
    assert [checks.cases(f"ch11.{n}") for n in ("group_advantages", "grpo_loss", "BucketSync", "tis_weights",
                                                "rl_loss")] == [24] * 5


def test_advantage_mistakes_are_named():
    def population_std(rewards, scale):
        centered = rewards - rewards.mean(1, keepdim=True)
        return centered / (rewards.std(1, keepdim=True, unbiased=False) + 1e-4) if scale else centered

    def no_eps(rewards, scale):
        centered = rewards - rewards.mean(1, keepdim=True)
        return centered / rewards.std(1, keepdim=True) if scale else centered

    def always_scaled(rewards, scale):
        return losses.group_advantages(rewards, scale=True)

    def whole_table(rewards, scale):
        centered = rewards - rewards.mean()
        return centered / (rewards.std() + 1e-4) if scale else centered

    fails("group_advantages", population_std, "divides by G - 1")
    fails("group_advantages", no_eps, "add 1e-4 to the std")
    fails("group_advantages", always_scaled, "scale=False (Dr. GRPO) leaves r - mean in reward units")
    fails("group_advantages", whole_table, "each prompt's")


def package_loss(**change):
    """The package's GRPO loss with some of its settings changed: a reader's plausible mistake."""
    def loss(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights=None):
        settings = {"clip_eps": clip_eps, "kl_weight": beta, "length_norm": "sequence"} | change
        config = losses.LossConfig.grpo(**settings)
        return losses.policy_loss(logp, old_logp, advantages, mask, config, ref_logp=ref_logp)[0]
    return loss


def test_loss_mistakes_are_named():
    def kl_added(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights=None):
        no_kl = ch11.grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps, 0.0, weights)
        return 2 * no_kl - ch11.grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights)

    def unmasked(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, weights=None):
        return ch11.grpo_loss(logp, old_logp, ref_logp, advantages, torch.ones_like(mask), clip_eps, beta, weights)

    def detached(logp, *rest):
        return torch.tensor(ch11.grpo_loss(logp, *rest).item())

    fails("grpo_loss", package_loss(clip_eps=None), "clip the ratio")
    fails("grpo_loss", kl_added, "the KL term is subtracted from the objective")
    fails("grpo_loss", package_loss(length_norm="token"), "normalize per sequence")
    fails("grpo_loss", lambda *a: -ch11.grpo_loss(*a), "the loss is minus the objective")
    fails("grpo_loss", unmasked, "the padding counted")
    fails("grpo_loss", detached, "backward() must reach logp")
    # the weights ignored: right wherever none are given, wrong at the first weighted case
    result = fails("grpo_loss", lambda *a: ch11.grpo_loss(*a[:7]), "multiply each token's objective by weights")
    assert result.passed == 15


class Laid(ch11.BucketSync):
    """A reader's layout: `starts_new(used, size, room)` says when a weight starts a new bucket."""

    def __init__(self, shapes, bucket_bytes):
        self.slots, lengths = {}, [0]
        for name, shape in self.order(shapes):
            size = int(np.prod(shape))
            if lengths[-1] and self.starts_new(lengths[-1], size, bucket_bytes // 4):
                lengths.append(0)
            self.slots[name] = (len(lengths) - 1, lengths[-1], tuple(shape))
            lengths[-1] += size
        self.buckets = [np.zeros(n, np.float32) for n in lengths]

    @staticmethod
    def order(shapes):
        return shapes.items()

    @staticmethod
    def starts_new(used, size, room):
        return used + size > room

    def pack(self, weights):
        for name, (b, offset, shape) in self.slots.items():
            self.buckets[b][offset:offset + int(np.prod(shape))] = weights[name].reshape(-1)
        return self.buckets

    def unpack(self, buckets):
        return {name: buckets[b][offset:offset + int(np.prod(shape))].reshape(shape).copy()
                for name, (b, offset, shape) in self.slots.items()}


class Overflowing(Laid):
    """Starts a new bucket only once the current one is already full."""

    @staticmethod
    def starts_new(used, size, room):
        return used >= room


class ByName(Laid):
    """Lays the weights out in the order of their names, not the model's."""

    @staticmethod
    def order(shapes):
        return sorted(shapes.items())


class Views(ch11.BucketSync):
    def unpack(self, buckets):  # the weights as views of the buckets: the next pack overwrites them
        return {s.name: buckets[s.bucket][s.offset:s.offset + s.size].reshape(s.shape) for s in self.layout.slots}


class Reallocating(ch11.BucketSync):
    def pack(self, weights):
        self.buckets = [np.empty_like(b) for b in self.buckets]
        return super().pack(weights)


def test_bucket_mistakes_are_named():
    fast = without("BucketSync", "engine")
    assert run("BucketSync", Laid, fast).passed == fast.n_cases  # the mistakes below differ from it alone
    fails("BucketSync", Overflowing, "a weight that does not fit in the current bucket starts a new one", fast)
    fails("BucketSync", Views, "unpack must copy out of the buckets", fast)
    fails("BucketSync", Reallocating, "allocate the buckets once", fast)
    fails("BucketSync", ByName, "in the order of `shapes`", fast)


def test_weight_mistakes_are_named():
    def inverted(old_logp, rollout_logp, mask, c):
        return ch11.tis_weights(rollout_logp, old_logp, mask, c)

    def unclamped(old_logp, rollout_logp, mask, c):
        return torch.where(mask, torch.exp(old_logp - rollout_logp), 0.0), ch11.tis_weights(
            old_logp, rollout_logp, mask, c)[1]

    def padding_kept(old_logp, rollout_logp, mask, c):
        return (torch.exp(old_logp - rollout_logp).clamp(max=c),
                ch11.tis_weights(old_logp, rollout_logp, mask, c)[1])

    def over_every_position(old_logp, rollout_logp, mask, c):
        weights, _ = ch11.tis_weights(old_logp, rollout_logp, mask, c)
        return weights, float(((torch.exp(old_logp - rollout_logp) >= c) & mask).double().mean())

    def strictly_above(old_logp, rollout_logp, mask, c):
        weights, _ = ch11.tis_weights(old_logp, rollout_logp, mask, c)
        return weights, float((torch.exp(old_logp - rollout_logp) > c)[mask].double().mean())

    fails("tis_weights", inverted, "not its inverse")
    fails("tis_weights", unclamped, "the weight is at most C")
    fails("tis_weights", padding_kept, "which gets weight 0")
    fails("tis_weights", over_every_position, "count only the")
    fails("tis_weights", strictly_above, "a weight that reaches C counts")


def test_rl_loss_mistakes_fail_on_the_random_batches():
    randoms = without("rl_loss", "step", "train")

    def unweighted(logp, old_logp, ref_logp, rollout_logp, rewards, mask):
        advantages = ch11.group_advantages(rewards, True).reshape(-1).to(logp.dtype)
        return ch11.grpo_loss(logp, old_logp, ref_logp, advantages, mask, 0.2, 0.04)

    def column_order(logp, old_logp, ref_logp, rollout_logp, rewards, mask):  # sequence i * P + p
        advantages = ch11.group_advantages(rewards, True).T.reshape(-1).to(logp.dtype)
        weights, _ = ch11.tis_weights(old_logp, rollout_logp, mask, 2.0)
        return ch11.grpo_loss(logp, old_logp, ref_logp, advantages, mask, 0.2, 0.04, weights)

    fails("rl_loss", unweighted, "tis_weights(old_logp, rollout_logp, mask, 2.0)", randoms)
    fails("rl_loss", column_order, "flattened row by row", randoms)


def test_the_last_statement_states_the_checks_numbers():
    notebook = notebooks.read(ROOT / "solutions" / "ch11_rl.ipynb")
    statement = next(c.source for c in notebook.cells if c.source.startswith("## Exercise 5"))
    text = re.sub(r"\s+", " ", statement)
    train = ch11.TRAIN
    for said in (f"for {train['steps']} steps", f"{train['group']} answers to each of {train['prompts']} problems",
                 f"lr 1e-4", f"pass@1 on {train['eval_problems']} held-out problems", f"at least {ch11.MARGIN}",
                 f"clip_eps` {ch11.CLIP_EPS}", f"`beta` {ch11.KL_WEIGHT}", f"mask, {ch11.TIS_C})", "13 random"):
        assert said in text, said
    assert train["lr"] == 1e-4 and ch11._RL_KINDS.count("random") == 13


def rl_loss_without_weights(logp, old_logp, ref_logp, rollout_logp, rewards, mask):
    advantages = ch11.group_advantages(rewards, True).reshape(-1).to(logp.dtype)
    return ch11.grpo_loss(logp, old_logp, ref_logp, advantages, mask, 0.2, 0.04)


@pytest.mark.slow
def test_the_real_run_trains_with_the_packages_loss_and_names_a_loss_without_weights():
    """The package's loss (wrapped, so it trains for real) passes all 24 cases: 10 steps match and
    pass@1 rises by MARGIN. Without the importance weights the engine's fp16 mismatch shows in the
    gradient of the real steps (and in the random batches), while the model still learns."""
    def package(*args):
        return ch11.rl_loss(*args)

    assert run("rl_loss", package).line == "PASS ch11.rl_loss 24/24"
    trained = ch11.trained(package)
    assert trained["after"] >= trained["before"] + ch11.MARGIN and trained["steps"] == [None] * 10
    fails("rl_loss", rl_loss_without_weights, "tis_weights")
    gaps = ch11.trained(rl_loss_without_weights)["steps"]
    assert sum(gap is not None for gap in gaps) >= 5, gaps


@pytest.mark.slow
def test_the_bucket_check_serves_the_packages_layout_from_a_live_engine():
    """Three cases pack the warm start's weights after a GRPO step and serve them from a live engine:
    the package's own layout passes them (run as a reader's class, so that it is served)."""
    assert run("BucketSync", type("Package", (ch11.BucketSync,), {})).line == "PASS ch11.BucketSync 24/24"
