"""radix: the conformance suite (page 4 and token granularity) plus tree behaviour."""
import pytest

from corekv.plugin import make_plugin_manager
from corekv.plugins.radix import RadixBackend
from corekv.testing import BackendTests
from corekv.testing.backend import Request, make_key, tokens


class TestRadixConformance(BackendTests):
    def make_backend(self, num_blocks, block_size, **options):
        return RadixBackend(num_blocks, block_size, **options)


class TestRadixTokenGranularConformance(TestRadixConformance):
    block_size = 1


class TestRadixLFUConformance(TestRadixConformance):
    """The whole suite again under the lfu policy (and its order test)."""
    eviction = "lfu"


class TestRadixPriorityConformance(TestRadixConformance):
    """The whole suite again under the priority policy (and its order tests)."""
    eviction = "priority"


class TestRadixTokenGranularLFUConformance(TestRadixTokenGranularConformance):
    eviction = "lfu"


def edges(node):
    """``{first token: (edge tokens, children edges)}`` below ``node``."""
    return {k: (c.key, edges(c)) for k, c in node.children.items()}


def test_a_diverging_insert_splits_the_edge_where_it_diverges():
    b = RadixBackend(16, 1)
    Request(b, [1, 2, 3, 4, 5]).finish()
    Request(b, [1, 2, 3, 9, 9]).finish()
    root = b._roots[make_key([], 1).namespace]
    assert edges(root) == {1: ([1, 2, 3], {4: ([4, 5], {}), 9: ([9, 9], {})})}


def test_edges_hold_whole_pages():
    bs = 4
    b = RadixBackend(16, bs)
    Request(b, tokens(3 * bs)).finish()
    Request(b, tokens(bs) + tokens(bs + 2, start=900)).finish()   # diverges inside page 2
    root = b._roots[make_key([], bs).namespace]
    (top,) = root.children.values()
    assert top.key == tokens(bs) and sorted(len(c.key) for c in top.children.values()) == [bs, 2 * bs]


def test_lock_refs_move_tokens_between_evictable_and_protected():
    b = RadixBackend(16, 1)
    Request(b, [1, 2, 3, 4, 5]).finish()
    Request(b, [1, 2, 3, 9, 9]).finish()
    held = Request(b, [1, 2, 3, 4, 7])           # hits [1, 2, 3, 4], computes 7
    assert held.num_hit_tokens == 4
    assert (b.evictable_size, b.protected_size) == (3, 5)   # [5], [9, 9] vs [1, 2, 3], [4], [7]
    held.finish()
    assert (b.evictable_size, b.protected_size) == (8, 0)


def test_only_unlocked_leaves_are_evicted_and_a_parent_follows_its_last_child():
    b = RadixBackend(8, 1)
    Request(b, [1, 2, 3, 4, 5]).finish()
    Request(b, [1, 2, 3, 9, 9]).finish()        # 7 cached tokens, one free slot
    held = Request(b, [1, 2, 3, 4, 5, 6])        # locks [1, 2, 3], [4, 5]; takes the free slot
    assert b.allocate(3) is None                  # only the leaf [9, 9] is unlocked
    assert b.allocate(2) is not None              # evicts the unlocked leaf [9, 9]
    assert b.match(make_key([1, 2, 3, 9, 9], 1)) == held.table[:3]
    held.finish()
    b.allocate(6)                                 # leaves go, then the parent [1, 2, 3]
    assert b.match(make_key([1, 2, 3, 4, 5, 6], 1)) == [] and b.num_cached_blocks == 0


def test_each_namespace_has_its_own_root():
    b = RadixBackend(16, 1)
    Request(b, [1, 2, 3], salt="a").finish()
    Request(b, [1, 2, 3], salt="b").finish()
    assert len(b._roots) == 2
    b.allocate(16)
    assert b._roots == {}                          # empty roots go with their last node


def test_an_index_only_tree_never_hashes():
    b = RadixBackend(64, 1, track_hashes=False, record_events=False)
    r = Request(b, tokens(40))
    r.finish()
    again = Request(b, tokens(40))
    assert again.num_hit_tokens == 39 and r.key._hashes == [] and again.key._hashes == []
    assert b.block_hash(r.table[0]) is None
    with pytest.raises(ValueError, match="track_hashes"):
        b.on_evict = lambda evicted: None


def test_events_need_hashes():
    with pytest.raises(ValueError, match="record_events=True needs track_hashes=True"):
        RadixBackend(4, 1, track_hashes=False)


def test_a_failing_write_back_leaves_the_tree_unchanged():
    b = RadixBackend(4, 2)
    r = Request(b, [1, 2, 3, 4])
    r.finish()

    def refuse(evicted):
        raise OSError("tier down")

    b.on_evict = refuse
    b.allocate(2)
    with pytest.raises(OSError):
        b.allocate(2)
    assert b.match(make_key([1, 2, 3, 4], 2)) == r.table and b.num_cached_blocks == 2


def test_acquiring_part_of_a_node_splits_it_so_refs_stay_per_node():
    b = RadixBackend(16, 1)
    r = Request(b, tokens(10))
    r.finish()
    hit = b.match(make_key(tokens(4), 1))
    b.acquire(hit)
    assert [b.ref_count(i) for i in r.table] == [1] * 4 + [0] * 6
    assert b.protected_size == 4 and b.evictable_size == 6
    b.free(hit)
    assert b.protected_size == 0


def test_registered_through_the_corekv_entry_point():
    spec = make_plugin_manager().backends()["radix"]
    assert spec.factory is RadixBackend and {"track_hashes", "record_events"} <= set(spec.options)
