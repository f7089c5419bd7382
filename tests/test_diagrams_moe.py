"""Chapter 09's diagrams draw what the objects hold: read back from the drawn boxes by their gids,
the routing grid is the routing (choices, ranks, drops and loads), the permutation's arrows are
slot_of, and the all-to-all's segments are the send counts, each landing where it is received. The
balancing figure's columns are the loads the package routes with no balancing, with the Switch
loss's offset, with update_bias's bias and under EPLB's placement; its ratios are theirs."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from infra_lab.diagrams import moe as moe_diagrams  # noqa: E402
from infra_lab.moe import dispatch, placement, routing  # noqa: E402
from infra_lab.moe import torch_moe  # noqa: E402, F401  (balance's aux loss: torch loads at collection, once)


def gids(figure, prefix: str) -> list[list[str]]:
    found = []
    for ax in figure.axes:
        for artist in list(ax.patches) + list(ax.texts) + list(ax.lines):
            gid = artist.get_gid() or ""
            if gid.startswith(prefix + ":"):
                found.append(gid.split(":")[1:])
    return found


def a_routing(seed: int, tokens: int, n_experts: int, k: int, factor):
    logits = np.random.default_rng(seed).standard_normal((tokens, n_experts)).astype(np.float32) * 2
    return routing.route(logits, k, factor)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), tokens=st.integers(1, 24), n_experts=st.sampled_from([4, 8]),
       k=st.integers(1, 3), factor=st.sampled_from([None, 0.5, 1.0]))
def test_the_routing_grid_is_the_routing(seed, tokens, n_experts, k, factor):
    chosen = a_routing(seed, tokens, n_experts, k, factor)
    slots = routing.capacity(tokens, n_experts, k, factor)
    figure = moe_diagrams.draw_routing(chosen, np.arange(tokens) + 97, slots)
    cells = {(int(t), int(e)): int(j) for t, e, j in gids(figure, "choice")}
    assert cells == {(t, int(chosen.experts[t, j])): j for t in range(tokens) for j in range(k)}
    marks = {(int(t), int(e)): state for t, e, state in gids(figure, "mark")}
    assert marks == {(t, int(chosen.experts[t, j])): "kept" if chosen.kept[t, j] else "dropped"
                     for t in range(tokens) for j in range(k)}
    bars = figure.axes[1].patches
    kept = {int(g.split(":")[1]): p.get_width() for p in bars if (g := p.get_gid() or "").startswith("kept:")}
    assert kept == {e: routing.expert_loads(chosen.experts, chosen.kept, n_experts)[e] for e in range(n_experts)}
    plt.close(figure)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), tokens=st.integers(1, 12), k=st.integers(1, 3),
       factor=st.sampled_from([None, 0.75]))
def test_the_permutations_arrows_are_the_inverse_permutation(seed, tokens, k, factor):
    plan = dispatch.plan(a_routing(seed, tokens, 6, k, factor), 6)
    figure = moe_diagrams.draw_permutation(plan)
    arrows = {(int(t), int(j)): int(row) for t, j, row in gids(figure, "arrow")}
    assert arrows == {(t, j): int(plan.slot_of[t, j]) for t in range(tokens) for j in range(k)
                      if plan.slot_of[t, j] >= 0}
    rows = {int(r): (int(token), int(e)) for r, token, e in gids(figure, "row")}
    experts_of_rows = np.repeat(np.arange(6), plan.counts)
    assert rows == {r: (int(plan.tokens[r]), int(experts_of_rows[r])) for r in range(len(plan.tokens))}
    plt.close(figure)


@settings(max_examples=15, deadline=None)
@given(counts=st.integers(2, 4).flatmap(lambda n: st.lists(st.lists(st.integers(0, 50), min_size=n, max_size=n),
                                                              min_size=n, max_size=n)))
def test_the_all_to_all_draws_every_segment_where_it_is_sent_and_received(counts):
    counts = np.array(counts)
    figure = moe_diagrams.draw_all_to_all(counts, bytes_per_row=512)
    sent = {(int(r), int(s)): int(n) for r, s, n in gids(figure, "send")}
    received = {(int(r), int(s)): int(n) for s, r, n in gids(figure, "receive")}
    expected = {(r, s): int(counts[r, s]) for r in range(len(counts)) for s in range(len(counts)) if counts[r, s]}
    assert sent == received == expected
    boxes = {p.get_gid(): p for p in figure.axes[0].patches}
    for (r, s), n in expected.items():  # to scale, and a receive buffer holds the sources in rank order
        send, got = boxes[f"send:{r}:{s}:{n}"], boxes[f"receive:{s}:{r}:{n}"]
        assert send.get_width() == pytest.approx(got.get_width())
        assert got.get_y() == pytest.approx(s) and send.get_y() == pytest.approx(r)
    crossing = int(counts.sum() - np.trace(counts))
    assert f"{crossing:,} rows ({crossing * 512 / 1e3:,.1f} kB)" in figure.axes[0].get_title()
    plt.close(figure)


def test_what_cannot_be_drawn_is_named():
    chosen = a_routing(0, 40, 8, 2, None)
    with pytest.raises(ValueError, match="at most 32 tokens"):
        moe_diagrams.draw_routing(chosen, np.arange(40), None)
    with pytest.raises(ValueError, match="at most 40 assignments"):
        moe_diagrams.draw_permutation(dispatch.plan(a_routing(0, 30, 8, 2, None), 8))
    with pytest.raises(ValueError, match="square"):
        moe_diagrams.draw_all_to_all(np.ones((2, 3)), 4)


def a_balancing(seed: int, n_experts: int, k: int, steps: int = 5):
    """Router logits with a preference per expert, as a trained router has: fitting and shown tokens."""
    rng = np.random.default_rng(seed)
    preference = rng.standard_normal(n_experts) * 1.5
    fit, shown = (preference + rng.standard_normal((tokens, n_experts)) for tokens in (192, 160))
    return moe_diagrams.balance(fit, shown, k, steps=steps), fit.astype(np.float32), shown.astype(np.float32)


def text_boxes(figure) -> list:
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    texts = [t for ax in figure.axes for t in list(ax.texts) + [ax.title] if t.get_text()]
    return [(t.get_text(), t.get_fontsize(), t.get_window_extent(renderer)) for t in texts]


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 1000), n_experts=st.sampled_from([4, 8]), k=st.integers(1, 2))
def test_the_balancing_panels_are_the_packages_loads(seed, n_experts, k):
    balanced, fit, shown = a_balancing(seed, n_experts, k)
    bias = np.zeros(n_experts, np.float32)  # the bias is `steps` calls of update_bias on the fitting tokens
    for _ in range(balanced.steps):
        chosen = routing.route(fit, k, bias=bias)
        bias = routing.update_bias(bias, routing.expert_loads(chosen.experts, chosen.kept, n_experts), 0.005)
    np.testing.assert_array_equal(balanced.bias, bias)
    routed = {"none": routing.route(shown, k), "aux": routing.route(shown + balanced.offset, k),
              "bias": routing.route(shown, k, bias=bias)}
    assert balanced.aux_loss[0] == pytest.approx(routing.switch_aux_loss(routed["none"].probs, routed["none"].experts))
    figure = moe_diagrams.draw_balancing(balanced, gpus=2, replicas=n_experts + 2)
    boxes = {p.get_gid(): p for ax in figure.axes for p in ax.patches if p.get_gid()}
    lines = {ln.get_gid(): ln for ax in figure.axes for ln in ax.lines if ln.get_gid()}
    texts = {t.get_gid(): t.get_text() for ax in figure.axes for t in ax.texts if t.get_gid()}
    for method, chosen in routed.items():
        loads = routing.expert_loads(chosen.experts, chosen.kept, n_experts)
        for e in range(n_experts):
            assert boxes[f"load:{method}:{e}:{loads[e]}"].get_height() == pytest.approx(loads[e] / loads.mean())
        assert texts[f"ratio:{method}"] == f"max/mean {loads.max() / loads.mean():.2f}"
        np.testing.assert_allclose(lines[f"probability:{method}"].get_ydata(), chosen.probs.mean(0) * n_experts,
                                   rtol=1e-6)
    # the bias moves only the choice: its probabilities are the unbalanced router's
    np.testing.assert_array_equal(lines["probability:bias"].get_ydata(), lines["probability:none"].get_ydata())
    unbalanced = routing.expert_loads(routed["none"].experts, routed["none"].kept, n_experts)[None]
    unbalanced_fit = routing.route(fit, k)
    placed = placement.place(routing.expert_loads(unbalanced_fit.experts, unbalanced_fit.kept, n_experts)[None],
                             n_experts + 2, gpus=2)
    eplb, plain = placement.gpu_loads(unbalanced, placed, 2)[0], placement.contiguous_loads(unbalanced, 2)[0]
    for g in range(2):
        stacked = sum(p.get_height() for gid, p in boxes.items() if gid.startswith(f"replica:{g}:"))
        assert stacked == pytest.approx(eplb[g] / eplb.mean())
        assert boxes[f"plain:{g}:{plain[g]:g}"].get_height() == pytest.approx(plain[g] / plain.mean())
    assert texts["ratio:eplb"] == f"max/mean {eplb.max() / eplb.mean():.2f}; plain {plain.max() / plain.mean():.2f}"
    shown_texts = text_boxes(figure)
    assert min(size for _, size, _ in shown_texts) >= 9
    assert not [(a, b) for i, (a, _, x) in enumerate(shown_texts) for b, _, y in shown_texts[i + 1:] if x.overlaps(y)]
    plt.close(figure)


def test_what_cannot_be_balanced_or_drawn_is_named():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="same experts"):
        moe_diagrams.balance(rng.standard_normal((32, 8)), rng.standard_normal((32, 4)), 2)
    with pytest.raises(ValueError, match="steps must be an integer >= 1; got 0"):
        moe_diagrams.balance(rng.standard_normal((32, 8)), rng.standard_normal((32, 8)), 2, steps=0)
    with pytest.raises(ValueError, match="rate must be a number >= 0; got -0.1"):
        moe_diagrams.balance(rng.standard_normal((32, 8)), rng.standard_normal((32, 8)), 2, rate=-0.1)
    with pytest.raises(ValueError, match="experts per token k"):
        moe_diagrams.balance(rng.standard_normal((32, 8)), rng.standard_normal((32, 8)), 9)
    wide = moe_diagrams.balance(rng.standard_normal((32, 17)), rng.standard_normal((32, 17)), 2, steps=1)
    with pytest.raises(ValueError, match="at most 16 experts; got 17"):
        moe_diagrams.draw_balancing(wide)
    balanced, _, _ = a_balancing(0, 8, 2, steps=1)
    with pytest.raises(ValueError, match="3 GPUs must divide the 10 replicas"):
        moe_diagrams.draw_balancing(balanced, gpus=3, replicas=10)
    with pytest.raises(ValueError, match="gpus must be an integer >= 1; got 0"):
        moe_diagrams.draw_balancing(balanced, gpus=0)
