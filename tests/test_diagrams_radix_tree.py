"""The radix-tree diagram is drawn from the live tree: every node, edge, lock count and LRU rank
on the picture equals a brute-force walk of the cache, and a split changes the picture."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from matplotlib.backends.backend_agg import FigureCanvasAgg

from infra_lab.diagrams import radix_tree
from infra_lab.kv.radix import RadixCache
from infra_lab.model import tokenizer

LETTERS = "abc"


def letters(key):
    return "".join(LETTERS[int(t)] for t in key)


def brute_force(cache):
    """{path of labels from the root: (lock count, LRU rank)} by recursion, ranks by sorting."""
    found = {}

    def visit(node, path):
        for child in node.children.values():
            found[path + (letters(child.key),)] = child
            visit(child, path + (letters(child.key),))

    visit(cache.root, ())
    stamps = sorted({node.last_access for node in found.values()})
    return {path: (node.lock_refs, stamps.index(node.last_access) + 1)
            for path, node in found.items()}


def drawn(figure):
    """The same map read back from the figure's artists (by their gids), with the edges."""
    ax = figure.axes[0]
    labels, infos = {}, {}
    for text in ax.texts:
        gid = text.get_gid() or ""
        if gid.startswith("label-"):
            k, parent = gid.removeprefix("label-").split("-of-")
            labels[int(k)] = (text.get_text(), int(parent))
        elif gid.startswith("info-"):
            infos[int(gid.removeprefix("info-"))] = text.get_text()
    dots = {int(p.get_gid().removeprefix("dot-")): p.center for p in ax.patches
            if (p.get_gid() or "").startswith("dot-")}
    edges = {int(line.get_gid().removeprefix("edge-")): line for line in ax.lines
             if (line.get_gid() or "").startswith("edge-")}
    assert sorted(labels) == sorted(infos) == sorted(edges) == sorted(set(dots) - {0})

    def path(k):
        return () if k == 0 else path(labels[k][1]) + (labels[k][0],)

    result = {}
    for k, info in infos.items():
        lock, rank = info.removeprefix("lock ").split(" \u00b7 LRU ")
        result[path(k)] = (int(lock), int(rank))
        xs, ys = edges[k].get_data()  # from the parent's dot to this node's dot
        assert (xs[0], ys[0]) == pytest.approx(dots[labels[k][1]])
        assert (xs[-1], ys[-1]) == pytest.approx(dots[k])
    return result


def overlapping_texts(figure):
    renderer = FigureCanvasAgg(figure).get_renderer()
    boxes = [t.get_window_extent(renderer) for t in figure.axes[0].texts if t.get_text()]
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


operations = st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
                                st.lists(st.integers(0, 2), min_size=1, max_size=6),
                                st.integers(0, 8)), max_size=14)


@settings(max_examples=30, deadline=None)
@given(operations=operations)
def test_the_drawing_is_the_tree(operations):
    cache, next_slot, held = RadixCache(), 0, []
    for op, tokens, n in operations:
        if op == "insert":
            cache.insert(tokens, np.arange(next_slot, next_slot + len(tokens)))
            next_slot += len(tokens)
        elif op == "match":
            cache.match_prefix(tokens)
        elif op == "lock":
            node = cache.match_prefix(tokens)[2]
            if node is not cache.root:
                cache.lock(node)
                held.append(node)
        elif op == "unlock" and held:
            cache.unlock(held.pop())
        elif op == "evict":
            cache.evict(n)
    figure = radix_tree.draw(cache, letters, title="a random tree")
    assert drawn(figure) == brute_force(cache)
    assert not overlapping_texts(figure)


def chapter_demo():
    cache, next_slot = RadixCache(), 0
    for text in ["Be brief. Q: 2+2?", "Be brief. Q: capital of Peru?", "Be brief. Q: 2+3?",
                 "Translate: cat"]:
        tokens = tokenizer.encode(text)
        cache.insert(tokens, np.arange(next_slot, next_slot + len(tokens)))
        next_slot += len(tokens)
    cache.lock(cache.match_prefix(tokenizer.encode("Be brief. Q: 2+3?"))[2])
    return cache


def show_text(key):
    return repr(tokenizer.decode(key))


def test_a_split_changes_the_picture():
    cache = chapter_demo()
    before = radix_tree.draw(cache, show_text)
    matched, _, upper = cache.match_prefix(tokenizer.encode("Be brave."))
    after = radix_tree.draw(cache, show_text, highlight=[upper], highlight_label="split")
    labels = [{t.get_text() for t in f.axes[0].texts if (t.get_gid() or "").startswith("label")}
              for f in (before, after)]
    assert matched == 5
    assert labels[1] - labels[0] == {"'Be br'", "'ief. Q: '"}
    assert labels[0] - labels[1] == {"'Be brief. Q: '"}
    for figure in (before, after):
        width, _ = figure.get_size_inches()
        assert width <= 7.0  # the chapter's trees show at natural size
        assert not overlapping_texts(figure)
    blue = [t.get_text() for t in after.axes[0].texts
            if t.get_color() == radix_tree.COLORS["highlight"]]
    assert blue == ["'Be br'"]  # the new upper node
    keys = {t.get_text() for f in (before, after) for t in f.axes[0].texts
            if (t.get_gid() or "").startswith("key-")}
    assert keys == {"locked by a request in flight", "split"}
    # the upper node inherits the lock of the path it was cut from
    assert drawn(after)[("'Be br'",)] == (1, 5)
    assert drawn(after)[("'Be br'", "'ief. Q: '")] == drawn(before)[("'Be brief. Q: '",)]


def test_long_runs_are_cut_and_an_empty_tree_is_a_root():
    cache = RadixCache()
    cache.insert(np.arange(40), np.arange(40))
    label = [t.get_text() for t in radix_tree.draw(cache).axes[0].texts
             if (t.get_gid() or "").startswith("label")]
    assert label == ["0 1 2 3 4 5 6 7 8 9 10 \u2026"]
    assert len(label[0]) == radix_tree.MAX_LABEL
    empty = radix_tree.draw(RadixCache())
    assert [t.get_text() for t in empty.axes[0].texts] == ["root"]
