"""``TierTests``: the conformance suite every storage tier's tests subclass.

Usage (a third-party tier does exactly what corekv's own tests do)::

    from corekv.testing.tier import TierTests

    class TestMyTier(TierTests):
        def make_tier(self, tmp_path, block_bytes):
            return MyTier(..., block_bytes=block_bytes, fingerprint=self.fingerprint)

``make_tier`` must return a fresh, empty tier holding at least ``min_capacity_blocks`` blocks of
``block_bytes``; the suite closes it. A tier that takes an eviction policy passes the class
attribute ``eviction`` to it; subclass once per policy (``eviction = "lfu"``) so every policy runs
the whole suite, with the LFU and priority order tests run only under ``lfu`` and ``priority``
(the priority one only for a tier that ``keeps_priorities``). Tampering tests write raw entries
through the tier's own primitives (``_delete_entries`` then ``_write_entries``), so they work for
any store.

It stays one module past ~350 lines because it is one suite that a tier must pass whole: split
into several, a tier's tests would have to subclass each part and could miss one.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from corekv.block_format import HEADER_SIZE, EntryCodec
from corekv.hashing import block_hashes, chain_seed
from corekv.tier import Tier


#: the integrity secret of the keyed-tier tests (any 16-64 bytes)
SECRET = b"corekv-testing-integrity-secret!"


def block_payload(key: bytes, block_bytes: int) -> bytes:
    """Deterministic bytes for ``key``: a test can tell every block's payload from every other's."""
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8).tobytes()


def make_keys(n: int, salt: str = "", fingerprint: str = "testing-model") -> list[bytes]:
    """``n`` chained keys of one prompt, the way the engine makes them."""
    seed = chain_seed(fingerprint, 4, cache_salt=salt)
    return block_hashes(list(range(1000, 1000 + 4 * n)), 4, seed)


def replace_raw(tier: Tier, key: bytes, entry: bytes) -> None:
    """Put ``entry`` (any bytes, valid or not) under ``key``, bypassing encoding."""
    tier._delete_entries([key])
    tier._write_entries([(key, (entry,))])


class TierTests:
    """Behaviour every :class:`corekv.tier.Tier` must have; subclass and define ``make_tier``."""

    block_bytes = 4096
    fingerprint = b"corekv-testing-model-fingerprint"
    min_capacity_blocks = 32
    #: the eviction policy ``make_tier`` passes to the tier (``None``: the tier's default)
    eviction: str | None = None

    def make_tier(self, tmp_path, block_bytes: int) -> Tier:
        raise NotImplementedError("subclasses of TierTests define make_tier(tmp_path, block_bytes)")

    @pytest.fixture
    def tier(self, tmp_path):
        tier = self.make_tier(tmp_path, self.block_bytes)
        yield tier
        tier.close()

    # ------------------------------------------------------------------ round trips
    def test_put_then_get_returns_the_same_bytes(self, tier):
        keys = make_keys(4)
        assert tier.put([(k, block_payload(k, self.block_bytes)) for k in keys]) == 4
        assert [bytes(p) for p in tier.get(keys)] == [block_payload(k, self.block_bytes) for k in keys]

    def test_get_keeps_order_and_misses_are_none(self, tier):
        stored, absent = make_keys(3), make_keys(2, salt="absent")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in stored])
        got = tier.get([absent[0], stored[2], absent[1], stored[0]])
        assert got[0] is None and got[2] is None
        assert bytes(got[1]) == block_payload(stored[2], self.block_bytes)
        assert bytes(got[3]) == block_payload(stored[0], self.block_bytes)
        assert tier.get([]) == []

    def test_get_into_copies_hits_into_the_callers_buffers(self, tier):
        stored, absent = make_keys(2), make_keys(1, salt="absent")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in stored])
        out = np.full((3, self.block_bytes), 7, dtype=np.uint8)
        assert tier.get_into([stored[1], absent[0], stored[0]], list(out)) == [True, False, True]
        assert out[0].tobytes() == block_payload(stored[1], self.block_bytes)
        assert (out[1] == 7).all(), "a miss wrote into its buffer"
        assert out[2].tobytes() == block_payload(stored[0], self.block_bytes)
        stats = tier.stats()
        assert (stats["hits"], stats["misses"], stats["bytes_read"]) == (2, 1, 2 * self.block_bytes)

    def test_get_into_rejects_a_bad_entry_without_touching_the_buffer(self, tier):
        key = make_keys(1)[0]
        entry = bytearray(tier.codec.encode(key, block_payload(key, self.block_bytes)))
        entry[-1] ^= 1
        replace_raw(tier, key, bytes(entry))
        out = np.zeros((1, self.block_bytes), dtype=np.uint8)
        assert tier.get_into([key], list(out)) == [False]
        assert not out.any() and tier.stats()["faults"] == 1 and tier.exists([key]) == 0

    def test_get_into_rejects_a_bad_entry_among_good_ones(self, tier):
        """Several hits are checked on the verify thread while the previous one is copied: a
        corrupt entry in the middle is still a miss with its buffer untouched."""
        keys = make_keys(4)
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
        entry = bytearray(tier.codec.encode(keys[1], block_payload(keys[1], self.block_bytes)))
        entry[len(entry) // 2] ^= 1
        replace_raw(tier, keys[1], bytes(entry))
        out = np.zeros((4, self.block_bytes), dtype=np.uint8)
        assert tier.get_into(keys, list(out)) == [True, False, True, True]
        assert not out[1].any(), "a rejected entry wrote into its buffer"
        assert [out[i].tobytes() for i in (0, 2, 3)] == [block_payload(keys[i], self.block_bytes) for i in (0, 2, 3)]
        assert tier.stats()["faults"] == 1 and tier.exists(keys[1:2]) == 0

    @pytest.mark.parametrize("out, message", [
        ("short", "out\\[0\\] must be writable and hold"),
        ("readonly", "out\\[0\\] must be writable and hold"),
        ("count", "out must be a sequence of 1 buffers"),
    ])
    def test_get_into_checks_its_buffers(self, tier, out, message):
        buffers = {"short": [bytearray(self.block_bytes - 1)], "readonly": [bytes(self.block_bytes)],
                   "count": [bytearray(self.block_bytes)] * 2}[out]
        with pytest.raises(ValueError, match=message):
            tier.get_into(make_keys(1), buffers)

    def test_exists_counts_the_leading_run(self, tier):
        keys = make_keys(5)
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys[:2] + keys[3:]])
        assert tier.exists(keys) == 2
        assert tier.exists(keys[3:]) == 2
        assert tier.exists(keys[2:]) == 0
        assert tier.exists([]) == 0
        assert tier.contains(keys[0]) and not tier.contains(keys[2])

    def test_contains_many_answers_every_key_in_order(self, tier):
        """Absent keys before, between and after present ones each get their own answer: a tier
        that stopped at the first absent key would answer ``False`` for the rest."""
        keys = make_keys(6, salt="membership")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in (keys[1], keys[2], keys[4])])
        assert tier.contains_many(keys) == [False, True, True, False, True, False]
        assert tier.contains_many([keys[4], keys[0], keys[4]]) == [True, False, True]
        assert tier.contains_many([]) == []
        stats = tier.stats()
        assert (stats["hits"], stats["misses"]) == (0, 0), "membership is not a read"

    def test_contains_many_checks_its_keys_and_refuses_a_closed_tier(self, tmp_path):
        with self.make_tier(tmp_path, self.block_bytes) as tier:
            with pytest.raises(TypeError, match="keys must"):
                tier.contains_many(b"a-single-key")
        with pytest.raises(RuntimeError, match="closed"):
            tier.contains_many(make_keys(1))

    def test_delete_removes_and_ignores_absent_keys(self, tier):
        keys = make_keys(3)
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
        tier.delete([keys[1], make_keys(1, salt="never-stored")[0]])
        assert [p is not None for p in tier.get(keys)] == [True, False, True]
        tier.delete_one(keys[0])
        assert tier.get_one(keys[0]) is None

    def test_put_of_a_present_key_keeps_one_entry(self, tier):
        key = make_keys(1)[0]
        assert tier.put_one(key, block_payload(key, self.block_bytes))
        assert tier.put_one(key, block_payload(key, self.block_bytes))
        assert tier.num_entries == 1
        assert tier.used_bytes >= self.block_bytes

    def test_stats_count_hits_misses_and_bytes(self, tier):
        keys = make_keys(3)
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys[:2]])
        tier.get(keys)
        stats = tier.stats()
        assert (stats["hits"], stats["misses"], stats["puts"]) == (2, 1, 2)
        assert stats["bytes_read"] == 2 * self.block_bytes
        assert stats["bytes_written"] >= 2 * self.block_bytes
        assert stats["faults"] == 0

    # ------------------------------------------------------------------ argument checks
    def test_a_payload_of_the_wrong_size_is_rejected(self, tier):
        key = make_keys(1)[0]
        with pytest.raises(ValueError, match=f"{self.block_bytes - 1} bytes.*{self.block_bytes} bytes"):
            tier.put([(key, bytes(self.block_bytes - 1))])
        assert tier.get_one(key) is None

    @pytest.mark.parametrize("keys", [b"a-single-key", ["text-key"], [b""], "abc"])
    def test_keys_must_be_a_sequence_of_bytes(self, tier, keys):
        with pytest.raises(TypeError, match="keys must"):
            tier.get(keys)

    # ------------------------------------------------------------------ integrity
    @pytest.mark.parametrize("where", ["magic", "header", "payload_start", "payload_end"])
    def test_a_flipped_byte_is_a_counted_miss_and_the_entry_is_removed(self, tier, where):
        key = make_keys(1)[0]
        entry = bytearray(tier.codec.encode(key, block_payload(key, self.block_bytes)))
        offset = {"magic": 0, "header": 30, "payload_start": HEADER_SIZE, "payload_end": len(entry) - 1}[where]
        entry[offset] ^= 0x40
        replace_raw(tier, key, bytes(entry))
        assert tier.get([key]) == [None]
        assert tier.stats()["faults"] == 1
        assert tier.exists([key]) == 0

    @pytest.mark.parametrize("length", [0, 10, HEADER_SIZE, HEADER_SIZE + 1, 4000])
    def test_a_truncated_entry_is_a_counted_miss_and_removed(self, tier, length):
        key = make_keys(1)[0]
        entry = tier.codec.encode(key, block_payload(key, self.block_bytes))
        replace_raw(tier, key, entry[:length])
        assert tier.get_one(key) is None
        assert tier.stats()["faults"] == 1
        assert tier.exists([key]) == 0

    @pytest.mark.parametrize("foreign", [
        {"fingerprint": b"another-model", "dtype": "uint8", "shape": None},
        {"fingerprint": None, "dtype": "float32", "shape": "quarter"},
        {"fingerprint": None, "dtype": "uint8", "shape": "two-rows"},
    ])
    def test_an_entry_of_another_model_dtype_or_shape_is_a_miss(self, tier, foreign):
        key = make_keys(1)[0]
        shape = {None: (self.block_bytes,), "quarter": (self.block_bytes // 4,),
                 "two-rows": (2, self.block_bytes // 2)}[foreign["shape"]]
        codec = EntryCodec(fingerprint=foreign["fingerprint"] or self.fingerprint,
                           dtype=foreign["dtype"], shape=shape)
        replace_raw(tier, key, codec.encode(key, block_payload(key, self.block_bytes)))
        assert tier.get_one(key) is None
        assert tier.stats()["faults"] == 1
        assert tier.exists([key]) == 0

    # ------------------------------------------------------------------ entries bound to keys
    def test_two_swapped_entries_are_both_misses(self, tier):
        """An entry is KV only for the key it was written under: swapping two stored values (a
        store edited by hand, a buggy copy tool, an attacker) must not serve either."""
        keys = make_keys(2, salt="swap")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
        first, second = (bytes(e) for e in tier._read_entries(keys))
        replace_raw(tier, keys[0], second)
        replace_raw(tier, keys[1], first)
        assert tier.get(keys) == [None, None]
        assert tier.stats()["faults"] == 2 and tier.exists(keys[:1]) == 0 and tier.exists(keys[1:]) == 0

    def test_entries_rotated_to_the_next_key_are_all_misses(self, tier):
        keys = make_keys(5, salt="rotate")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
        entries = [bytes(e) for e in tier._read_entries(keys)]
        for key, entry in zip(keys, entries[-1:] + entries[:-1]):
            replace_raw(tier, key, entry)
        out = np.zeros((5, self.block_bytes), dtype=np.uint8)
        assert tier.get_into(keys, list(out)) == [False] * 5
        assert not out.any() and tier.stats()["faults"] == 5

    def test_a_payload_zeroed_under_a_recomputed_keyless_checksum_is_a_miss(self, tier):
        """Zero the KV and recompute a checksum over header and payload alone: the tag also
        covers the key, so a forger who leaves the key out fails."""
        import xxhash

        key = make_keys(1, salt="forge")[0]
        tier.put_one(key, block_payload(key, self.block_bytes))
        entry = bytearray(tier._read_entries([key])[0])
        entry[HEADER_SIZE:] = bytes(self.block_bytes)
        entry[HEADER_SIZE - 16:HEADER_SIZE] = xxhash.xxh3_128_digest(
            bytes(entry[:HEADER_SIZE - 16]) + bytes(entry[HEADER_SIZE:]))
        replace_raw(tier, key, bytes(entry))
        assert tier.get_one(key) is None and tier.stats()["faults"] == 1

    def test_an_entry_of_an_older_format_version_is_a_miss(self, tier):
        key = make_keys(1, salt="old-format")[0]
        entry = bytearray(tier.codec.encode(key, block_payload(key, self.block_bytes)))
        entry[4:6] = (1).to_bytes(2, "little")
        replace_raw(tier, key, bytes(entry))
        assert tier.get_one(key) is None and tier.stats()["faults"] == 1

    # ------------------------------------------------------------------ keyed integrity (MAC)
    @pytest.fixture
    def keyed_tier(self, tier):
        """The fixture's tier with a secret, the way :func:`corekv.tier_factory.make_tier` gives one."""
        tier.codec = tier.codec.with_secret(SECRET)
        return tier

    def test_a_keyed_tier_round_trips_its_own_entries(self, keyed_tier):
        keys = make_keys(3, salt="mac")
        assert keyed_tier.put([(k, block_payload(k, self.block_bytes)) for k in keys]) == 3
        assert [bytes(p) for p in keyed_tier.get(keys)] == [block_payload(k, self.block_bytes) for k in keys]

    @pytest.mark.parametrize("forger", ["no secret", "another secret"])
    def test_a_keyed_tier_rejects_entries_forged_without_its_secret(self, keyed_tier, forger):
        """Someone who can write the store and knows the format, but not the secret, computes a
        valid keyed checksum (or a MAC under a guessed secret): a miss, never KV."""
        key = make_keys(1, salt="forged")[0]
        codec = keyed_tier.codec.with_secret(None if forger == "no secret" else b"a guess at the secret")
        replace_raw(keyed_tier, key, codec.encode(key, bytes(self.block_bytes)))
        assert keyed_tier.get_one(key) is None
        assert keyed_tier.stats()["faults"] == 1 and keyed_tier.exists([key]) == 0

    def test_a_keyed_tier_rejects_its_own_entry_moved_to_another_key(self, keyed_tier):
        keys = make_keys(2, salt="mac-move")
        keyed_tier.put_one(keys[0], block_payload(keys[0], self.block_bytes))
        replace_raw(keyed_tier, keys[1], bytes(keyed_tier._read_entries(keys[:1])[0]))
        assert keyed_tier.get_one(keys[1]) is None and keyed_tier.stats()["faults"] == 1
        assert bytes(keyed_tier.get_one(keys[0])) == block_payload(keys[0], self.block_bytes)

    def test_faults_are_logged_once_per_reason(self, tier, caplog):
        keys = make_keys(3)
        for key in keys:
            replace_raw(tier, key, b"garbage that is not an entry")
        with caplog.at_level(logging.WARNING, logger="corekv.tier"):
            assert tier.get(keys) == [None, None, None]
        assert tier.stats()["faults"] == 3
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    # ------------------------------------------------------------------ capacity and lifetime
    def test_filling_past_capacity_never_raises(self, tier):
        if tier.capacity_bytes is None:
            pytest.skip(f"{type(tier).__name__} has no capacity of its own")
        n = 3 * tier.capacity_bytes // tier.codec.entry_bytes + 3
        if n > 5000:
            pytest.skip(f"make_tier's capacity ({tier.capacity_bytes} bytes) is too big to fill here")
        keys = make_keys(n, salt="fill")
        stored = sum(tier.put([(k, block_payload(k, self.block_bytes))]) for k in keys)
        stats = tier.stats()
        assert stored == stats["puts"] and stats["skips"] == n - stored
        assert tier.used_bytes <= tier.capacity_bytes
        assert stats["evictions"] > 0 or stats["skips"] > 0
        last = keys[-1]  # the most recent write survives an LRU, or was skipped
        assert tier.get_one(last) in (None, block_payload(last, self.block_bytes))

    def test_lfu_keeps_the_often_read_entry_through_any_number_of_writes(self, tier):
        if self.eviction != "lfu":
            pytest.skip("an order test of the lfu policy")
        if tier.capacity_bytes is None:
            pytest.skip(f"{type(tier).__name__} has no capacity of its own")
        n = 3 * tier.capacity_bytes // tier.codec.entry_bytes + 3
        if n > 5000:
            pytest.skip(f"make_tier's capacity ({tier.capacity_bytes} bytes) is too big to fill here")
        hot = make_keys(1, salt="hot")[0]
        tier.put_one(hot, block_payload(hot, self.block_bytes))
        for _ in range(3):
            assert tier.get_one(hot) is not None
        cold = make_keys(n, salt="cold")
        for key in cold:
            tier.put([(key, block_payload(key, self.block_bytes))])
        assert tier.stats()["evictions"] > 0
        assert bytes(tier.get_one(hot)) == block_payload(hot, self.block_bytes), "LFU evicted the hot entry"
        assert tier.get_one(cold[0]) is None   # the first cold entry went: what LRU evicts first

    def test_priority_keeps_the_high_priority_entries_through_any_number_of_writes(self, tier):
        if self.eviction != "priority":
            pytest.skip("an order test of the priority policy")
        if not tier.keeps_priorities:
            pytest.skip(f"{type(tier).__name__} does not keep priorities (keeps_priorities=False)")
        if tier.capacity_bytes is None:
            pytest.skip(f"{type(tier).__name__} has no capacity of its own")
        n = 3 * tier.capacity_bytes // tier.codec.entry_bytes + 3
        if n > 5000:
            pytest.skip(f"make_tier's capacity ({tier.capacity_bytes} bytes) is too big to fill here")
        paid = make_keys(2, salt="paid")   # the oldest entries: the first LRU would evict
        tier.put([(k, block_payload(k, self.block_bytes)) for k in paid], priorities=[5, 0])
        tier.put([(paid[1], block_payload(paid[1], self.block_bytes))], priorities=[5])  # raised
        tier.put([(paid[0], block_payload(paid[0], self.block_bytes))], priorities=[1])  # kept at 5
        free = make_keys(n, salt="free")
        for key in free:
            tier.put([(key, block_payload(key, self.block_bytes))], priorities=[0])
        assert tier.stats()["evictions"] > 0
        for key in paid:
            assert bytes(tier.get_one(key)) == block_payload(key, self.block_bytes), \
                "priority evicted an entry written at priority 5 before ones written at 0"
        assert tier.get_one(free[0]) is None   # among equals, the least recently used went first

    def test_put_takes_one_priority_per_item(self, tier):
        keys = make_keys(2, salt="priorities")
        items = [(k, block_payload(k, self.block_bytes)) for k in keys]
        with pytest.raises(ValueError, match="priorities has 1 values for 2 items"):
            tier.put(items, priorities=[3])
        assert tier.put(items, priorities=[3, 0]) == 2   # a tier that keeps none ignores them
        assert [bytes(p) for p in tier.get(keys)] == [payload for _, payload in items]

    def test_usage_grows_with_entries(self, tier):
        before = tier.num_entries
        keys = make_keys(3, salt="usage")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
        assert tier.num_entries == before + 3
        assert tier.used_bytes >= 3 * self.block_bytes

    def test_describe_reports_layout_capabilities_and_usage(self, tier):
        key = make_keys(1, salt="describe")[0]
        tier.put_one(key, block_payload(key, self.block_bytes))
        info = tier.describe()
        assert info["block_bytes"] == self.block_bytes and info["num_entries"] == 1
        assert info["model"] == tier.fp12 and info["is_persistent"] == tier.is_persistent

    def test_keys_lists_what_was_stored(self, tier):
        if not tier.supports_listing:
            pytest.skip(f"{type(tier).__name__} does not list keys")
        keys = make_keys(3, salt="listing")
        tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
        assert set(keys) <= set(tier.keys())

    def test_a_closed_tier_refuses_calls(self, tmp_path):
        with self.make_tier(tmp_path, self.block_bytes) as tier:
            assert not tier.is_closed
        assert tier.is_closed
        with pytest.raises(RuntimeError, match="closed"):
            tier.get(make_keys(1))
        tier.close()  # closing twice is harmless

    def test_concurrent_puts_and_gets_from_threads(self, tier):
        keys = make_keys(16, salt="threads")
        errors = []

        def writer():
            try:
                for key in keys:
                    tier.put([(key, block_payload(key, self.block_bytes))])
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        thread = threading.Thread(target=writer)
        thread.start()
        for _ in range(20):
            for key, payload in zip(keys, tier.get(keys)):
                assert payload is None or bytes(payload) == block_payload(key, self.block_bytes)
        thread.join()
        assert not errors and tier.exists(keys) == len(keys)

    # ------------------------------------------------------------------ tenant isolation
    def test_different_salts_never_hit_each_others_entries(self, tier):
        from hypothesis import HealthCheck, assume, given, settings
        from hypothesis import strategies as st

        written: list[bytes] = []

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=12),
               salt_a=st.one_of(st.none(), st.text(max_size=8)), salt_b=st.text(max_size=8))
        def check(tokens, salt_a, salt_b):
            assume((salt_a or "") != salt_b)
            keys_a = block_hashes(tokens, 4, chain_seed("testing-model", 4, salt_a))
            keys_b = block_hashes(tokens, 4, chain_seed("testing-model", 4, salt_b))
            # NOTE: every example starts from an empty tier: entries of earlier examples (read,
            # so kept by LFU over fresh ones) must not decide what this one finds
            tier.delete(written)
            written[:] = keys_a + keys_b
            tier.put([(k, block_payload(k, self.block_bytes)) for k in keys_a])
            assert tier.exists(keys_b) == 0
            assert tier.get(keys_b) == [None] * len(keys_b)
            tier.put([(k, block_payload(k, self.block_bytes)) for k in keys_b])
            got_a = tier.get(keys_a)
            assert [bytes(p) for p in got_a] == [block_payload(k, self.block_bytes) for k in keys_a]

        check()
