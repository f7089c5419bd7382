"""infra_lab.rl.losses: GRPO, Dr. GRPO and REINFORCE against hand computations on one small batch
(2 prompts x 2 samples, completions of 1-3 tokens), gradients against finite differences, the k3
estimator's sign and its mean, truncated importance sampling, and the errors bad input raises.

The batch. Rewards [[1, 0], [0, 3]] give the unscaled advantages A = [0.5, -0.5, -1.5, 1.5]
(sequence p * G + i). The counted tokens' log-probs and ratios pi_theta / pi_old, per sequence:

    seq  L  A     logp                 ratio             ref - logp        old - rollout (TIS)
    0    1  0.5   [-0.5]               [1.5]             [ln2]             [ln3]
    1    2  -0.5  [-1.0, -0.25]        [0.5, 1.1]        [0, -ln2]         [0, ln0.5]
    2    3  -1.5  [-2.0, -0.5, -1.0]   [1.0, 1.3, 0.7]   [ln2, 0, 0]       [0, ln2.5, 0]
    3    2  1.5   [-0.1, -0.3]         [0.9, 2.0]        [-ln2, ln2]       [ln1.5, 0]

Padding holds junk (-inf, NaN, inf) that the loss must ignore. No ratio sits at a clip edge
(0.8, 1.2), so every test here is away from the surrogate's kinks.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infra_lab.rl.losses import LossConfig, group_advantages, k3_kl, policy_loss, token_weights

F64 = torch.float64
LN2 = math.log(2)
K3_UP = 1 - LN2  # k3 at d = ref - logp = ln 2: 2 - ln2 - 1
K3_DOWN = LN2 - 0.5  # k3 at d = -ln 2: 1/2 + ln2 - 1

REWARDS = [[1.0, 0.0], [0.0, 3.0]]
A = [0.5, -0.5, -1.5, 1.5]
LENGTHS = [1, 2, 3, 2]
LOGP = [[-0.5], [-1.0, -0.25], [-2.0, -0.5, -1.0], [-0.1, -0.3]]
RATIO = [[1.5], [0.5, 1.1], [1.0, 1.3, 0.7], [0.9, 2.0]]
REF_MINUS_LOGP = [[LN2], [0.0, -LN2], [LN2, 0.0, 0.0], [-LN2, LN2]]
OLD_MINUS_ROLLOUT = [[math.log(3)], [0.0, math.log(0.5)], [0.0, math.log(2.5), 0.0], [math.log(1.5), 0.0]]

# By hand, eps = 0.2: min(ratio A, clip(ratio, 0.8, 1.2) A). Starred values are clipped (4 of 8):
# 1.5*0.5=0.75 vs 1.2*0.5=0.6*; 0.5*-0.5=-0.25 vs 0.8*-0.5=-0.4*; 1.1*-0.5=-0.55; 1.0*-1.5=-1.5;
# 1.3*-1.5=-1.95 (A < 0 above 1.2: not clipped); 0.7*-1.5=-1.05 vs -1.2*; 0.9*1.5=1.35; 2.0*1.5=3.0 vs 1.8*.
CLIPPED = [[0.6], [-0.4, -0.55], [-1.5, -1.95, -1.2], [1.35, 1.8]]
UNCLIPPED = [[0.75], [-0.25, -0.55], [-1.5, -1.95, -1.05], [1.35, 3.0]]
K3 = [[K3_UP], [0.0, K3_DOWN], [K3_UP, 0.0, 0.0], [K3_DOWN, K3_UP]]
TIS_C = 2.0
TIS_WEIGHT = [[2.0], [1.0, 0.5], [1.0, 2.0, 1.0], [1.5, 1.0]]  # min(exp(old - rollout), 2): 3 and 2.5 hit C


def padded(rows, pad) -> torch.Tensor:
    """(4, 3) float64: rows of counted values, `pad` after them."""
    return torch.tensor([row + [pad] * (3 - len(row)) for row in rows], dtype=F64)


def batch(requires_grad: bool = True) -> dict:
    logp = padded(LOGP, float("-inf")).requires_grad_(requires_grad)
    log_ratio = padded([[math.log(r) for r in row] for row in RATIO], 0.0)
    old = torch.where(torch.isfinite(logp.detach()), logp.detach() - log_ratio, torch.tensor(float("nan"), dtype=F64))
    return {
        "logp": logp,
        "old_logp": old,
        "advantages": torch.tensor(A, dtype=F64),
        "mask": padded([[1.0] * n for n in LENGTHS], 0.0).bool(),
        "ref_logp": torch.where(torch.isfinite(old), logp.detach() + padded(REF_MINUS_LOGP, 0.0),
                                torch.tensor(float("inf"), dtype=F64)),
        "rollout_logp": torch.where(torch.isfinite(old), old - padded(OLD_MINUS_ROLLOUT, 0.0),
                                    torch.tensor(float("nan"), dtype=F64)),
    }


def reduce_by_hand(rows, length_norm: str, max_tokens: int | None = None) -> float:
    """The objective from per-token values, in plain Python."""
    if length_norm == "sequence":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    if length_norm == "constant":
        return sum(sum(row) / max_tokens for row in rows) / len(rows)
    return sum(sum(row) for row in rows) / sum(len(row) for row in rows)


def times(a, b):
    return [[x * y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def assert_float(actual, expected):
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-14)


# ---- group advantages ----------------------------------------------------------------------------

def test_group_advantages_hand_values():
    rewards = torch.tensor(REWARDS, dtype=F64)
    assert group_advantages(rewards, scale=False).tolist() == [[0.5, -0.5], [-1.5, 1.5]]
    # sample std (ddof=1): [1, 0] -> sqrt(0.5); [0, 3] -> sqrt(4.5)
    s0, s1 = math.sqrt(0.5), math.sqrt(4.5)
    expected = [[0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4)], [-1.5 / (s1 + 1e-4), 1.5 / (s1 + 1e-4)]]
    torch.testing.assert_close(group_advantages(rewards), torch.tensor(expected, dtype=F64), rtol=1e-14, atol=0)
    # G = 3: [0, 1, 1] has mean 2/3, sample variance (4/9 + 1/9 + 1/9) / 2 = 1/3
    got = group_advantages(torch.tensor([[0.0, 1.0, 1.0]], dtype=F64), eps=1e-4)
    s = math.sqrt(1 / 3) + 1e-4
    torch.testing.assert_close(got, torch.tensor([[-2 / 3 / s, 1 / 3 / s, 1 / 3 / s]], dtype=F64), rtol=1e-14, atol=0)


def test_group_advantages_zero_mean_unit_std_and_equal_groups():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 8, generator=g, dtype=F64)
    rewards[2] = 0.7  # a group whose samples all scored alike: no signal, and no NaN
    for scale in (False, True):
        adv = group_advantages(rewards, scale=scale)
        torch.testing.assert_close(adv.mean(dim=1), torch.zeros(5, dtype=F64), rtol=0, atol=1e-15)
        assert adv[2].tolist() == [0.0] * 8
    adv = group_advantages(rewards, eps=1e-4)
    s = rewards.std(dim=1)
    # std(A) = s / (s + eps) exactly, so 1 within eps / s
    others = [0, 1, 3, 4]
    torch.testing.assert_close(adv.std(dim=1)[others], (s / (s + 1e-4))[others], rtol=1e-12, atol=0)
    assert ((adv.std(dim=1)[others] - 1).abs() <= 1e-4 / s[others]).all()


def test_group_advantages_config_flattens_in_row_order():
    rewards = torch.tensor(REWARDS, dtype=F64)
    assert LossConfig.dr_grpo(max_tokens=4).advantages(rewards).tolist() == A
    torch.testing.assert_close(LossConfig.grpo().advantages(rewards), group_advantages(rewards).reshape(-1))
    ints = group_advantages(torch.tensor([[1, 0], [0, 0]]), scale=False)  # 0/1 rewards as ints
    assert ints.is_floating_point() and ints.tolist() == [[0.5, -0.5], [0.0, 0.0]]


@pytest.mark.parametrize("rewards, kwargs, match", [
    ([[1.0], [0.0]], {}, r"G=1"),
    ([[1.0, float("nan")], [0.0, 1.0]], {}, r"\(0, 1\)"),
    ([[1.0, 0.0], [float("inf"), 1.0]], {"scale": False}, r"\(1, 0\)"),
    ([1.0, 0.0], {}, r"shape \(2,\)"),
    ([[1.0, 0.0]], {"eps": 0.0}, r"eps .* got 0\.0"),
    ([[1.0, 0.0]], {"scale": 1}, r"scale .* got 1"),
])
def test_group_advantages_errors_name_the_value(rewards, kwargs, match):
    rewards = torch.tensor(rewards, dtype=F64)
    before = rewards.clone()
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, **kwargs)
    torch.testing.assert_close(rewards, before, rtol=0, atol=0, equal_nan=True)


# ---- the k3 estimator ----------------------------------------------------------------------------

@given(st.floats(-100, 0), st.floats(-100, 0))
def test_k3_is_nonnegative_and_zero_when_equal(logp, ref_logp):
    logp_t, ref_t = torch.tensor([logp], dtype=F64), torch.tensor([ref_logp], dtype=F64)
    assert float(k3_kl(logp_t, ref_t)) >= 0
    assert float(k3_kl(logp_t, logp_t)) == 0


def test_k3_hand_values():
    logp = torch.tensor([-1.0, -1.0, -1.0], dtype=F64)
    ref = logp + torch.tensor([LN2, -LN2, 0.0], dtype=F64)
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([K3_UP, K3_DOWN, 0.0], dtype=F64), rtol=1e-14, atol=0)


def test_k3_keeps_small_differences():
    """k3(d) = d^2/2 + d^3/6 + ... near 0; exp(d) - d - 1 would lose it to cancellation (at d = 1e-6,
    a relative error of about eps64 / 5e-13 ~ 4e-4); expm1(d) - d keeps it to about 1e-10."""
    for d in (1e-6, -1e-6, 1e-4):
        got = float(k3_kl(torch.tensor([0.0], dtype=F64), torch.tensor([d], dtype=F64)))
        assert got == pytest.approx(d * d / 2 + d ** 3 / 6 + d ** 4 / 24, rel=1e-9, abs=0)


def test_k3_mean_over_policy_samples_estimates_the_kl():
    """Tokens drawn from pi: the mean of k3 is KL(pi || ref) = sum pi log(pi / ref), within 5 of
    its standard errors, sqrt(Var_pi[k3] / N) computed exactly from the two distributions."""
    log_pi = torch.log_softmax(torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], dtype=F64), dim=0)
    log_ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.5, 0.0, -0.5, 1.0], dtype=F64), dim=0)
    pi = log_pi.exp()
    kl = float((pi * (log_pi - log_ref)).sum())
    k3_each = k3_kl(log_pi, log_ref)  # (6,): k3 of each token
    sd = math.sqrt(float((pi * k3_each ** 2).sum()) - kl ** 2)
    n = 20_000
    tokens = torch.multinomial(pi, n, replacement=True, generator=torch.Generator().manual_seed(1))
    estimate = float(k3_kl(log_pi[tokens], log_ref[tokens]).mean())
    assert abs(estimate - kl) <= 5 * sd / math.sqrt(n)


# ---- the configuration ---------------------------------------------------------------------------

def test_presets():
    grpo, dr, rf = LossConfig.grpo(), LossConfig.dr_grpo(max_tokens=64), LossConfig.reinforce()
    assert (grpo.kind, grpo.scale_advantages, grpo.clip_eps, grpo.kl_weight, grpo.length_norm,
            grpo.max_tokens, grpo.truncate_c) == ("grpo", True, 0.2, 0.04, "sequence", None, None)
    assert (dr.kind, dr.scale_advantages, dr.clip_eps, dr.kl_weight, dr.length_norm, dr.max_tokens) == \
        ("dr_grpo", False, 0.2, 0.0, "constant", 64)
    assert (rf.kind, rf.scale_advantages, rf.clip_eps, rf.kl_weight, rf.length_norm) == \
        ("reinforce", False, None, 0.0, "token")
    assert LossConfig() == grpo
    assert LossConfig.grpo(kl_weight=0.0, truncate_c=2.0).truncate_c == 2.0
    with pytest.raises(AttributeError):
        grpo.kl_weight = 0.0  # frozen


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "ppo"}, r"kind .* 'ppo'"),
    ({"scale_advantages": "yes"}, r"scale_advantages .* 'yes'"),
    ({"clip_eps": 1.5}, r"clip_eps .* 1\.5"),
    ({"clip_eps": 0}, r"clip_eps .* got 0"),
    ({"kl_weight": -0.1}, r"kl_weight .* -0\.1"),
    ({"kl_weight": float("nan")}, r"kl_weight .* nan"),
    ({"length_norm": "batch"}, r"length_norm .* 'batch'"),
    ({"length_norm": "constant"}, r"max_tokens.* got None"),
    ({"length_norm": "constant", "max_tokens": 0}, r"max_tokens.* got 0"),
    ({"max_tokens": 64}, r"max_tokens=64 .* 'sequence'"),
    ({"truncate_c": 0.0}, r"truncate_c .* 0\.0"),
    ({"kind": "dr_grpo"}, r"dr_grpo.*scale_advantages=True"),
    ({"kind": "reinforce"}, r"clip_eps .* 0\.2"),
])
def test_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


# ---- each loss against the hand computation ------------------------------------------------------

@pytest.mark.parametrize("length_norm, max_tokens, expected_objective", [
    ("sequence", None, 0.0375),  # (0.6 - 0.95/2 - 4.65/3 + 3.15/2) / 4
    ("constant", 4, -0.115625),  # (0.6 - 0.95 - 4.65 + 3.15) / (4 * 4)
    ("token", None, -0.23125),  # -1.85 / 8
])
def test_clipped_surrogate_by_hand(length_norm, max_tokens, expected_objective):
    b = batch()
    config = LossConfig.grpo(kl_weight=0.0, length_norm=length_norm, max_tokens=max_tokens)
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], config)
    assert_float(loss.item(), -expected_objective)
    assert_float(loss.item(), -reduce_by_hand(CLIPPED, length_norm, max_tokens))
    assert stats["clip_fraction"] == 0.5
    assert_float(stats["ratio_mean"], 9.0 / 8)  # (1.5 + 0.5 + 1.1 + 1.0 + 1.3 + 0.7 + 0.9 + 2.0) / 8
    assert stats["tokens"] == 8.0
    assert math.isnan(stats["kl_mean"]) and stats["tis_truncated_fraction"] == 0.0


def test_dr_grpo_preset_by_hand():
    b = batch()
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], LossConfig.dr_grpo(max_tokens=4))
    assert_float(loss.item(), 0.115625)
    assert stats["clip_fraction"] == 0.5


def test_no_clipping_by_hand():
    b = batch()
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"],
                              LossConfig.grpo(kl_weight=0.0, clip_eps=None))
    # (0.75 + (-0.25 - 0.55) / 2 + (-1.5 - 1.95 - 1.05) / 3 + (1.35 + 3.0) / 2) / 4
    assert_float(loss.item(), -(0.75 - 0.4 - 1.5 + 2.175) / 4)
    assert_float(loss.item(), -reduce_by_hand(UNCLIPPED, "sequence"))
    assert stats["clip_fraction"] == 0.0


def test_reinforce_by_hand():
    b = batch()
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], LossConfig.reinforce())
    # logp * A summed: -0.25 + 0.625 + 5.25 - 0.6 = 5.025 over 8 tokens
    assert_float(loss.item(), -0.628125)
    assert stats["clip_fraction"] == 0.0 and stats["tokens"] == 8.0
    assert_float(stats["ratio_mean"], 9.0 / 8)  # reported, though the objective has no ratio


@pytest.mark.parametrize("beta", [0.04, 0.5])
def test_grpo_with_kl_by_hand(beta):
    b = batch()
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], LossConfig.grpo(kl_weight=beta),
                              ref_logp=b["ref_logp"])
    per_token = [[s - beta * k for s, k in zip(rs, rk)] for rs, rk in zip(CLIPPED, K3)]
    assert_float(loss.item(), -reduce_by_hand(per_token, "sequence"))
    # by hand: 0.0375 - beta * (K3_UP / 1 + K3_DOWN / 2 + K3_UP / 3 + (K3_DOWN + K3_UP) / 2) / 4
    assert_float(loss.item(), -(0.0375 - beta * (K3_UP + K3_DOWN / 2 + K3_UP / 3 + (K3_DOWN + K3_UP) / 2) / 4))
    assert_float(stats["kl_mean"], (3 * K3_UP + 2 * K3_DOWN) / 8)


def test_reinforce_with_kl_by_hand():
    b = batch()
    loss, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], LossConfig.reinforce(kl_weight=0.1),
                          ref_logp=b["ref_logp"])
    # (5.025 - 0.1 * (3 K3_UP + 2 K3_DOWN)) / 8 tokens
    assert_float(loss.item(), -(5.025 - 0.1 * (3 * K3_UP + 2 * K3_DOWN)) / 8)


def test_kl_reported_when_weight_is_zero():
    b = batch()
    plain, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], LossConfig.grpo(kl_weight=0.0))
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], LossConfig.grpo(kl_weight=0.0),
                              ref_logp=b["ref_logp"])
    assert loss.item() == plain.item()
    assert_float(stats["kl_mean"], (3 * K3_UP + 2 * K3_DOWN) / 8)


@pytest.mark.parametrize("config, surrogate", [
    (LossConfig.grpo(kl_weight=0.0, truncate_c=TIS_C), CLIPPED),
    (LossConfig.reinforce(truncate_c=TIS_C), [[lp * a for lp in row] for row, a in zip(LOGP, A)]),
])
def test_tis_by_hand(config, surrogate):
    b = batch()
    loss, stats = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], config,
                              rollout_logp=b["rollout_logp"])
    assert_float(loss.item(), -reduce_by_hand(times(TIS_WEIGHT, surrogate), config.length_norm))
    assert stats["tis_truncated_fraction"] == 2 / 8  # the raw weights 3 and 2.5 hit C = 2


def test_tis_weight_carries_no_gradient():
    """With TIS each token's gradient is its (clipped) weight times the gradient without it: the
    weight enters as a constant."""
    grads = []
    for truncate_c in (None, TIS_C):
        b = batch()
        config = LossConfig.grpo(truncate_c=truncate_c)
        loss, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], config,
                              ref_logp=b["ref_logp"], rollout_logp=b["rollout_logp"])
        loss.backward()
        grads.append(b["logp"].grad)
    torch.testing.assert_close(grads[1], padded(TIS_WEIGHT, 0.0) * grads[0], rtol=1e-13, atol=0)
    assert (padded(TIS_WEIGHT, 0.0) <= TIS_C).all()


def test_float_mask_and_padding_junk():
    b = batch()
    config = LossConfig.grpo()
    loss, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], config, ref_logp=b["ref_logp"])
    clean = {k: torch.where(b["mask"], v.detach(), 0.0) for k, v in b.items() if k not in ("mask", "advantages")}
    loss_f, _ = policy_loss(clean["logp"], clean["old_logp"], b["advantages"], b["mask"].to(F64), config,
                            ref_logp=clean["ref_logp"])
    assert loss.item() == loss_f.item()
    loss.backward()
    assert (b["logp"].grad[~b["mask"]] == 0).all()  # junk at padding got zero gradient, no NaN
    assert torch.isfinite(b["logp"].grad).all()


# ---- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    LossConfig.grpo(),
    LossConfig.grpo(truncate_c=TIS_C, clip_eps=None),
    LossConfig.dr_grpo(max_tokens=4, kl_weight=0.1),
    LossConfig.reinforce(),
    LossConfig.reinforce(kl_weight=0.1, truncate_c=TIS_C),
], ids=["grpo", "grpo-tis-noclip", "dr_grpo-kl", "reinforce", "reinforce-kl-tis"])
def test_gradient_matches_finite_differences(config):
    b = batch()
    logp = torch.where(b["mask"], b["logp"].detach(), -3.0).requires_grad_(True)  # finite padding to perturb

    def loss_of(lp):
        return policy_loss(lp, b["old_logp"], b["advantages"], b["mask"], config,
                           ref_logp=b["ref_logp"], rollout_logp=b["rollout_logp"])[0]

    assert torch.autograd.gradcheck(loss_of, (logp,), eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("config", [
    LossConfig.grpo(kl_weight=0.0), LossConfig.dr_grpo(max_tokens=4), LossConfig.reinforce(),
    LossConfig.reinforce(length_norm="sequence"),
])
def test_on_policy_gradient_is_token_weights(config):
    """old_logp == logp: every ratio is 1, nothing is clipped, and each counted token's gradient of
    the objective is token_weights' per-token weight; for GRPO's sequence norm that is
    A_i / (|o_i| B), REINFORCE's A grad logp divided by the length."""
    b = batch()
    loss, stats = policy_loss(b["logp"], b["logp"].detach(), b["advantages"], b["mask"], config)
    loss.backward()
    assert stats["ratio_mean"] == 1.0 and stats["clip_fraction"] == 0.0
    weights = token_weights(LENGTHS, A, config.length_norm, config.max_tokens).per_token
    expected = torch.where(b["mask"], weights[:, None].expand(4, 3), 0.0)
    torch.testing.assert_close(-b["logp"].grad, expected, rtol=1e-14, atol=0)
    if config.length_norm == "sequence":
        by_hand = [a / (n * 4) for a, n in zip(A, LENGTHS)]  # A / (|o_i| B)
        torch.testing.assert_close(weights, torch.tensor(by_hand, dtype=F64), rtol=1e-15, atol=0)


