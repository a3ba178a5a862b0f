"""fifo: corekv's backend and tier conformance suites under the policy, plus its order."""
import pytest

from corekv.block_format import HEADER_SIZE
from corekv.plugins.hash_blocks import HashBlockBackend
from corekv.plugins.radix import RadixBackend
from corekv.testing import BackendTests
from corekv.testing.backend import Request, make_key, tokens
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.tiers.host import HostTier
from corekv_example_plugins.fifo import FIFO


class TestRadixUnderFIFO(BackendTests):
    eviction = "fifo"

    def make_backend(self, num_blocks, block_size, **options):
        return RadixBackend(num_blocks, block_size, **options)

    @pytest.mark.skip(reason="FIFO does not evict the least recently used prefix")
    def test_eviction_takes_the_least_recently_used_prefix(self):
        pass


class TestHashBlocksUnderFIFO(TestRadixUnderFIFO):
    def make_backend(self, num_blocks, block_size, **options):
        return HashBlockBackend(num_blocks, block_size, **options)


class TestHostTierUnderFIFO(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        return HostTier(size=self.min_capacity_blocks * (block_bytes + HEADER_SIZE),
                        block_bytes=block_bytes, fingerprint=self.fingerprint, eviction="fifo")


@pytest.mark.parametrize("backend_type", [RadixBackend, HashBlockBackend])
def test_the_oldest_prefix_goes_first_however_often_it_was_hit(backend_type):
    bs = 4
    b = backend_type(6, bs, eviction=FIFO())
    old = tokens(2 * bs, start=100)
    Request(b, old + [1]).finish()
    Request(b, tokens(2 * bs, start=500)).finish()
    for _ in range(3):
        Request(b, old + [1]).finish()   # hit again and again: LRU and LFU would keep it
    Request(b, tokens(2 * bs, start=900)).finish()
    assert b.allocate(2) is not None
    assert b.match(make_key(old, bs)) == []
    assert len(b.match(make_key(tokens(2 * bs, start=500), bs))) == 2


def test_a_full_host_tier_drops_the_first_stored_entry_even_when_just_read():
    tier = HostTier(size=3 * (256 + HEADER_SIZE), block_bytes=256, fingerprint=b"m", eviction=FIFO())
    a, b, c, d = make_keys(4)
    tier.put([(k, block_payload(k, 256)) for k in (a, b, c)])
    tier.get([a])
    tier.put([(d, block_payload(d, 256))])
    assert [p is not None for p in tier.get([a, b, c, d])] == [False, True, True, True]
