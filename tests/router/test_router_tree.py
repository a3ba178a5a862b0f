"""BlockTree, the router's view of one worker's cache: examples, then property tests that replay
random operations on the tree and on a naive oracle (a dict of paths) and compare every answer."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corekv.router.tree import BlockTree

BLOCK = 2


def test_match_counts_whole_blocks_on_the_inserted_path():
    tree = BlockTree(BLOCK)
    assert tree.insert([1, 2, 3, 4, 5]) == 2  # the partial block [5] is not cached by a worker
    assert tree.match([1, 2, 3, 4, 5, 6]) == 4
    assert tree.match([1, 2, 3, 9]) == 2
    assert tree.match([2, 1]) == 0
    assert tree.num_blocks == 2


def test_namespaces_never_share_a_path():
    tree = BlockTree(BLOCK)
    tree.insert([1, 2, 3, 4], "tenant-a")
    assert tree.match([1, 2, 3, 4], "tenant-b") == 0
    assert tree.match([1, 2, 3, 4], "tenant-a") == 4


def test_insert_evicts_least_recently_routed_leaves_first():
    tree = BlockTree(BLOCK, max_blocks=4)
    tree.insert([1, 1, 2, 2])          # path A: 2 blocks
    tree.insert([3, 3, 4, 4])          # path B: 2 blocks
    tree.insert([1, 1, 2, 2])          # A is used again, so B is now the oldest
    tree.insert([5, 5])                # one block too many: B's leaf goes
    assert tree.num_blocks == 4
    assert tree.match([1, 1, 2, 2]) == 4
    assert tree.match([3, 3, 4, 4]) == 2
    assert tree.match([5, 5]) == 2


def test_events_store_under_parent_and_remove_with_subtree():
    tree = BlockTree(BLOCK)
    assert tree.store([b"a", b"b"], None, [1, 2, 3, 4]) == 2
    assert tree.store([b"c"], b"b", [5, 6]) == 1
    assert tree.match([1, 2, 3, 4, 5, 6]) == 6
    assert tree.store([b"x"], b"unknown", [7, 8]) == 0  # its parent is not known: not placed
    assert tree.remove([b"b"]) == 2  # b and its child c: c cannot hit without b
    assert tree.match([1, 2, 3, 4, 5, 6]) == 2
    assert set(tree.hash_to_node) == {b"a"}
    assert tree.store([b"d"], b"c", [5, 6]) == 0  # c went with b


def test_chains_of_two_namespaces_never_share_a_path():
    tree = BlockTree(BLOCK)
    tree.store([b"a1", b"a2"], None, [1, 2, 3, 4], ("tenant-a",))
    tree.store([b"b1"], None, [1, 2], ("tenant-b",))   # equal tokens, another tenant
    tree.store([b"a3"], b"a2", [5, 6])                  # continues tenant a's chain
    assert tree.num_blocks == 4 and tree.stats()["namespaces"] == 2
    assert tree.match([1, 2, 3, 4, 5, 6], ("tenant-a",)) == 6
    assert tree.match([1, 2, 3, 4, 5, 6], ("tenant-b",)) == 2
    assert tree.match([1, 2], None) == 0
    tree.remove([b"a1"])
    assert tree.match([1, 2], ("tenant-a",)) == 0 and tree.match([1, 2], ("tenant-b",)) == 2


def test_a_path_named_by_two_hashes_stays_until_both_are_removed():
    tree = BlockTree(BLOCK)
    # equal tokens in one namespace, two hashes: keys this tree does not model went into them
    # (vLLM's multimodal hashes, say)
    tree.store([b"h1"], None, [1, 2])
    tree.store([b"h2"], None, [1, 2])
    assert tree.num_blocks == 1
    tree.remove([b"h1"])
    assert tree.match([1, 2]) == 2
    tree.remove([b"h2"])
    assert tree.match([1, 2]) == 0 and tree.num_blocks == 0


def test_store_rejects_token_counts_that_are_not_whole_blocks():
    tree = BlockTree(BLOCK)
    assert tree.store([b"a"], None, [1, 2, 3]) == 0
    assert tree.num_blocks == 0


def test_clear_forgets_everything():
    tree = BlockTree(BLOCK)
    tree.store([b"a"], None, [1, 2])
    tree.insert([3, 4], "s")
    tree.clear()
    assert tree.num_blocks == 0 and tree.match([1, 2]) == 0 and tree.stats()["namespaces"] == 0


@pytest.mark.parametrize("kwargs, match", [({"block_size": 0}, "block_size"),
                                           ({"block_size": 4, "max_blocks": 0}, "max_blocks")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockTree(**kwargs)


# -- property tests against oracles ---------------------------------------------------------------
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=8)  # a tiny alphabet: many shared prefixes


def _blocks(token_ids):
    return tuple(tuple(token_ids[i:i + BLOCK]) for i in range(0, len(token_ids) - BLOCK + 1, BLOCK))


class RoutedOracle:
    """Paths (tuples of blocks) with a last-use stamp; a path's prefixes are stamped leaf first."""

    def __init__(self, max_blocks):
        self.max_blocks, self.clock, self.stamp = max_blocks, 0, {}

    def insert(self, namespace, token_ids):
        blocks = _blocks(token_ids)
        for end in range(len(blocks), 0, -1):
            self.clock += 1
            self.stamp[(namespace, blocks[:end])] = self.clock
        while len(self.stamp) > self.max_blocks:
            del self.stamp[min(self.stamp, key=self.stamp.get)]

    def match(self, namespace, token_ids):
        blocks, n = _blocks(token_ids), 0
        while n < len(blocks) and (namespace, blocks[:n + 1]) in self.stamp:
            n += 1
        return n * BLOCK


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from([None, "s"]), tokens), max_size=40),
       max_blocks=st.integers(1, 6))
