"""hash_blocks: the conformance suite plus the vLLM free-queue behaviour."""
import pytest

from corekv.plugin import make_plugin_manager
from corekv.plugins.hash_blocks import HashBlockBackend
from corekv.testing import BackendTests
from corekv.testing.backend import Request, make_key, tokens


class TestHashBlocksConformance(BackendTests):
    def make_backend(self, num_blocks, block_size, **options):
        return HashBlockBackend(num_blocks, block_size, **options)


class TestHashBlocksLFUConformance(TestHashBlocksConformance):
    """The whole suite again under the lfu policy (and its order test)."""
    eviction = "lfu"


class TestHashBlocksPriorityConformance(TestHashBlocksConformance):
    """The whole suite again under the priority policy (and its order tests)."""
    eviction = "priority"


def test_free_queue_is_lru_released_tail_first_and_a_hit_is_touched_out():
    b = HashBlockBackend(4, 2)
    first = Request(b, [1, 2, 3, 4, 5])     # two full blocks and a partial one
    first.finish()
    full = first.table[:2]
    assert list(b._idle) == full[::-1]       # tail first: the second block is reused first
    second = Request(b, [1, 2, 3, 4, 9])
    assert second.hit == full and list(b._idle) == []  # touched out of the free queue
    second.finish()
    got = b.allocate(3)
    assert set(got[:2]) == set(range(4)) - set(full)  # uncached blocks go before cached ones
    assert got[2] == full[1]
    assert b.match(make_key([1, 2, 3, 4], 2)) == full[:1]


def test_a_freed_block_is_hit_until_it_is_reused():
    b = HashBlockBackend(3, 2)
    r = Request(b, [1, 2, 3, 4])
    r.finish()
    key = make_key([1, 2, 3, 4], 2)
    assert b.match(key) == r.table
    b.allocate(1)                           # the never-used block goes first
    assert b.match(key) == r.table          # a freed block is still hit
    assert b.allocate(1) == [r.table[1]]    # the tail block is the least recently released
    assert b.match(key) == r.table[:1]
    b.allocate(1)
    assert b.match(key) == []


def test_a_failing_write_back_leaves_the_cache_unchanged():
    b = HashBlockBackend(2, 2)
    r = Request(b, [1, 2, 3, 4])
    r.finish()

    def refuse(evicted):
        raise OSError("tier down")

    b.on_evict = refuse
    with pytest.raises(OSError):
        b.allocate(2)
    assert b.match(make_key([1, 2, 3, 4], 2)) == r.table and b.num_free_blocks == 2


def test_num_free_blocks_counts_free_and_idle_cached_blocks():
    b = HashBlockBackend(6, 2)
    held = Request(b, tokens(4))
    Request(b, tokens(4, start=50)).finish()
    assert b.num_free_blocks == 4 and b.num_cached_blocks == 4
    assert [b.ref_count(i) for i in held.table] == [1, 1]


def test_registered_through_the_corekv_entry_point():
    spec = make_plugin_manager().backends()["hash_blocks"]
    assert spec.factory is HashBlockBackend and "record_events" in spec.options
    assert isinstance(spec.factory(4, 16), HashBlockBackend)


def test_record_events_must_be_a_bool():
    with pytest.raises(TypeError, match="record_events"):
        HashBlockBackend(4, 16, record_events="yes")