def test_grpo_on_policy_gradient_equals_reinforce_per_length():
    grads = []
    for config in (LossConfig.grpo(kl_weight=0.0), LossConfig.reinforce(length_norm="sequence")):
        b = batch()
        policy_loss(b["logp"], b["logp"].detach(), b["advantages"], b["mask"], config)[0].backward()
        grads.append(b["logp"].grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-14, atol=0)


def test_token_weights_show_the_length_bias():
    """Two correct answers (A = +1) and two wrong ones (A = -1), 2 and 8 tokens long."""
    lengths, advantages = [2, 8, 2, 8], [1.0, 1.0, -1.0, -1.0]
    seq = token_weights(lengths, advantages, "sequence")
    assert seq.per_token.tolist() == [1 / 8, 1 / 32, -1 / 8, -1 / 32]  # A / (L B), B = 4
    assert seq.per_token[0] > seq.per_token[1]  # the short correct answer, a bigger push per token
    assert abs(seq.per_token[3]) < abs(seq.per_token[2])  # the long wrong answer, a smaller penalty per token
    assert seq.per_sequence.abs().tolist() == [0.25] * 4  # each sequence's total, whatever its length
    const = token_weights(lengths, advantages, "constant", max_tokens=8)
    assert const.per_token.abs().tolist() == [1 / 32] * 4  # A / (max_tokens B): no length in it
    assert const.per_sequence.tolist() == [2 / 32, 8 / 32, -2 / 32, -8 / 32]
    assert token_weights(lengths, advantages, "token").per_token.tolist() == [1 / 20, 1 / 20, -1 / 20, -1 / 20]
    with pytest.raises(ValueError, match=r"max_tokens.* got 4"):
        token_weights(lengths, advantages, "constant", max_tokens=4)
    with pytest.raises(ValueError, match=r"length_norm .* 'batch'"):
        token_weights(lengths, advantages, "batch")


