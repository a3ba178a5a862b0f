"""compressed_host: corekv's tier conformance suite, plus what compression adds."""
import numpy as np
import pytest

from corekv.plugin import make_plugin_manager
from corekv.testing import TierTests
from corekv.testing.tier import make_keys
from corekv.tier_factory import make_tier
from corekv_example_plugins.compressed_host import CompressedHostTier, shuffle_bytes, unshuffle_bytes

FINGERPRINT = b"example-plugin-model"


class TestCompressedHostConformance(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        # random test payloads do not compress: budget for 64 of them, whole
        return CompressedHostTier(size=64 * (block_bytes + 128), block_bytes=block_bytes,
                                  fingerprint=self.fingerprint)


class TestCompressedHostFloat32Conformance(TierTests):
    """The same suite with a float32 layout, so every entry goes through the byte shuffle.

    NOTE: the shape is 2-D because the suite's "foreign layout" entries include a flat float32
    one, which must stay foreign to the tier under test."""

    def make_tier(self, tmp_path, block_bytes):
        return CompressedHostTier(size=64 * (block_bytes + 128), level=3, block_bytes=block_bytes,
                                  fingerprint=self.fingerprint, dtype="float32",
                                  shape=(2, block_bytes // 8))


def smooth_float_block(n: int, seed: int) -> np.ndarray:
    """KV-like float32 values: similar magnitudes, so sign and exponent bytes repeat."""
    return np.random.default_rng(seed).normal(0.0, 1.0, n).astype(np.float32)


def float_tier(size=1 << 20, **options):
    return CompressedHostTier(size=size, block_bytes=4096, fingerprint=FINGERPRINT, dtype="float32",
                              shape=(1024,), **options)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_shuffle_is_a_bijection(width):
    data = np.random.default_rng(width).integers(0, 256, 64 * width, dtype=np.uint8).tobytes()
    assert unshuffle_bytes(shuffle_bytes(data, width), width) == data
    if width > 1:
        assert shuffle_bytes(data, width) != data


def test_float_kv_is_stored_smaller_than_it_is_and_reads_back_bit_exact():
    keys = make_keys(8)
    blocks = [smooth_float_block(1024, i) for i in range(8)]
    with float_tier() as tier:
        tier.put(list(zip(keys, blocks)))
        assert tier.used_bytes < 8 * tier.codec.entry_bytes
        assert tier.compression_ratio > 1.0
        got = tier.get(keys)
        assert all(np.array_equal(np.frombuffer(p, np.float32), b) for p, b in zip(got, blocks))


def test_the_shuffle_improves_the_ratio_on_float_kv():
    keys = make_keys(8)
    items = [(k, smooth_float_block(1024, i)) for i, k in enumerate(keys)]
    with float_tier(shuffle=True) as shuffled, float_tier(shuffle=False) as plain:
        shuffled.put(items)
        plain.put(items)
        assert shuffled.used_bytes < plain.used_bytes


def test_the_budget_counts_compressed_bytes_and_evicts_least_recently_used():
    keys = make_keys(40)
    with float_tier(size=20 * 4096) as tier:
        for i, key in enumerate(keys[:3]):
            tier.put_one(key, smooth_float_block(1024, i))
        tier.get_one(keys[0])  # touch the first: the second is now the oldest
        for i, key in enumerate(keys[3:], start=3):
            tier.put_one(key, smooth_float_block(1024, i))
            if tier.stats()["evictions"]:
                break
        assert tier.stats()["evictions"] == 1
        assert not tier.contains(keys[1]) and tier.contains(keys[0]) and tier.contains(keys[2])
        assert tier.used_bytes <= tier.capacity_bytes
        # it held more entries than the budget would hold uncompressed
        assert tier.num_entries > tier.capacity_bytes // tier.codec.entry_bytes


def test_a_damaged_record_is_a_counted_fault_and_removed():
    key = make_keys(1)[0]
    with float_tier() as tier:
        tier.put_one(key, smooth_float_block(1024, 0))
        record = bytearray(tier.key_to_record[key])
        record[len(record) // 2] ^= 0xFF
        tier.key_to_record[key] = bytes(record)
        assert tier.get_one(key) is None
        assert tier.stats()["faults"] == 1 and not tier.contains(key)


@pytest.mark.parametrize("options, message", [
    ({"size": 0}, "size must be a positive"),
    ({"size": 4096, "level": 0}, "level must be an int from 1"),
    ({"size": 4096, "level": 23}, "level must be an int from 1"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        CompressedHostTier(block_bytes=4096, fingerprint=FINGERPRINT, **options)


def test_registered_through_the_entry_point_and_built_by_make_tier():
    spec = make_plugin_manager(autoload=True).tiers()["compressed_host"]
    assert spec.distribution == "corekv-example-plugins"
    tier = make_tier(spec, {"size": 1 << 20}, block_bytes=4096, fingerprint=FINGERPRINT,
                     dtype="float32", shape=(1024,))
    assert isinstance(tier, CompressedHostTier) and tier.level == 1 and tier.shuffle_width == 4
    tier.close()
