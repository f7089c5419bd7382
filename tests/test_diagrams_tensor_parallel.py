"""diagrams.tensor_parallel: each rank's pieces are the package's own shards and products, the
partial sums add up to one process's output (float64, so the gap is rounding of a few terms), and
the picture draws exactly those values: a grid per matrix of the piece's shape, and the summed y
shaded as one process's y. Texts keep 9 pt, stay on the page and never overlap."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _figures import assert_legible
from _numerics import FP64_RELATIVE
from infra_lab.diagrams import tensor_parallel as diagram
from infra_lab.parallel import tensor


def mlp(t: int, d: int, h: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64)
            for shape in ((t, d), (d, h), (d, h), (h, d))]  # x, gate, up, down


def cells(figure, prefix: str) -> dict[tuple[int, int], tuple]:
    """{(i, j): facecolor} of the cells whose gid begins cell:{prefix}:."""
    found = {}
    for patch in figure.axes[0].patches:
        gid = patch.get_gid() or ""
        if gid.startswith(f"cell:{prefix}:"):
            i, j = map(int, gid.rsplit(":", 2)[1:])
            found[i, j] = patch.get_facecolor()
    return found


@pytest.mark.numerics
@settings(max_examples=30)
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from([1, 2, 3, 4]), st.integers(1, 3),
       st.integers(0, 100))
def test_the_ranks_pieces_are_the_package_shards_and_add_up_to_one_process(t, d, world, per_rank, seed):
    x, gate, up, down = mlp(t, d, world * per_rank, seed)
    pieces = diagram.mlp_pieces(x, gate, up, down, world)
    for rank, held in enumerate(pieces.ranks):
        assert torch.equal(held["gate"], tensor.shard_columns(gate, rank, world))
        assert torch.equal(held["up"], tensor.shard_columns(up, rank, world))
        assert torch.equal(held["down"], tensor.shard_rows(down, rank, world))
        assert held["partial"].shape == (t, d)
    # rank r's gated slice is columns r of one process's: the activation needs no communication
    assert torch.allclose(torch.cat([r["gated"] for r in pieces.ranks], dim=1), pieces.whole["gated"],
                          rtol=FP64_RELATIVE, atol=0)
    y = pieces.whole["y"]
    scale = float((pieces.whole["gated"].abs() @ down.abs()).max()) or 1.0  # the sum's terms' size
    assert float((pieces.summed - y).abs().max()) <= 4 * world * per_rank * FP64_RELATIVE * scale


@pytest.mark.parametrize("world, hidden", [(1, 6), (2, 6), (3, 6), (4, 4)])
def test_the_picture_draws_each_piece_and_stays_legible(world, hidden):
    x, gate, up, down = mlp(4, 4, hidden)
    pieces = diagram.mlp_pieces(x, gate, up, down, world)
    figure = diagram.draw_mlp(pieces)
    assert_legible(figure)
    for name, values in [("one process", pieces.whole)] + [(f"rank {r}", p) for r, p in enumerate(pieces.ranks)]:
        for piece in ("gate", "up", "gated", "down", "y" if name == "one process" else "partial"):
            rows, cols = values[piece].shape
            assert set(cells(figure, f"{name}:{piece}")) == {(i, j) for i in range(rows) for j in range(cols)}
    # g's output is shaded as one process's y, cell for cell: the same values on the same scale
    summed, whole = cells(figure, "g:y"), cells(figure, "one process:y")
    assert summed.keys() == whole.keys()
    assert np.allclose([summed[k] for k in sorted(summed)], [whole[k] for k in sorted(whole)], atol=1e-6)
    texts = {t.get_gid(): t.get_text() for t in figure.axes[0].texts}
    gap = float((pieces.summed - pieces.whole["y"]).abs().max())
    assert f"{gap:.0e}" in texts["gap"]
    assert sum(1 for gid in texts if gid and gid.startswith("f:")) == world
    assert sum(1 for p in figure.axes[0].patches if (p.get_gid() or "").startswith("share:")) == \
        (4 * world if world > 1 else 0)


def test_bad_input_is_named():
    x, gate, up, down = mlp(4, 4, 6)
    with pytest.raises(ValueError, match="cannot split 6 columns over 4 processes"):
        diagram.mlp_pieces(x, gate, up, down, 4)
    with pytest.raises(ValueError, match=r"expected x \(T, d\), gate and up \(d, h\), down \(h, d\); got x \(4, 4\), "
                                         r"gate \(4, 6\), up \(4, 6\), down \(4, 6\)"):
        diagram.mlp_pieces(x, gate, up, up, 2)
    x, gate, up, down = mlp(2, 2, 6)
    pieces = diagram.mlp_pieces(x, gate, up, down, 6)
    with pytest.raises(ValueError, match="draw 1 to 4 ranks; got 6"):
        diagram.draw_mlp(pieces)
    x, gate, up, down = mlp(2, 8, 16)
    with pytest.raises(ValueError, match="an MLP of width 8 and 16 hidden units does not fit"):
        diagram.draw_mlp(diagram.mlp_pieces(x, gate, up, down, 2))
