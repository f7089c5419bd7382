"""Chapter 09's diagrams draw what the objects hold: read back from the drawn boxes by their gids,
the routing grid is the routing (choices, ranks, drops and loads), the permutation's arrows are
slot_of, and the all-to-all's segments are the send counts, each landing where it is received."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from infra_lab.diagrams import moe as moe_diagrams  # noqa: E402
from infra_lab.moe import dispatch, routing  # noqa: E402


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
