"""The router's prefix tree against a brute-force model: the longest common prefix with the
strings still held, and the tree's invariants after every step."""
import pytest
from hypothesis import given, settings, strategies as st

from infra_lab.orchestration.prefix_tree import PrefixTree


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_match(held, text: str) -> int:
    return max((common_prefix(s, text) for s in held), default=0)


def prefixes(strings) -> set:
    return {s[:i] for s in strings for i in range(1, len(s) + 1)}


def check_invariants(tree: PrefixTree) -> None:
    chars, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first, "a child is filed under its edge's first character"
            assert child.parent is node
            assert child.last_used <= node.last_used, "a parent is used whenever a child is"
            if node is not tree.root:
                assert len(node.children) != 1, "an inner node with one child should have merged with it"
            chars += len(child.edge)
            stack.append(child)
    assert chars == tree.total_chars
    # compressed: the characters held are exactly the distinct prefixes of the texts held
    assert len(prefixes(tree.texts())) == tree.total_chars


text = st.text(alphabet="abc", max_size=10)
operations = st.lists(st.tuples(st.sampled_from(["insert", "insert", "match", "evict"]), text, st.integers(0, 30)),
                      min_size=1, max_size=40)


@settings(max_examples=300)
@given(ops=operations)
def test_random_sequences_agree_with_brute_force(ops):
    tree = PrefixTree()
    inserted: list[str] = []  # everything ever inserted
    last = None  # the most recently inserted text
    for op, s, limit in ops:
        held = tree.texts()
        if op == "insert":
            tree.insert(s)
            inserted.append(s)
            last = s
            assert tree.match(s) == len(s)
            assert prefixes(tree.texts()) == prefixes(held) | prefixes([s]), "an insert adds exactly its prefixes"
        elif op == "match":
            assert tree.match(s) == brute_match(held, s)
            assert tree.texts() == held, "a match changes nothing"
        else:
            before = tree.total_chars
            # the most recently used text stays while the tree's shortest text through it fits
            needed = min((len(t) for t in held if last is not None and t.startswith(last)), default=None)
            dropped = tree.evict(limit)
            assert dropped == before - tree.total_chars
            assert tree.total_chars <= limit
            if before <= limit:
                assert tree.texts() == held, "nothing to evict under the limit"
            assert prefixes(tree.texts()) <= prefixes(held), "eviction only forgets"
            if needed is not None and needed <= limit:
                assert tree.match(last) == len(last), "the most recently used text goes last"
            elif last is not None and tree.match(last) < len(last):
                last = None
        check_invariants(tree)
        for probe in [s, *inserted[-3:]]:
            assert tree.match(probe) == brute_match(tree.texts(), probe)
    assert prefixes(tree.texts()) <= prefixes(inserted)


def test_without_eviction_the_tree_holds_every_prefix_inserted():
    tree = PrefixTree()
    for s in ["hello world", "hello there", "help", "hello"]:
        tree.insert(s)
    assert tree.texts() == ["hello there", "hello world", "help"]
    assert tree.total_chars == len(prefixes(["hello world", "hello there", "help"]))
    assert tree.match("hello, you") == 5
    assert tree.match("xyz") == 0
    assert tree.match("") == 0
    assert tree.nodes() == 5  # "hel" -> {"lo " -> {"world", "there"}, "p"}


def test_eviction_drops_the_least_recently_used_leaf_first():
    tree = PrefixTree()
    tree.insert("system: be brief. question one")
    tree.insert("system: be brief. question two")
    tree.insert("another prompt entirely")
    tree.insert("system: be brief. question one")  # used again: now newer than "two"
    tree.evict(tree.total_chars - 1)
    assert tree.texts() == ["another prompt entirely", "system: be brief. question one"]
    tree.evict(len("system: be brief. question one"))
    assert tree.texts() == ["system: be brief. question one"]
    tree.evict(0)
    assert tree.texts() == [] and tree.total_chars == 0


def test_bad_arguments_name_the_value():
    tree = PrefixTree()
    with pytest.raises(ValueError, match="max_chars must be >= 0; got -1"):
        tree.evict(-1)
    with pytest.raises(TypeError, match="text must be a str; got bytes"):
        tree.insert(b"abc")
    assert tree.total_chars == 0
