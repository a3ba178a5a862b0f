"""``BackendTests``: the conformance suite every prefix-cache backend's tests subclass.

Usage (a third-party backend does exactly what corekv's own tests do)::

    from corekv.testing import BackendTests

    class TestMyBackend(BackendTests):
        def make_backend(self, num_blocks, block_size, **options):
            return MyBackend(num_blocks, block_size, **options)

``make_backend`` must return an empty backend whose blocks carry their prefix hash
(``block_hash``), with events recorded; ``options`` is only ever ``max_pinned_fraction`` and, for
a backend that takes an eviction policy, ``eviction``: set the class attribute ``eviction`` to a
policy name (``"lfu"``) and subclass once per policy, so every policy runs the whole suite (the
LFU and priority order tests run only under their policy)::

    class TestMyBackendLFU(TestMyBackend):
        eviction = "lfu"
The suite drives the backend through the verbs of :class:`corekv.backend.PrefixCacheBackend`
the way the engine does (``Request`` below) and checks only observable behaviour.
"""
from __future__ import annotations

import pytest

from corekv.backend import PinLimitError, PrefixCacheBackend, admit
from corekv.hashing import PrefixKey, chain_seed

MODEL = "corekv-testing-model"


def make_key(tokens, block_size: int, salt: str | None = None, priority: int = 0) -> PrefixKey:
    return PrefixKey(tokens, block_size, chain_seed(MODEL, block_size, cache_salt=salt),
                     priority=priority)


class Request:
    """One request as the engine admits it (:func:`corekv.backend.admit`), its full blocks
    cached at once; ``finish`` frees."""

    def __init__(self, backend: PrefixCacheBackend, tokens, salt: str | None = None, priority: int = 0):
        self.backend, self.key = backend, make_key(tokens, backend.block_size, salt, priority)
        admission = admit(backend, self.key, len(tokens), cache=True)
        if admission is None:
            raise MemoryError("pool too small for this request")
        self.hit, self.table = admission.hit, admission.table

    @property
    def num_hit_tokens(self) -> int:
        return len(self.hit) * self.backend.block_size

    def finish(self) -> None:
        self.backend.free(self.table)


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


