"""Checks for chapter 09's exercises: top-k gating with a balancing bias, the Switch auxiliary
loss, capacity dispatch by sorting, DeepSeek-V3's bias update, and the reader's router and bias
update training the real mixture of experts.

The references call the package: `moe.routing` (route, switch_aux_loss, keep_within_capacity,
update_bias) and `moe.dispatch.plan`. Each drive compares what the reader's function gives with
the package's answer, so a failure line can name the value that differs and its likely cause
(weights not renormalised, the bias added to the weights, Hugging Face's aux loss, a token-major
capacity order, the sign of the bias step). The last check resets the shipped MoE model's
balancing biases to zero, so its experts' loads spread apart, then trains it for TRAIN_STEPS
steps with the reader's top_k_gating picking every layer's experts and the reader's update_bias
moving the biases through the reader's balance_step; the loads on validation text must come
back within BALANCE_BAR. (The shipped model's bias had 2,400 steps on batches four times larger
to reach 1.15; the check has a hundred or so, on small batches.)
"""
from __future__ import annotations

import functools
import math

import numpy as np

from infra_lab.grading.ch07 import Schedule
from infra_lab.grading.ch08 import _array, _first, _floats, _partner
from infra_lab.grading.checks import Check, register
from infra_lab.moe import dispatch as moe_dispatch
from infra_lab.moe import routing

WEIGHT_TOLERANCE = 1e-5  # rtol of gate weights and losses: float32 sums in any order
TRAIN_STEPS, TRAIN_BATCH, TRAIN_WINDOW = 120, 4, 256  # the last check's training: steps, windows, bytes
TRAIN_LR, BIAS_RATE = 1e-4, 0.002  # its learning rate (the shipped model ended its schedule near 0) and bias step
BALANCE_WINDOWS = 16  # validation windows of 512 bytes, spread over the split, the loads are counted on
# the most loaded expert's assignments over the mean, in every layer, after those steps. With the
# biases at zero the worst layer sits at 1.54; after 120 steps, seeds 0 to 4 left it at 1.13 to
# 1.24, and 300 steps do no better (seeds 0 and 1: 1.19 and 1.23; small batches keep the loads
# moving)
BALANCE_BAR = 1.3
BPB_SLACK = 0.1  # bits per byte the trained model may lose against the shipped one


class WrongGating(AssertionError):
    """Experts or gate weights that differ from the package's top-k routing."""


class WrongLoss(AssertionError):
    """An auxiliary loss that differs from the Switch Transformer's."""


class WrongDispatch(AssertionError):
    """Kept assignments, a sort or its inverse that differ from the package's."""


class WrongBias(AssertionError):
    """A bias step that differs from DeepSeek-V3's."""


class Unbalanced(AssertionError):
    """Training with the reader's router left an expert over the balance bar."""


def _integers(value, what: str, shape: tuple) -> np.ndarray:
    if not (isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.shape == shape):
        got = (f"an array of {value.dtype}, shape {value.shape}" if isinstance(value, np.ndarray)
               else type(value).__name__)
        raise TypeError(f"{what} must be a numpy array of integers, shape {shape}; got {got}")
    return value.astype(np.int64)


def _pair(answer, what: str):
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise TypeError(f"{what} must return a pair (experts, weights); got {type(answer).__name__}")
    return answer


# ---- exercise 1: top-k gating -----------------------------------------------------------------------

def top_k_gating(logits, k, bias):
    """Reference: each token's k experts by softmax probability plus bias (ties to the lower
    expert), and their gate weights: the probabilities renormalised over the k, no bias."""
    chosen = routing.route(logits, k, bias=bias)
    return chosen.experts, chosen.weights


