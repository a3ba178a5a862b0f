"""``StoreAdminTests``: the conformance suite of a persistent tier's admin view.

Usage (a third-party tier does exactly what corekv's own tests do)::

    from corekv.testing import StoreAdminTests

    class TestMyTierAdmin(StoreAdminTests):
        def make_tier(self, tmp_path, block_bytes, fingerprint):
            return MyTier(path=tmp_path / "store", block_bytes=block_bytes, fingerprint=fingerprint)

        def make_admin(self, tmp_path):
            return MyAdmin(path=tmp_path / "store")

``make_tier`` opens the tier over one store in ``tmp_path`` (the same store on every call, for the
model ``fingerprint`` names), ``make_admin`` the admin view over that store. The suite writes
through the tier and reads and deletes through the view, never holding both open at once (LMDB
allows one open of a store per process), and closes both.
"""
from __future__ import annotations

import time

import pytest

from corekv.block_format import HEADER_SIZE, EntryError, check_entry
from corekv.testing.tier import block_payload, make_keys, replace_raw
from corekv.tier import Tier
from corekv.tier_admin import StoreAdmin, StoredEntry


class StoreAdminTests:
    """Behaviour every :class:`corekv.tier_admin.StoreAdmin` must have; subclass and define
    ``make_tier`` and ``make_admin``."""

    block_bytes = 256
    fingerprints = (b"corekv-testing-model-a", b"corekv-testing-model-b")
    #: seconds between writes whose ages must differ: past one tick of the coarsest clock a
    #: store keeps (Redis's LRU clock and S3's LastModified count whole seconds)
    age_step_s = 1.5

    def make_tier(self, tmp_path, block_bytes: int, fingerprint: bytes) -> Tier:
        raise NotImplementedError("subclasses of StoreAdminTests define "
                                  "make_tier(tmp_path, block_bytes, fingerprint)")

    def make_admin(self, tmp_path) -> StoreAdmin:
        raise NotImplementedError("subclasses of StoreAdminTests define make_admin(tmp_path)")

    def fill(self, tmp_path, fingerprint: bytes, keys: list[bytes]) -> str:
        """Store ``keys`` for the model ``fingerprint`` names; returns its 12 hex digits."""
        with self.make_tier(tmp_path, self.block_bytes, fingerprint) as tier:
            assert tier.put([(k, block_payload(k, self.block_bytes)) for k in keys]) == len(keys)
            return tier.fp12

    def age_basis(self, tmp_path) -> str | None:
        with self.make_admin(tmp_path) as admin:
            return admin.age_basis

    def listed(self, tmp_path) -> dict[tuple[str, bytes], StoredEntry]:
        with self.make_admin(tmp_path) as admin:
            return {(entry.model, entry.key): entry for entry in admin.entries()}

    # ------------------------------------------------------------------ listing
    def test_an_empty_store_lists_nothing(self, tmp_path):
        self.fill(tmp_path, self.fingerprints[0], [])  # the tier creates its store
        assert self.listed(tmp_path) == {}

    def test_entries_lists_every_models_entries_under_their_keys(self, tmp_path):
        """Two models store the same block hashes: each entry is listed once, named by its own
        model, and is the raw entry the tier wrote (its header names that model)."""
        keys = make_keys(3, salt="admin-listing")
        fp_a = self.fill(tmp_path, self.fingerprints[0], keys)
        fp_b = self.fill(tmp_path, self.fingerprints[1], keys[:2])
        found = self.listed(tmp_path)
        assert set(found) == {(fp_a, k) for k in keys} | {(fp_b, k) for k in keys[:2]}
        for (model, key), entry in found.items():
            header = check_entry(key, entry.data)
            assert header.model_digest.hex()[:12] == model
            assert bytes(entry.data[HEADER_SIZE:]) == block_payload(key, self.block_bytes)

    def test_a_damaged_entry_is_listed_as_it_is_stored(self, tmp_path):
        """A view does not validate: ``corekv store verify`` must see a bad entry to report it."""
        keys = make_keys(2, salt="admin-damaged")
        with self.make_tier(tmp_path, self.block_bytes, self.fingerprints[0]) as tier:
            tier.put([(k, block_payload(k, self.block_bytes)) for k in keys])
            replace_raw(tier, keys[0], b"not an entry")
            fp12 = tier.fp12
        found = self.listed(tmp_path)
        assert set(found) == {(fp12, k) for k in keys}
        with pytest.raises(EntryError):
            check_entry(keys[0], found[(fp12, keys[0])].data)
        check_entry(keys[1], found[(fp12, keys[1])].data)

    # ------------------------------------------------------------------ deleting
    def test_delete_removes_exactly_the_given_entries(self, tmp_path):
        keys = make_keys(4, salt="admin-delete")
        fp_a = self.fill(tmp_path, self.fingerprints[0], keys)
        fp_b = self.fill(tmp_path, self.fingerprints[1], keys[:1])
        with self.make_admin(tmp_path) as admin:
            refs = [e.ref for e in admin.entries() if e.model == fp_a and e.key in (keys[0], keys[2])]
            assert len(refs) == 2
            admin.delete(refs)
            admin.delete(refs)  # already gone: ignored
            admin.delete([])
        assert set(self.listed(tmp_path)) == {(fp_a, keys[1]), (fp_a, keys[3]), (fp_b, keys[0])}
        with self.make_tier(tmp_path, self.block_bytes, self.fingerprints[0]) as tier:
            assert tier.contains_many(keys) == [False, True, False, True]

    # ------------------------------------------------------------------ capacity and lifetime
    def test_capacity_is_none_or_a_positive_byte_count(self, tmp_path):
        self.fill(tmp_path, self.fingerprints[0], [])
        with self.make_admin(tmp_path) as admin:
            capacity = admin.capacity_bytes()
        assert capacity is None or (isinstance(capacity, int) and capacity > 0), capacity

    def test_the_store_opens_again_for_the_tier_after_the_view_closes(self, tmp_path):
        key = make_keys(1, salt="admin-reopen")[0]
        self.fill(tmp_path, self.fingerprints[0], [key])
        with self.make_admin(tmp_path) as admin:
            assert len(list(admin.entries())) == 1
        with self.make_tier(tmp_path, self.block_bytes, self.fingerprints[0]) as tier:
            assert bytes(tier.get_one(key)) == block_payload(key, self.block_bytes)

    # ------------------------------------------------------------------ ages and pruning
    def test_usage_gives_every_entry_its_size_and_a_past_time(self, tmp_path):
        """Views with an ``age_basis`` list, without reading them, the entries :meth:`entries`
        lists, each at least as large as its data and last used in the past."""
        keys = make_keys(3, salt="admin-usage")
        self.fill(tmp_path, self.fingerprints[0], keys)
        self.fill(tmp_path, self.fingerprints[1], keys[:1])
        with self.make_admin(tmp_path) as admin:
            if admin.age_basis is None:
                pytest.skip(f"{type(admin).__name__} keeps no entry ages")
            uses = list(admin.usage())
            entries = list(admin.entries())
        assert sorted((u.ref, u.model) for u in uses) == sorted((e.ref, e.model) for e in entries)
        size_of = {e.ref: len(e.data) for e in entries}
        now = time.time()
        for use in uses:
            assert use.num_bytes >= size_of[use.ref]
            assert now - 3600 < use.last_used <= now + 1

    def test_prune_deletes_the_oldest_first_by_size_then_by_age(self, tmp_path):
        from corekv.store import StoreView, prune

        keys = make_keys(3, salt="admin-prune")
        self.fill(tmp_path, self.fingerprints[0], [])
        if self.age_basis(tmp_path) is None:
            pytest.skip("the view keeps no entry ages")
        for key in keys:  # oldest first
            fp12 = self.fill(tmp_path, self.fingerprints[0], [key])
            time.sleep(self.age_step_s)
        with self.make_admin(tmp_path) as admin:
            view = StoreView("store", "test", admin)
            # NOTE: no entries() here: reading an entry is a use where reads count
            uses = sorted(view.usage(), key=lambda use: use.last_used)
            assert len(uses) == 3
            newest_two = uses[1].num_bytes + uses[2].num_bytes
            dry = prune(view, max_bytes=newest_two, dry_run=True)
            assert (dry["deleted"], dry["by_size"], dry["by_age"]) == (1, 1, 0)
            assert len(list(admin.usage())) == 3
            by_size = prune(view, max_bytes=newest_two)
            assert (by_size["deleted"], by_size["kept_bytes"]) == (1, newest_two)
            # an age between the two left, measured at the newest one's last use
            halfway = (uses[2].last_used - uses[1].last_used) / 2
            by_age = prune(view, older_than_s=halfway, now=uses[2].last_used)
            assert (by_age["deleted"], by_age["by_age"], by_age["entries"]) == (1, 1, 2)
        assert set(self.listed(tmp_path)) == {(fp12, keys[2])}  # the first by size, then by age

    def test_reads_count_as_uses_where_the_store_records_them(self, tmp_path):
        """With ``age_basis == "last read or write"`` a read makes an entry the newest, and
        :meth:`usage` itself is no read (a prune run twice deletes the same way)."""
        from corekv.store import StoreView, prune

        keys = make_keys(2, salt="admin-prune-reads")
        fp12 = self.fill(tmp_path, self.fingerprints[0], keys)
        if self.age_basis(tmp_path) != "last read or write":
            pytest.skip("the view's ages count writes only")
        time.sleep(self.age_step_s)
        with self.make_tier(tmp_path, self.block_bytes, self.fingerprints[0]) as tier:
            assert tier.get_one(keys[1]) is not None
        time.sleep(self.age_step_s)
        with self.make_admin(tmp_path) as admin:
            view = StoreView("store", "test", admin)
            first = {u.ref: u.last_used for u in view.usage()}
            second = {u.ref: u.last_used for u in view.usage()}
            assert all(time.time() - second[ref] >= 1.0 for ref in second), (first, second)
            one_entry = max(u.num_bytes for u in view.usage())
            assert prune(view, max_bytes=one_entry)["deleted"] == 1
        assert set(self.listed(tmp_path)) == {(fp12, keys[1])}
