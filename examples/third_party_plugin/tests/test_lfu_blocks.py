"""lfu_blocks: corekv's backend conformance suite, plus the LFU eviction order."""
import pytest

from corekv.plugin import make_plugin_manager
from corekv.testing import BackendTests
from corekv.testing.backend import Request, make_key, tokens
from corekv_example_plugins.lfu_blocks import CappedLFU, LFUBlockBackend


class TestLFUBlocksConformance(BackendTests):
    def make_backend(self, num_blocks, block_size, **options):
        return LFUBlockBackend(num_blocks, block_size, **options)


class TestLFUBlocksCap1Conformance(BackendTests):
    """With ``frequency_cap=1`` every hit block ties, so LRU decides: still a conforming backend."""

    def make_backend(self, num_blocks, block_size, **options):
        return LFUBlockBackend(num_blocks, block_size, frequency_cap=1, **options)


def test_a_frequently_hit_prefix_survives_a_burst_that_lru_would_evict_it_for():
    bs = 4
    lfu = LFUBlockBackend(6, bs)
    system = tokens(2 * bs, start=100)
    for _ in range(3):  # the system prompt is hit twice after it is computed
        Request(lfu, system + [1]).finish()
    for start in (500, 600):  # then two one-off prompts, each needing two blocks
        Request(lfu, tokens(2 * bs, start=start)).finish()
    Request(lfu, tokens(2 * bs, start=700)).finish()  # a third: something must be evicted
    assert len(lfu.match(make_key(system, bs))) == 2
    assert lfu.hit_count(lfu.match(make_key(system, bs))[0]) == 2


def test_lru_breaks_ties_and_a_reallocated_block_starts_from_zero_hits():
    bs = 4
    b = LFUBlockBackend(4, bs)
    Request(b, tokens(bs + 1, start=100)).finish()
    Request(b, tokens(bs + 1, start=200)).finish()
    queue = [b.match(make_key(tokens(bs, start=s), bs))[0] for s in (100, 200)]  # release order
    assert all(b.hit_count(i) == 0 for i in queue)
    reused = b.allocate(3)  # two uncached blocks, then the oldest cached one
    assert reused[-1] == queue[0]
    assert b.match(make_key(tokens(bs, start=100), bs)) == []
    assert b.hit_count(reused[-1]) == 0


def test_hit_counts_stop_at_the_cap():
    bs = 2
    b = LFUBlockBackend(4, bs, frequency_cap=2)
    for _ in range(5):
        Request(b, tokens(bs) + [1]).finish()
    assert b.hit_count(b.match(make_key(tokens(bs), bs))[0]) == 2


def test_the_policy_orders_by_capped_hits_then_recency():
    from corekv.eviction import EntryStats

    policy = CappedLFU(frequency_cap=2)
    entries = [EntryStats(last_access=t, num_hits=h) for t, h in ((1, 5), (2, 0), (3, 2), (4, 0))]
    order = sorted(range(4), key=lambda i: policy.key(entries[i]))
    assert order == [1, 3, 0, 2]   # 0 hits first; 5 hits counts as 2, so recency decides


@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_frequency_cap_must_be_a_positive_int(cap):
    with pytest.raises(ValueError, match="frequency_cap must be an int >= 1"):
        LFUBlockBackend(4, 4, frequency_cap=cap)


def test_registered_through_the_entry_point():
    spec = make_plugin_manager(autoload=True).backends()["lfu_blocks"]
    assert spec.distribution == "corekv-example-plugins"
    backend = spec.factory(8, 4, frequency_cap=3)
    assert isinstance(backend, LFUBlockBackend) and backend.frequency_cap == 3