def compare_gating(logits, k, bias, answer) -> None:
    """WrongGating at the first token whose experts or weights differ from the package's."""
    n_tokens, n_experts = logits.shape
    experts, weights = _pair(answer, "top_k_gating")
    experts = _integers(experts, "experts", (n_tokens, k))
    weights = _floats(weights, "weights", (n_tokens, k))
    expected = routing.route(logits, k, bias=bias)
    probs = expected.probs.astype(np.float64)
    bad = (experts != expected.experts).any(1)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        scores = probs[t] + bias
        hint = "the k experts with the highest probability plus bias, best first"
        differ = experts[t] != expected.experts[t]
        valid = (experts[t] >= 0) & (experts[t] < n_experts)
        if valid.all() and np.allclose(scores[experts[t][differ]], scores[expected.experts[t][differ]], atol=1e-7):
            hint = "on a tie in score the lower expert wins (a stable sort of -scores)"
        elif set(experts[t]) == set(expected.experts[t]):
            hint = "list them best first (highest score first)"
        elif np.array_equal(experts[t], np.argsort(-(logits[t] + bias), kind="stable")[:k]):
            hint = "the bias is added to the softmax probabilities, not to the logits"
        elif np.array_equal(experts[t], np.argsort(-probs[t], kind="stable")[:k]) and bias.any():
            hint = "add the bias to the probabilities when choosing (it moves the choice, not the weights)"
        raise WrongGating(f"token {t}: experts {experts[t].tolist()}, expected {expected.experts[t].tolist()} "
                          f"(scores {np.round(scores, 4).tolist()}): {hint}")
    close = np.isclose(weights, expected.weights, rtol=WEIGHT_TOLERANCE, atol=1e-7)
    if not close.all():
        t, j = _first(~close)
        raw = probs[t, experts[t]]
        hint = "a weight is the chosen expert's probability over the sum of the k chosen probabilities"
        if np.allclose(weights[t], raw, rtol=1e-4):
            hint = "renormalise: divide the chosen probabilities by their sum, so each token's weights sum to 1"
        elif np.allclose(weights[t], raw + bias[experts[t]], rtol=1e-4) or \
                np.allclose(weights[t], (raw + bias[experts[t]]) / (raw + bias[experts[t]]).sum(), rtol=1e-4):
            hint = "the bias only chooses experts; the weights come from the probabilities alone"
        raise WrongGating(f"token {t}'s weight {j} is {weights[t, j]:.6g}, expected {expected.weights[t, j]:.6g}: {hint}")


def drive_gating(function, logits, k, bias):
    compare_gating(logits, k, bias, function(logits.copy(), k, bias.copy()))
    return ("experts", "the package's, best first"), ("weights", "renormalised over the k")


def _logits(rng, n_tokens, n_experts, kind) -> np.ndarray:
    logits = rng.standard_normal((n_tokens, n_experts)).astype(np.float32) * np.float32(rng.uniform(0.5, 3))
    if kind == "ties":  # whole numbers: equal probabilities within a token
        logits = np.round(logits).astype(np.float32)
    return logits


def _gating_case(kind, rng):
    n_experts = int(rng.choice([4, 8, 16, 64]))
    k = 1 if kind == "top-1" else n_experts if kind == "every expert" else int(rng.integers(2, min(n_experts, 8) + 1))
    bias = np.zeros(n_experts, np.float32)
    if kind in ("bias", "ties"):
        bias = (rng.standard_normal(n_experts) * 0.1).astype(np.float32)
        if kind == "ties":
            bias = np.round(bias * 20).astype(np.float32) / 20
    return _logits(rng, int(rng.integers(1, 64)), n_experts, kind), k, bias


_GATING_KINDS = ["plain", "top-1", "bias", "ties", "plain", "every expert", "bias", "ties"] * 3


# ---- exercise 2: the Switch auxiliary loss --------------------------------------------------------

def switch_aux_loss(probs, experts):
    """Reference: E * sum_i f_i P_i over the T * k assignments (1 at uniform routing)."""
    return routing.switch_aux_loss(probs, experts)


def drive_aux(function, probs, experts):
    got = function(probs.copy(), experts.copy())
    if isinstance(got, np.ndarray) and got.shape == ():
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (float, np.floating, int, np.integer)):
        raise TypeError(f"switch_aux_loss must return a number; got {type(got).__name__}")
    got, expected = float(got), routing.switch_aux_loss(probs, experts)
    if not math.isclose(got, expected, rel_tol=WEIGHT_TOLERANCE, abs_tol=1e-9):
        n_tokens, k = experts.shape
        hint = "f_i is expert i's share of the T * k assignments, P_i its mean probability over tokens; times E"
        if math.isclose(got, expected * k, rel_tol=1e-4):
            hint = ("divide the counts by T * k, not T: Hugging Face's load_balancing_loss_func divides by T and "
                    "gives k at uniform routing, Switch's equation 4 gives 1")
        elif math.isclose(got * probs.shape[1], expected, rel_tol=1e-4):
            hint = "multiply by the number of experts E, so that uniform routing gives 1"
        raise WrongLoss(f"got {got:.6g}, expected {expected:.6g} for {n_tokens} tokens, top-{k}: {hint}")
    return "loss", round(expected, 4)