# ---- bad input -----------------------------------------------------------------------------------

def _bad(b, name, value):
    return {**b, name: value}


@pytest.mark.parametrize("change, config, match", [
    (lambda b: _bad(b, "old_logp", b["old_logp"][:, :2]), LossConfig.grpo(), r"old_logp has shape \(4, 2\)"),
    (lambda b: _bad(b, "advantages", b["advantages"][:3]), LossConfig.grpo(), r"advantages .* \(4,\)"),
    (lambda b: _bad(b, "mask", b["mask"][:2]), LossConfig.grpo(), r"mask has shape \(2, 3\)"),
    (lambda b: _bad(b, "ref_logp", None), LossConfig.grpo(), r"kl_weight=0\.04 needs ref_logp"),
    (lambda b: _bad(b, "rollout_logp", None), LossConfig.grpo(truncate_c=2.0), r"truncate_c=2\.0 needs rollout_logp"),
    (lambda b: _bad(b, "mask", torch.zeros(4, 3, dtype=torch.bool)), LossConfig.grpo(), r"mask counts no token"),
    (lambda b: _bad(b, "mask", b["mask"].to(F64) * 0.5), LossConfig.grpo(), r"0 and 1.*\(0, 0\)"),
    (lambda b: _bad(b, "old_logp", b["old_logp"].clone().requires_grad_(True)), LossConfig.grpo(),
     r"old_logp requires grad"),
    (lambda b: _bad(b, "old_logp", torch.where(b["mask"], b["old_logp"], 0.0).index_put(
        (torch.tensor([2]), torch.tensor([1])), torch.tensor(float("nan"), dtype=F64))), LossConfig.grpo(),
     r"old_logp is NaN or inf at counted .* \(2, 1\)"),
    (lambda b: b, LossConfig.dr_grpo(max_tokens=2), r"3 tokens, more than max_tokens=2"),
])
def test_bad_input_errors_name_it(change, config, match):
    b = change(batch())
    with pytest.raises(ValueError, match=match):
        policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], config,
                    ref_logp=b["ref_logp"], rollout_logp=b["rollout_logp"])


def test_inputs_are_not_modified():
    b = batch()
    before = {k: v.detach().clone() for k, v in b.items()}
    config = LossConfig.grpo(truncate_c=TIS_C)
    loss, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], config,
                          ref_logp=b["ref_logp"], rollout_logp=b["rollout_logp"])
    loss.backward()
    for name, value in b.items():
        torch.testing.assert_close(value.detach(), before[name], rtol=0, atol=0, equal_nan=True, msg=name)
    with pytest.raises(TypeError, match="LossConfig"):
        policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], {"kind": "grpo"})