class BackendTests:
    """Behaviour every :class:`~corekv.backend.PrefixCacheBackend` must have."""

    block_size = 4
    #: the eviction policy passed to ``make_backend`` (``None``: none passed, the backend's default)
    eviction: str | None = None

    def make_backend(self, num_blocks: int, block_size: int, **options) -> PrefixCacheBackend:
        raise NotImplementedError("subclasses of BackendTests define make_backend(num_blocks, block_size)")

    def backend(self, num_blocks: int = 16, **options) -> PrefixCacheBackend:
        if self.eviction is not None:
            options["eviction"] = self.eviction
        return self.make_backend(num_blocks, self.block_size, **options)

    # -- lookup ------------------------------------------------------------------------------
    def test_an_empty_backend_matches_nothing_and_has_every_block_free(self):
        b = self.backend(8)
        assert b.match(make_key(tokens(20), self.block_size)) == []
        assert b.num_free_blocks == 8 and b.num_pinned_blocks == 0
        assert {"num_blocks", "num_free_blocks", "num_pinned_blocks"} <= set(b.stats())

    def test_a_finished_request_full_blocks_are_hit_by_the_next(self):
        b, bs = self.backend(), self.block_size
        Request(b, tokens(3 * bs + 1)).finish()
        second = Request(b, tokens(3 * bs) + [7, 7])
        assert second.num_hit_tokens == 3 * bs

    def test_only_full_blocks_are_cached(self):
        b, bs = self.backend(), self.block_size
        Request(b, tokens(2 * bs + bs // 2)).finish()
        assert len(b.match(make_key(tokens(2 * bs + bs // 2), bs))) == 2

    def test_match_stops_at_max_blocks(self):
        b, bs = self.backend(), self.block_size
        Request(b, tokens(4 * bs)).finish()
        assert len(b.match(make_key(tokens(4 * bs), bs), max_blocks=2)) == 2
        assert b.match(make_key(tokens(4 * bs), bs), max_blocks=0) == []

    def test_the_last_prompt_token_is_never_hit(self):
        b, bs = self.backend(), self.block_size
        Request(b, tokens(2 * bs)).finish()
        assert Request(b, tokens(2 * bs)).num_hit_tokens == bs  # not 2 * bs: logits need one

    def test_match_is_read_only(self):
        b, bs = self.backend(4), self.block_size
        Request(b, tokens(2 * bs)).finish()
        before = b.num_free_blocks
        hit = b.match(make_key(tokens(2 * bs), bs))
        assert len(hit) == 2 and b.num_free_blocks == before
        assert b.allocate(4) is not None  # unreferenced: still evictable

    def test_a_block_hits_only_after_the_same_whole_prefix(self):
        b, bs = self.backend(), self.block_size
        Request(b, [1] * bs + tokens(bs) + [0]).finish()
        assert b.match(make_key([2] * bs + tokens(bs), bs)) == []

    def test_different_salts_never_share_a_block(self):
        b, bs = self.backend(), self.block_size
        a = Request(b, tokens(3 * bs), salt="tenant-a")
        other = Request(b, tokens(3 * bs), salt="tenant-b")
        assert other.hit == [] and not set(a.table) & set(other.table)
        assert Request(b, tokens(3 * bs), salt="tenant-a").num_hit_tokens == 2 * bs

    # -- ownership ---------------------------------------------------------------------------
    def test_allocate_hands_out_distinct_blocks_or_none_without_change(self):
        b = self.backend(8)
        first = b.allocate(5)
        assert len(set(first)) == 5 and all(0 <= i < 8 for i in first)
        assert b.allocate(4) is None and b.num_free_blocks == 3
        assert not set(b.allocate(3)) & set(first)
        assert b.allocate(0) == []

    def test_empty_blocks_are_the_free_ones_that_cache_nothing(self):
        b, bs = self.backend(8), self.block_size
        assert b.num_empty_blocks == 8
        request = Request(b, tokens(2 * bs + 1))
        num_cached = request.key.num_full_blocks
        assert b.num_empty_blocks == 8 - len(request.table)
        request.finish()
        assert (b.num_empty_blocks, b.num_free_blocks) == (8 - num_cached, 8)
        assert len(b.allocate(b.num_empty_blocks)) == 8 - num_cached  # evicting nothing
        assert b.num_empty_blocks == 0 and len(b.match(request.key)) == num_cached

    def test_referenced_blocks_are_never_evicted(self):
        b, bs = self.backend(4), self.block_size
        held = Request(b, tokens(2 * bs))
        assert b.allocate(3) is None
        fresh = b.allocate(2)
        assert not set(fresh) & set(held.table)
        assert b.match(make_key(tokens(2 * bs), bs)) == held.table

    def test_a_refused_admission_gives_its_hit_back(self):
        b, bs = self.backend(4), self.block_size
        Request(b, tokens(2 * bs)).finish()
        key = make_key(tokens(5 * bs), bs)  # hits the 2 cached blocks, needs 3 more of the 2 left
        assert len(b.match(key)) == 2
        assert admit(b, key, 5 * bs) is None
        assert b.num_free_blocks == 4 and len(b.match(key)) == 2
        assert len(b.allocate(4)) == 4  # the hit holds no reference: evictable again

    def test_eviction_takes_the_least_recently_used_prefix(self):
        b, bs = self.backend(4), self.block_size
        Request(b, tokens(2 * bs, start=100)).finish()
        Request(b, tokens(2 * bs, start=500)).finish()
        Request(b, tokens(2 * bs, start=100) + [1]).finish()  # touches the first prefix again
        assert b.allocate(2) is not None
        assert len(b.match(make_key(tokens(2 * bs, start=100), bs))) == 2
        assert b.match(make_key(tokens(2 * bs, start=500), bs)) == []

    def test_lfu_keeps_the_often_hit_prefix_over_more_recent_ones(self):
        if self.eviction != "lfu":
            pytest.skip("an order test of the lfu policy")
        b, bs = self.backend(6), self.block_size
        hot = tokens(2 * bs, start=100)
        for _ in range(3):
            Request(b, hot + [1]).finish()          # hit twice after the first
        Request(b, tokens(2 * bs, start=500)).finish()
        Request(b, tokens(2 * bs, start=900)).finish()  # the most recent, never hit
        assert b.allocate(2) is not None
        assert len(b.match(make_key(hot, bs))) == 2, "LFU evicted the hot prefix"
        assert b.match(make_key(tokens(2 * bs, start=500), bs)) == []

    def test_priority_evicts_the_low_priority_prefix_first(self):
        if self.eviction != "priority":
            pytest.skip("an order test of the priority policy")
        b, bs = self.backend(6), self.block_size
        Request(b, tokens(2 * bs, start=100), priority=5).finish()   # the oldest, but paid for
        Request(b, tokens(2 * bs, start=500)).finish()
        Request(b, tokens(2 * bs, start=900), priority=1).finish()
        assert b.allocate(4) is not None
        assert len(b.match(make_key(tokens(2 * bs, start=100), bs))) == 2
        assert b.match(make_key(tokens(2 * bs, start=500), bs)) == []
        assert b.match(make_key(tokens(2 * bs, start=900), bs)) == []   # LRU among equals: next
        assert b.allocate(2) is not None
        assert b.match(make_key(tokens(2 * bs, start=100), bs)) == []

    def test_a_hit_raises_the_priority_of_a_shared_prefix(self):
        if self.eviction != "priority":
            pytest.skip("an order test of the priority policy")
        b, bs = self.backend(6), self.block_size
        shared = tokens(2 * bs, start=100)
        Request(b, shared + [1]).finish()
        Request(b, tokens(2 * bs, start=500)).finish()
        Request(b, shared + [2], priority=3).finish()   # a paid request reuses the prefix
        Request(b, tokens(2 * bs, start=900)).finish()
        assert b.allocate(4) is not None
        assert len(b.match(make_key(shared, bs))) == 2

    def test_a_prefix_is_evicted_from_its_tail(self):
        b, bs = self.backend(3), self.block_size
        r = Request(b, tokens(3 * bs))
        r.finish()
        b.allocate(1)
        is_cached = [b.block_hash(i) is not None for i in r.table]
        assert is_cached.count(True) < 3
        assert is_cached == sorted(is_cached, reverse=True)  # no cached block after an evicted one

    def test_the_same_prefix_computed_twice_keeps_one_copy(self):
        b, bs = self.backend(8), self.block_size
        a, twin = Request(b, tokens(2 * bs)), Request(b, [5] + tokens(2 * bs))
        twin_key = make_key(tokens(2 * bs) + [9], bs)
        dup = b.allocate(2)
        b.cache(twin_key, dup)  # same prefix as ``a``, computed again into other blocks
        assert b.match(twin_key) == a.table
        for r in (a, twin):
            r.finish()
        b.free(dup)
        assert b.num_free_blocks == 8

    def test_free_rejects_blocks_not_in_use(self):
        b = self.backend(4)
        ids = b.allocate(2)
        b.free(ids)
        with pytest.raises(ValueError, match="not in use"):
            b.free(ids)
        with pytest.raises(ValueError, match="block"):
            b.free([99])

    def test_bad_arguments_name_the_argument(self):
        b, bs = self.backend(4), self.block_size
        with pytest.raises(ValueError, match="num_blocks"):
            b.allocate(-1)
        with pytest.raises(ValueError, match="max_blocks"):
            b.match(make_key(tokens(bs), bs), max_blocks=-1)
        with pytest.raises(TypeError, match="PrefixKey"):
            b.match(tokens(bs))
        with pytest.raises(ValueError, match="block_size"):
            b.match(make_key(tokens(2 * bs), bs + 1))
        ids = b.allocate(2)
        with pytest.raises(ValueError, match="full blocks"):
            b.cache(make_key(tokens(bs), bs), ids)

    # -- write-back and events ---------------------------------------------------------------
    def test_block_hash_is_the_chained_hash_of_the_cached_prefix(self):
        b, bs = self.backend(), self.block_size
        r = Request(b, tokens(3 * bs + 1))
        num_full = r.key.num_full_blocks
        assert [b.block_hash(i) for i in r.table[:num_full]] == r.key.block_hashes
        assert all(b.block_hash(i) is None for i in r.table[num_full:])  # a partial block: none

    def test_evicted_blocks_are_offered_with_their_hash_before_reuse(self):
        b, bs = self.backend(2), self.block_size
        r = Request(b, tokens(2 * bs))
        hashes = dict(zip(r.table, r.key.block_hashes))
        r.finish()
        seen = []
        b.on_evict = lambda evicted: seen.extend((e.block_id, e.block_hash) for e in evicted)
        fresh = b.allocate(2)
        assert sorted(seen) == sorted(hashes.items()) and sorted(fresh) == sorted(hashes)
        assert all(b.block_hash(i) is None for i in fresh)

    def test_evicted_blocks_carry_the_highest_priority_that_used_them(self):
        # NOTE: under every policy, LRU included: the tiers below keep the priority for theirs
        b, bs = self.backend(4), self.block_size
        if type(b).block_priority is PrefixCacheBackend.block_priority:
            pytest.skip(f"{type(b).__name__} keeps no priorities (block_priority is the base's 0)")
        shared = tokens(2 * bs, start=100)
        Request(b, shared + [1], priority=2).finish()
        Request(b, shared + [2], priority=7).finish()   # a hit raises it
        Request(b, shared + [3], priority=1).finish()   # a lower one does not lower it
        key = make_key(shared, bs)
        assert [b.block_priority(i) for i in b.match(key)] == [7, 7]
        seen = []
        b.on_evict = seen.extend
        assert b.allocate(4) is not None
        shared_seen = [e for e in seen if e.block_hash in key.block_hashes]
        assert {e.block_hash: e.priority for e in shared_seen} == dict.fromkeys(key.block_hashes, 7)
        assert b.block_priority(shared_seen[0].block_id) == 0   # the slot's new content has none yet

    def test_events_report_stored_then_removed_hashes(self):
        b, bs = self.backend(2), self.block_size
        r = Request(b, tokens(2 * bs))
        r.finish()
        b.allocate(2)
        events = b.take_events()
        stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
        removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
        assert stored == r.key.block_hashes and sorted(removed) == sorted(stored)
        assert b.take_events() == []

    # -- pinning -----------------------------------------------------------------------------
    def test_pinned_prefix_survives_any_pressure_until_unpinned(self):
        b, bs = self.backend(10, max_pinned_fraction=0.5), self.block_size
        Request(b, tokens(3 * bs)).finish()
        key = make_key(tokens(3 * bs), bs)
        assert b.pin(key) == 3 and b.num_pinned_blocks == 3
        assert b.allocate(8) is None
        b.free(b.allocate(7))
        assert len(b.match(key)) == 3
        assert b.unpin(key) == 3 and b.num_pinned_blocks == 0
        assert b.allocate(10) is not None

    def test_pinning_past_the_cap_raises_and_changes_nothing(self):
        b, bs = self.backend(10, max_pinned_fraction=0.2), self.block_size
        Request(b, tokens(3 * bs)).finish()
        with pytest.raises(PinLimitError, match=r"3 more block.*cap of 2.*max_pinned_fraction"):
            b.pin(make_key(tokens(3 * bs), bs))
        assert b.num_pinned_blocks == 0 and b.num_free_blocks == 10

    def test_overlapping_pins_count_blocks_once(self):
        b, bs = self.backend(10, max_pinned_fraction=0.3), self.block_size
        Request(b, tokens(3 * bs)).finish()
        assert b.pin(make_key(tokens(2 * bs), bs)) == 2
        assert b.pin(make_key(tokens(3 * bs), bs)) == 3
        assert b.num_pinned_blocks == 3
        assert b.unpin(make_key(tokens(3 * bs), bs)) == 3 and b.num_pinned_blocks == 2
        assert b.unpin(make_key(tokens(3 * bs), bs)) == 0

    # -- reset -------------------------------------------------------------------------------
    def test_reset_forgets_everything_but_not_while_blocks_are_in_use(self):
        b, bs = self.backend(8), self.block_size
        r = Request(b, tokens(2 * bs))
        with pytest.raises(RuntimeError, match="in use"):
            b.reset()
        r.finish()
        b.reset()
        assert b.match(r.key) == [] and b.num_free_blocks == 8

    def test_freeing_a_block_more_often_than_it_is_held_raises_and_changes_nothing(self):
        b, bs = self.backend(4), self.block_size
        r = Request(b, tokens(2 * bs))
        with pytest.raises(ValueError, match=f"block {r.table[-1]} is listed"):
            b.free(r.table + r.table[-1:])
        r.finish()
        assert b.num_free_blocks == 4