def _aux_case(kind, rng):
    n_experts, n_tokens = int(rng.choice([4, 8, 16])), int(rng.integers(2, 128))
    k = int(rng.integers(1, min(4, n_experts) + 1))
    if kind == "uniform":
        probs = np.full((n_tokens * n_experts, n_experts), 1 / n_experts, np.float32)
        experts = np.stack([(np.arange(n_tokens * n_experts) + j) % n_experts for j in range(k)], 1)
        return probs, experts
    if kind == "collapsed":
        logits = np.zeros((n_tokens, n_experts), np.float32)
        logits[:, 0] = 8
    else:
        logits = _logits(rng, n_tokens, n_experts, kind)
    chosen = routing.route(logits, k)
    return chosen.probs, chosen.experts


_AUX_KINDS = ["plain", "uniform", "collapsed", "plain"] * 6


# ---- exercise 3: capacity dispatch by sorting -----------------------------------------------------

def dispatch(experts, n_experts, slots):
    """Reference: (kept (T, k) bool, tokens (N,), offsets (E + 1,), slot_of (T, k)) of the
    assignments kept within `slots` per expert (None: all), sorted by expert."""
    kept = routing.keep_within_capacity(experts, n_experts, slots)
    weights = np.ones(experts.shape, np.float32)
    plan = moe_dispatch.plan(routing.Routing(experts, weights, None, kept), n_experts)
    return kept, plan.tokens, plan.offsets, plan.slot_of


def drive_dispatch(function, experts, n_experts, slots):
    answer = function(experts.copy(), n_experts, slots)
    if not (isinstance(answer, tuple) and len(answer) == 4):
        raise TypeError(f"dispatch must return (kept, tokens, offsets, slot_of); got {type(answer).__name__}")
    n_tokens, k = experts.shape
    kept, tokens, offsets, slot_of = dispatch(experts, n_experts, slots)
    got_kept = _array(answer[0], "kept", np.bool_, (n_tokens, k))
    if (got_kept != kept).any():
        t, j = _first(got_kept != kept)
        hint = (f"each expert keeps its first {slots} assignments, taken as every token's first choice in token "
                "order, then every second choice, and so on")
        if slots is None:
            hint = "with no capacity (None) every assignment is kept"
        elif k > 1 and (_token_major_kept(experts, n_experts, slots) == got_kept).all():
            hint = ("first choices come before second ones: fill the slots from experts.T (choice-major), "
                    "not token by token")
        raise WrongDispatch(f"assignment ({t}, {j}) to expert {experts[t, j]} is "
                            f"{'kept' if got_kept[t, j] else 'dropped'}, expected "
                            f"{'kept' if kept[t, j] else 'dropped'}: {hint}")
    n = int(kept.sum())
    got_offsets = _integers(answer[2], "offsets", (n_experts + 1,))
    if (got_offsets != offsets).any():
        (e,) = _first(got_offsets != offsets)
        raise WrongDispatch(f"offsets[{e}] is {got_offsets[e]}, expected {offsets[e]}: offsets[e] is the number of "
                            f"kept assignments to experts below e, and offsets[{n_experts}] = {n} of them")
    got_tokens = _integers(answer[1], "tokens", (n,))
    if (got_tokens != tokens).any():
        (i,) = _first(got_tokens != tokens)
        expert = int(np.searchsorted(offsets, i, side="right") - 1)
        raise WrongDispatch(f"sorted row {i} (expert {expert}'s run) holds token {got_tokens[i]}, expected "
                            f"{tokens[i]}: sort the kept assignments by expert with a stable sort, so each "
                            "expert's tokens stay in token order")
    got_slots = _integers(answer[3], "slot_of", (n_tokens, k))
    if (got_slots != slot_of).any():
        t, j = _first(got_slots != slot_of)
        hint = "slot_of[t, j] is the sorted row that holds assignment (t, j): the inverse of the sort"
        if slot_of[t, j] < 0:
            hint = "a dropped assignment has no row: slot_of is -1 there"
        raise WrongDispatch(f"slot_of[{t}, {j}] is {got_slots[t, j]}, expected {slot_of[t, j]}: {hint}")
    return ("kept", n), ("sorted", "stable, by expert"), ("inverse", "slot_of")


