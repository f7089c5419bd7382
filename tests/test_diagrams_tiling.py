"""The tiling diagram is drawn from the online softmax it runs: other inputs or another tile
size change the picture, and its last running state is the row's softmax normalizer."""
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab.diagrams import tiling


def qkv(seed, n, d=8):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(d) * 2, rng.standard_normal((n, d)), rng.standard_normal((n, d))


def texts(figure, prefix=""):
    return [t.get_text() for ax in figure.axes for t in ax.texts
            if (t.get_gid() or "").startswith(prefix)]


def running_states(figure):
    """(m, l) of every running box, left to right, read back from the drawn text."""
    found = []
    for text in texts(figure, "running"):
        m, l = re.fullmatch(r"m = (\S+)\nℓ = (\S+)", text).groups()
        found.append((float(m), float(l)))
    return found


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(4, 16), tiles=st.integers(1, 4))
def test_the_drawn_final_state_is_the_softmax_normalizer(seed, n, tiles):
    tile = max(2, -(-n // tiles))
    q, k, v = qkv(seed, n)
    figure = tiling.draw(q, k, v, tile)
    scores = k @ q / math.sqrt(len(q))
    states = running_states(figure)
    assert len(states) == -(-n // tile)  # one running box per tile
    final_max, final_sum = states[-1]
    assert final_max == pytest.approx(scores.max(), abs=0.006)  # drawn with 2 decimals
    assert final_sum == pytest.approx(np.exp(scores - scores.max()).sum(), rel=1e-3)
    maxima = [m for m, _ in states]
    assert maxima == sorted(maxima)  # a running max never falls


def test_other_inputs_or_another_tile_size_change_the_picture():
    q, k, v = qkv(0, 12)
    picture = texts(tiling.draw(q, k, v, 4))
    assert texts(tiling.draw(q, k, v, 3)) != picture
    assert texts(tiling.draw(q * 0.5, k, v, 4)) != picture
    assert texts(tiling.draw(q, k[::-1], v, 4)) != picture


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), tile=st.integers(1, 40))
def test_steps_merge_to_one_softmax(seed, n, tile):
    tile = min(tile, n)
    rng = np.random.default_rng(seed)
    scores, values = rng.standard_normal(n) * 5, rng.standard_normal((n, 3))
    found = tiling.steps(scores, values, tile)
    assert [s.first for s in found] == list(range(0, n, tile))
    for step in found:  # each running state covers the prefix of the row up to its tile
        prefix = scores[:step.last]
        assert step.running_max == prefix.max()
        assert step.running_sum == pytest.approx(np.exp(prefix - prefix.max()).sum(), rel=1e-12)
        assert step.rescale == pytest.approx(
            math.exp(scores[:step.first].max() - prefix.max()) if step.first else 1.0)
    weights = np.exp(scores - scores.max())
    np.testing.assert_allclose(found[-1].running_acc / found[-1].running_sum,
                               weights @ values / weights.sum(), rtol=1e-10, atol=1e-12)


def test_bad_inputs_are_named():
    q, k, v = qkv(0, 12)
    with pytest.raises(ValueError, match="got 12 keys in tiles of 1"):
        tiling.draw(q, k, v, 1)
    with pytest.raises(ValueError, match="got 12 keys in tiles of 2"):
        tiling.draw(q, k, v, 2)  # six tiles do not fit the page
    with pytest.raises(ValueError, match=r"need q \(D,\)"):
        tiling.draw(q[:3], k, v, 4)
    with pytest.raises(ValueError, match="tile must be in"):
        tiling.steps(k @ q, v, 0)
