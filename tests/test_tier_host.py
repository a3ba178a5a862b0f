"""The host tier: a preallocated CPU arena with its own LRU (plus the shared conformance suite)."""
import pytest
import torch

from corekv.block_format import HEADER_SIZE
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.tier_factory import make_tier
from corekv.tiers.host import HostTier


class TestHostTier(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        return HostTier(size=self.min_capacity_blocks * (block_bytes + HEADER_SIZE), block_bytes=block_bytes,
                        fingerprint=self.fingerprint, eviction=self.eviction)


class TestHostTierLFU(TestHostTier):
    eviction = "lfu"


class TestHostTierPriority(TestHostTier):
    """Priorities live in the eviction queue's per-entry stats."""
    eviction = "priority"


def small_host(num_slots, block_bytes=256):
    return HostTier(size=num_slots * (block_bytes + HEADER_SIZE), block_bytes=block_bytes, fingerprint=b"m")


def test_the_arena_is_allocated_once_and_pinned_only_with_cuda():
    tier = small_host(4)
    assert tier.arena.shape == (4, 256 + HEADER_SIZE) and tier.arena.dtype == torch.uint8
    assert tier.is_pinned == torch.cuda.is_available()
    arena_ptr = tier.arena.data_ptr()
    keys = make_keys(10)
    tier.put([(k, block_payload(k, 256)) for k in keys])
    assert tier.arena.data_ptr() == arena_ptr and tier.capacity_bytes == 4 * (256 + HEADER_SIZE)


def test_lru_evicts_the_least_recently_used_block():
    tier = small_host(3)
    a, b, c, d = make_keys(4)
    tier.put([(k, block_payload(k, 256)) for k in (a, b, c)])
    tier.get([a])  # a becomes the most recent; b is now the oldest
    tier.put([(d, block_payload(d, 256))])
    assert [p is not None for p in tier.get([a, b, c, d])] == [True, False, True, True]
    assert tier.stats()["evictions"] == 1 and tier.num_entries == 3


def test_a_payload_read_stays_valid_after_its_slot_is_reused():
    tier = small_host(1)
    a, b = make_keys(2)
    tier.put_one(a, block_payload(a, 256))
    held = tier.get_one(a)
    tier.put_one(b, block_payload(b, 256))
    assert bytes(held) == block_payload(a, 256)


def test_size_below_one_block_names_the_option():
    with pytest.raises(ValueError, match=rf"size must be at least one block entry \({256 + HEADER_SIZE} bytes\), got 100"):
        HostTier(size=100, block_bytes=256, fingerprint=b"m")


def test_registered_as_a_plugin_and_built_by_make_tier():
    spec = make_plugin_manager().tiers()["host"]
    tier = make_tier(spec, {"size": 10_000}, block_bytes=64, fingerprint=b"m", dtype="float32",
                     shape=(16,))
    assert isinstance(tier, HostTier) and tier.num_slots == 10_000 // (64 + HEADER_SIZE)
    assert spec.plugin == "host"