def _token_major_kept(experts, n_experts, slots) -> np.ndarray:
    """The common mistake: capacity filled token by token, a token's second choice before the next token's first."""
    flat = experts.reshape(-1)
    seen = np.zeros(n_experts, np.int64)
    kept = np.zeros(flat.shape, bool)
    for i, e in enumerate(flat):
        kept[i] = seen[e] < slots
        seen[e] += 1
    return kept.reshape(experts.shape)


def _dispatch_case(kind, rng):
    n_experts, n_tokens = int(rng.choice([2, 4, 8])), int(rng.integers(1, 48))
    k = int(rng.integers(1, min(3, n_experts) + 1))
    skew = rng.dirichlet(np.full(n_experts, 0.5 if kind == "skewed" else 5.0))
    experts = np.stack([rng.choice(n_experts, k, replace=False, p=skew) for _ in range(n_tokens)]).astype(np.int64)
    slots = None if kind == "dropless" else routing.capacity(n_tokens, n_experts, k, float(rng.choice([0.5, 1.0, 1.25])))
    return experts, n_experts, slots


_DISPATCH_KINDS = ["plain", "skewed", "dropless", "skewed", "plain", "skewed"] * 4


# ---- exercise 4: the bias update ------------------------------------------------------------------

def update_bias(bias, loads, rate):
    """Reference: b_i + rate * sign(mean load - load_i), float32."""
    return routing.update_bias(bias, loads, rate)


def drive_bias(function, bias, loads, rate):
    got = _floats(function(bias.copy(), loads.copy(), rate), "the new bias", bias.shape)
    expected = routing.update_bias(bias, loads, rate).astype(np.float64)
    close = np.isclose(got, expected, rtol=WEIGHT_TOLERANCE, atol=1e-7)
    if not close.all():
        (i,) = _first(~close)
        step = got[i] - bias[i]
        hint = "an overloaded expert's bias goes down by rate, an underloaded one's up, a balanced one's stays"
        if np.isclose(step, -(expected[i] - bias[i])) and step != 0:
            hint = "the sign is flipped: an expert with more than the mean load must become less attractive"
        elif loads[i] == loads.mean():
            hint = "an expert at exactly the mean load keeps its bias (the sign of 0 is 0)"
        elif abs(step) != rate:
            hint = "the step is rate times the sign of the load error, not proportional to it"
        raise WrongBias(f"expert {i} (load {loads[i]:g}, mean {loads.mean():g}) got bias {got[i]:.6g} from "
                        f"{bias[i]:.6g}, expected {expected[i]:.6g}: {hint}")
    return "bias", "DeepSeek-V3's step"