def test_routed_prompts_tree_agrees_with_an_lru_oracle(ops, max_blocks):
    tree, oracle = BlockTree(BLOCK, max_blocks=max_blocks), RoutedOracle(max_blocks)
    for is_insert, namespace, token_ids in ops:
        if is_insert:
            tree.insert(token_ids, namespace)
            oracle.insert(namespace, token_ids)
        assert tree.match(token_ids, namespace) == oracle.match(namespace, token_ids)
        assert tree.num_blocks == len(oracle.stamp) <= max_blocks


class EventsOracle:
    """Live hashes with the path each names, the path's first element being its namespace; a hash
    whose path lost a prefix is dropped."""

    def __init__(self):
        self.path_of = {}

    def store(self, hashes, parent, token_ids, namespace):
        if len(token_ids) != len(hashes) * BLOCK or not hashes:
            return
        if parent is not None and parent not in self.path_of:
            return
        path = (namespace,) if parent is None else self.path_of[parent]
        for h, block in zip(hashes, _blocks(token_ids)):
            if h in self.path_of:
                path = self.path_of[h]
                continue
            path = path + (block,)
            self.path_of[h] = path

    def remove(self, hashes):
        for h in hashes:
            self.path_of.pop(h, None)
        while True:
            live = set(self.path_of.values())
            dead = [h for h, p in self.path_of.items()
                    if any(p[:end] not in live for end in range(2, len(p)))]
            if not dead:
                return
            for h in dead:
                del self.path_of[h]

    def match(self, token_ids, namespace):
        blocks, live, n = _blocks(token_ids), set(self.path_of.values()), 0
        while n < len(blocks) and (namespace,) + blocks[:n + 1] in live:
            n += 1
        return n * BLOCK


hashes = st.integers(0, 11)
namespaces = st.sampled_from([None, ("tenant-a",), ("tenant-b",)])
event = st.one_of(
    st.tuples(st.just("store"), st.lists(hashes, min_size=1, max_size=3, unique=True),
              st.one_of(st.none(), hashes), st.lists(st.integers(0, 2), min_size=2, max_size=6),
              namespaces),
    st.tuples(st.just("remove"), st.lists(hashes, max_size=3)),
    st.tuples(st.just("clear")))


@settings(max_examples=300, deadline=None)
@given(events=st.lists(event, max_size=40), probes=st.lists(tokens, min_size=1, max_size=5))
def test_events_tree_agrees_with_a_path_oracle(events, probes):
    tree, oracle = BlockTree(BLOCK), EventsOracle()
    for e in events:
        if e[0] == "store":
            # NOTE: token ids drawn per event; whole blocks only when the lengths agree; the
            # namespace counts only for a chain's start (parent None)
            tree.store(e[1], e[2], e[3], e[4])
            oracle.store(e[1], e[2], e[3], e[4])
        elif e[0] == "remove":
            tree.remove(e[1])
            oracle.remove(e[1])
        else:
            tree.clear()
            oracle.path_of.clear()
        assert set(tree.hash_to_node) == set(oracle.path_of)
        assert tree.num_blocks == len(set(oracle.path_of.values()))
        paths = [(p[0], list(sum(p[1:], ()))) for p in oracle.path_of.values()]
        for namespace, probe in [(n, p) for p in probes for n in (None, ("tenant-a",))] + paths:
            assert tree.match(probe, namespace) == oracle.match(probe, namespace)
