"""The block-table diagram draws what the cache holds: read back from the drawn boxes, texts and
arrows by their positions, the picture equals the cache's tables and reference counts after any
sequence of operations, and fork, copy-on-write and free change it."""
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from infra_lab.diagrams import block_table  # noqa: E402
from infra_lab.kv.paged import OutOfBlocks, PagedKVCache  # noqa: E402


def inside(point, box: Rectangle, slack: float = 1e-6) -> bool:
    x, y = point
    return (box.get_x() - slack <= x <= box.get_x() + box.get_width() + slack
            and box.get_y() - slack <= y <= box.get_y() + box.get_height() + slack)


def read_back(figure):
    """What a reader sees: {(seq, index): block an arrow points at}, {(seq, index): number in the
    entry}, {block: refs written under it}, {block: fill colour}; all found by position."""
    ax = figure.axes[0]
    boxes = [p for p in ax.patches if isinstance(p, Rectangle) and (p.get_gid() or "").startswith(
        ("entry:", "block:"))]
    pool = [b for b in boxes if b.get_gid().startswith("block:")]
    entries = [b for b in boxes if b.get_gid().startswith("entry:")]

    def text_in(box):
        found = [t.get_text() for t in ax.texts if inside(t.get_position(), box)]
        assert len(found) == 1, (box.get_gid(), found)
        return int(found[0])

    def text_under(box):
        x = box.get_x() + box.get_width() / 2
        found = [t.get_text() for t in ax.texts if abs(t.get_position()[0] - x) < 1e-9
                 and t.get_position()[1] < box.get_y()]
        assert len(found) == 1, (box.get_gid(), found)
        return int(found[0])

    number = {b: text_in(b) for b in pool}
    written = {tuple(map(int, e.get_gid().split(":")[1:])): text_in(e) for e in entries}
    arrows = {}
    for arrow in (p for p in ax.patches if isinstance(p, FancyArrowPatch)):
        vertices = [v for polygon in arrow.get_path().to_polygons(closed_only=False)
                    for v in polygon]  # the shaft, then the head
        tail, tip = vertices[0], min(vertices, key=lambda v: v[1])
        [entry] = [e for e in entries if inside(tail, e)]
        [target] = [b for b in pool if inside(tip, b, slack=0.05)]
        key = tuple(map(int, entry.get_gid().split(":")[1:]))
        assert key not in arrows, key
        arrows[key] = number[target]
    refs = {number[b]: text_under(b) for b in pool}
    fills = {number[b]: matplotlib.colors.to_hex(b.get_facecolor()) for b in pool}
    return arrows, written, refs, fills


def assert_drawn_as_held(cache: PagedKVCache) -> None:
    figure = block_table.draw(cache)
    arrows, written, refs, fills = read_back(figure)
    plt.close(figure)
    held = {(seq, i): block for seq, table in cache.tables.items() for i, block in enumerate(table)}
    assert arrows == held
    assert written == held
    assert refs == dict(enumerate(cache.allocator.ref_counts))
    for block, colour in fills.items():
        state = block_table.block_state(cache, block)
        assert colour == matplotlib.colors.to_hex(block_table.FILL[state])
        count = cache.allocator.ref_counts[block]
        owners = sum(table.count(block) for table in cache.tables.values())
        assert count == owners  # the drawn count is the number of arrows into the block
        assert state == ("shared" if count > 1 else "one table" if count else state)


def svg(cache: PagedKVCache) -> str:
    figure = block_table.draw(cache)
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    plt.close(figure)
    return buffer.getvalue()


operations = st.lists(st.tuples(st.sampled_from(["new", "fork", "write", "free"]),
                                st.integers(0, 20), st.integers(1, 9)), max_size=8)


@settings(max_examples=25, deadline=None)
@given(ops=operations, block_size=st.sampled_from([1, 2, 4]), prefix=st.booleans())
def test_the_picture_equals_the_tables_after_any_operations(ops, block_size, prefix):
    cache = PagedKVCache(1, 1, 2, num_blocks=12, block_size=block_size, prefix_sharing=prefix)
    for op, pick, tokens in ops:
        live = sorted(cache.tables)
        try:
            if op == "new" or not live:
                seq = cache.new_sequence()
                cache.reserve(seq, tokens)
                cache.commit(seq, [t % 3 for t in range(tokens)])
            elif op == "fork" and len(live) < 5:
                cache.fork(live[pick % len(live)])
            elif op == "write":
                seq = live[pick % len(live)]
                cache.reserve(seq, tokens)
                cache.commit(seq, [t % 3 for t in range(tokens)])
            elif op == "free":
                cache.free(live[pick % len(live)])
        except OutOfBlocks:
            pass  # nothing changed: the picture must still match
        try:
            assert_drawn_as_held(cache)
        except ValueError as error:  # too many table entries to draw; never for the pool
            assert "rows of at most" in str(error)


def test_fork_copy_on_write_and_free_change_the_picture():
    cache = PagedKVCache(1, 1, 2, num_blocks=10, block_size=4)
    parent = cache.new_sequence()
    cache.reserve(parent, 10)
    cache.commit(parent, range(10))
    pictures = [svg(cache)]
    child = cache.fork(parent)
    pictures.append(svg(cache))
    arrows, _, refs, _ = read_back(block_table.draw(cache))
    assert [arrows[child, i] for i in range(3)] == [arrows[parent, i] for i in range(3)]
    assert [refs[b] for b in cache.tables[parent]] == [2, 2, 2]
    cache.reserve(child, 1)  # the shared last block is half full: copy-on-write
    cache.commit(child, [7])
    pictures.append(svg(cache))
    arrows, _, refs, _ = read_back(block_table.draw(cache))
    assert arrows[child, 2] != arrows[parent, 2]
    assert refs[arrows[parent, 2]] == 1 and refs[arrows[child, 2]] == 1
    cache.free(parent)
    pictures.append(svg(cache))
    assert len(set(pictures)) == len(pictures)
    assert_drawn_as_held(cache)
    plt.close("all")


def test_bad_input_is_named():
    cache = PagedKVCache(1, 1, 2, num_blocks=4, block_size=4)
    with pytest.raises(KeyError, match="sequence 3 is not live"):
        block_table.draw(cache, seqs=[3])
    big = PagedKVCache(1, 1, 2, num_blocks=block_table.MAX_BOXES + 1, block_size=4)
    with pytest.raises(ValueError, match=f"rows of at most {block_table.MAX_BOXES} boxes"):
        block_table.draw(big)