def _bias_case(kind, rng):
    n_experts = int(rng.choice([4, 8, 16, 64]))
    bias = (rng.standard_normal(n_experts) * 0.05).astype(np.float32)
    loads = rng.integers(0, 200, n_experts).astype(np.int64)
    if kind == "some at the mean":
        loads[: n_experts // 2] = 100
        loads[n_experts // 2:] = 100 + rng.integers(-50, 51, n_experts - n_experts // 2)
        loads[-1] = 100 * n_experts - loads[:-1].sum()  # the mean stays 100
    elif kind == "balanced":
        loads[:] = 64
    return bias, loads, float(rng.choice([0.001, 0.01, 0.1]))


_BIAS_KINDS = ["plain", "some at the mean", "plain", "balanced"] * 6


# ---- exercise 5: the reader's router trains the real MoE ------------------------------------------

def balance_step(biases, experts_per_layer, n_experts, rate):
    """Reference: each layer's bias moved by update_bias from the loads its chosen experts (T, k)
    put on the n_experts experts in one training step."""
    return [routing.update_bias(bias, np.bincount(np.asarray(experts).reshape(-1), minlength=n_experts), rate)
            for bias, experts in zip(biases, experts_per_layer)]


def compare_balance_step(biases, experts_per_layer, n_experts, rate, answer) -> list[np.ndarray]:
    """The reader's new biases as float arrays, or WrongBias at the first layer that differs."""
    if not isinstance(answer, (list, tuple)) or len(answer) != len(biases):
        raise TypeError(f"balance_step must return a list of {len(biases)} biases, one per layer; got "
                        f"{type(answer).__name__}" + (f" of {len(answer)}" if isinstance(answer, (list, tuple)) else ""))
    expected = balance_step(biases, experts_per_layer, n_experts, rate)
    got = []
    for layer, (bias, experts, mine, theirs) in enumerate(zip(biases, experts_per_layer, answer, expected)):
        mine = _floats(np.asarray(mine) if isinstance(mine, (list, tuple)) else mine, f"layer {layer}'s new bias",
                       (n_experts,))
        close = np.isclose(mine, theirs, rtol=WEIGHT_TOLERANCE, atol=1e-7)
        if not close.all():
            (e,) = _first(~close)
            loads = np.bincount(np.asarray(experts).reshape(-1), minlength=n_experts)
            raise WrongBias(f"layer {layer}: expert {e}'s bias became {mine[e]:.6g} from {bias[e]:.6g}, expected "
                            f"{theirs[e]:.6g}: its load this step is {loads[e]} of the {experts.size} assignments "
                            f"(mean {loads.mean():g}); count each expert's assignments in that layer's experts "
                            "(np.bincount with minlength) and pass them to update_bias")
        got.append(mine)
    return got


@functools.cache
def _splits():
    from infra_lab.model import corpus

    return corpus.load()  # (train, validation)


def _moe_weights():
    from infra_lab.model import weights

    loaded, config, _ = weights.load(weights.path_for("moe"))
    return loaded, config


def balance(model) -> np.ndarray:
    """(layers,) the most loaded expert's share over the mean, on BALANCE_WINDOWS validation windows."""
    from infra_lab.model.train import expert_loads

    shares = expert_loads(model, _splits()[1], max_windows=BALANCE_WINDOWS)
    return shares.max(1) * shares.shape[1]


_RUNS: dict = {}


def fine_tune(gating, step, steps: int = TRAIN_STEPS, seed: int = 0) -> dict:
    """The shipped MoE with its balancing biases set to zero, trained for `steps` steps with
    `gating(logits, k, bias)` choosing every layer's experts and `step(biases, experts per
    layer, n_experts, rate)` moving the biases after each step; every choice and every bias is
    compared with the package's on the way (WrongGating, WrongBias). Returns the balance per
    layer before and after, and the validation bits per byte. A run is kept: the same
    functions are trained once per process."""
    key = (gating, step, steps, seed)
    if key not in _RUNS:
        _RUNS[key] = _fine_tune(gating, step, steps, seed)
    return _RUNS[key]


def _fine_tune(gating, step, steps, seed) -> dict:
    import torch
    import torch.nn.functional as F

    from infra_lab.model.torch_model import TorchTransformer
    from infra_lab.model.train import bits_per_byte

    loaded, config = _moe_weights()
    for i in range(config.n_layers):
        loaded[f"layers.{i}.router_bias"] = np.zeros_like(loaded[f"layers.{i}.router_bias"])
    torch.manual_seed(seed)
    model = TorchTransformer(config, loaded)
    before = balance(model)

    def choose(logits, k, bias):
        logits_np, bias_np = logits.numpy().astype(np.float32), bias.numpy().astype(np.float32)
        answer = gating(logits_np.copy(), k, bias_np.copy())
        compare_gating(logits_np, k, bias_np, answer)
        return torch.from_numpy(np.asarray(answer[0], np.int64))

    train_bytes, validation = _splits()
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAIN_LR,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    names = [f"layers.{i}.router_bias" for i in range(config.n_layers)]
    model.record_routing, model.choose_experts = True, choose
    try:
        for _ in range(steps):
            starts = rng.integers(0, len(train_bytes) - TRAIN_WINDOW - 1, size=TRAIN_BATCH)
            window = torch.from_numpy(np.stack([train_bytes[s:s + TRAIN_WINDOW + 1] for s in starts]).astype(np.int64))
            model.routings.clear()
            logits = model(window[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, config.vocab), window[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                biases = [model.w(name).numpy().copy() for name in names]
                chosen = [r.experts.numpy().copy() for r, _ in model.routings]
                new = compare_balance_step(biases, chosen, config.n_experts, BIAS_RATE,
                                           step([b.copy() for b in biases], [c.copy() for c in chosen],
                                                config.n_experts, BIAS_RATE))
                for name, bias in zip(names, new):
                    model.w(name).copy_(torch.from_numpy(bias.astype(np.float32)))
    finally:
        model.record_routing, model.choose_experts = False, None
        model.routings.clear()
    model.eval()
    return {"before": before, "after": balance(model), "bits_per_byte": bits_per_byte(model, validation, max_windows=8)}


@functools.cache
def _shipped_bits_per_byte() -> float:
    from infra_lab.model.torch_model import TorchTransformer
    from infra_lab.model.train import bits_per_byte

    loaded, config = _moe_weights()
    return bits_per_byte(TorchTransformer(config, loaded), _splits()[1], max_windows=8)


def drive_balance_step(function, kind, *case):
    """A step case: the reader's balance_step against the package's on random routings. The
    training case: the shipped MoE, its biases reset, trained with the top_k_gating defined
    beside balance_step choosing the experts and balance_step moving the biases."""
    if kind != "train the MoE":
        biases, experts_per_layer, n_experts, rate = case
        answer = function([b.copy() for b in biases], [e.copy() for e in experts_per_layer], n_experts, rate)
        compare_balance_step(biases, experts_per_layer, n_experts, rate, answer)
        return "biases", "one update_bias per layer"
    if function is balance_step:  # the reference: tests/test_ch09_checks.py trains with the package's own
        return _TRAINED
    gating = _partner(function, "top_k_gating")
    run = fine_tune(gating, function)
    worst = int(np.argmax(run["after"]))
    if not run["after"][worst] <= BALANCE_BAR:
        raise Unbalanced(f"after {TRAIN_STEPS} steps with your router, layer {worst}'s most loaded expert takes "
                         f"{run['after'][worst]:.3f}x the mean load on validation text (bar {BALANCE_BAR}; "
                         f"{run['before'][worst]:.3f}x with the biases at zero)")
    shipped = _shipped_bits_per_byte()
    if not run["bits_per_byte"] <= shipped + BPB_SLACK:
        raise Unbalanced(f"the fine-tuned model scores {run['bits_per_byte']:.3f} bits per byte, the shipped one "
                         f"{shipped:.3f}: more than {BPB_SLACK} worse")
    return _TRAINED


_TRAINED = ("trained", f"every layer within {BALANCE_BAR}x of the mean load", "bits per byte kept")


def _step_case(kind, rng):
    if kind == "train the MoE":
        return (kind,)
    n_experts, layers = int(rng.choice([4, 8, 16])), int(rng.integers(1, 5))
    k = int(rng.integers(1, min(4, n_experts) + 1))
    biases = [(rng.standard_normal(n_experts) * 0.05).astype(np.float32) for _ in range(layers)]
    experts = [np.stack([rng.choice(n_experts, k, replace=False, p=rng.dirichlet(np.ones(n_experts)))
                         for _ in range(int(rng.integers(1, 40)))]).astype(np.int64) for _ in range(layers)]
    return kind, biases, experts, n_experts, float(rng.choice([0.001, 0.01]))


_STEP_KINDS = ["plain"] * 23 + ["train the MoE"]

register(Check("ch09.top_k_gating", top_k_gating, Schedule(_GATING_KINDS, _gating_case), drive=drive_gating))
register(Check("ch09.switch_aux_loss", switch_aux_loss, Schedule(_AUX_KINDS, _aux_case), drive=drive_aux))
register(Check("ch09.dispatch", dispatch, Schedule(_DISPATCH_KINDS, _dispatch_case), drive=drive_dispatch))
register(Check("ch09.update_bias", update_bias, Schedule(_BIAS_KINDS, _bias_case), drive=drive_bias))
register(Check("ch09.balance_step", balance_step, Schedule(_STEP_KINDS, _step_case), drive=drive_balance_step))
