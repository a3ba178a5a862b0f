"""The fsspec tier on a real local directory (file://) and fsspec's in-memory filesystem."""
import hashlib
import os
import uuid

import pytest

from corekv.block_format import HEADER_SIZE
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.testing.tier_admin import StoreAdminTests
from corekv.tier_factory import make_tier
from corekv.tiers.fsspec import FsspecAdmin, FsspecTier

FINGERPRINT = TierTests.fingerprint


class TestFsspecTierOnLocalDisk(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        return FsspecTier(url=f"file://{tmp_path}/kv", size=64 * (block_bytes + HEADER_SIZE),
                          block_bytes=block_bytes, fingerprint=self.fingerprint)


class TestFsspecTierInMemory(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        return FsspecTier(url=f"memory://corekv-{uuid.uuid4().hex}", block_bytes=block_bytes,
                          fingerprint=self.fingerprint)


class TestFsspecAdminOnLocalDisk(StoreAdminTests):
    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return FsspecTier(url=f"file://{tmp_path}/kv", block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return FsspecAdmin(url=f"file://{tmp_path}/kv")


class TestFsspecAdminInMemory(StoreAdminTests):
    @staticmethod
    def url(tmp_path):  # one in-memory store per test, the same for its tier and its view
        return f"memory://corekv-{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:16]}"

    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return FsspecTier(url=self.url(tmp_path), block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return FsspecAdmin(url=self.url(tmp_path))


def test_objects_are_laid_out_by_model_and_hash_prefix(tmp_path):
    key = make_keys(1)[0]
    with FsspecTier(url=f"file://{tmp_path}", block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        tier.put_one(key, block_payload(key, 4096))
        path = tmp_path / tier.fp12 / key.hex()[:2] / key.hex()
        assert path.stat().st_size == 4096 + HEADER_SIZE
        assert [p.name for p in path.parent.iterdir()] == [key.hex()], "a temporary file was left"


def test_a_leftover_temporary_file_is_never_read_as_an_entry(tmp_path):
    """A crash between write and rename leaves only a temporary name, which readers ignore."""
    key = make_keys(1)[0]
    with FsspecTier(url=f"file://{tmp_path}", block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        folder = tmp_path / tier.fp12 / key.hex()[:2]
        folder.mkdir(parents=True)
        (folder / f"{key.hex()}.tmp-deadbeef").write_bytes(tier.codec.encode(key, block_payload(key, 4096))[:100])
        assert tier.get_one(key) is None and tier.exists([key]) == 0
        assert tier.num_entries == 0 and list(tier.keys()) == []
        (tmp_path / "notes.txt").write_text("not a block")  # a foreign file beside the store
    with FsspecAdmin(url=f"file://{tmp_path}") as admin:
        assert list(admin.entries()) == []


def test_entries_survive_a_restart_and_other_models_are_not_listed(tmp_path):
    keys = make_keys(3)
    with FsspecTier(url=str(tmp_path), block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        tier.put([(k, block_payload(k, 4096)) for k in keys])
    with FsspecTier(url=str(tmp_path), block_bytes=4096, fingerprint=b"other-model") as other:
        assert other.get(keys) == [None] * 3 and other.num_entries == 0
    with FsspecTier(url=str(tmp_path), block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        assert [bytes(p) for p in tier.get(keys)] == [block_payload(k, 4096) for k in keys]


def test_size_cap_evicts_oldest_including_objects_found_at_open(tmp_path):
    entry = 4096 + HEADER_SIZE
    old = make_keys(4, salt="old")
    with FsspecTier(url=str(tmp_path), block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        tier.put([(k, block_payload(k, 4096)) for k in old])
    for i, key in enumerate(old):  # make the on-disk order explicit
        path = tmp_path / tier.fp12 / key.hex()[:2] / key.hex()
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    with FsspecTier(url=str(tmp_path), size=5 * entry, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        assert tier.used_bytes == 4 * entry
        new = make_keys(3, salt="new")
        assert tier.put([(k, block_payload(k, 4096)) for k in new]) == 3
        assert tier.stats()["evictions"] == 2 and tier.used_bytes == 5 * entry
        assert [p is not None for p in tier.get(old)] == [False, False, True, True]


def test_an_unreachable_store_is_a_counted_miss_not_an_exception(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")  # a file where the store's folder should be: every write fails
    with FsspecTier(url=str(blocker), block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        key = make_keys(1)[0]
        assert tier.put_one(key, block_payload(key, 4096)) is False
        assert tier.get_one(key) is None
        stats = tier.stats()
        assert stats["skips"] == 1 and stats["errors"] >= 1


def test_an_unknown_protocol_names_the_url():
    with pytest.raises(ValueError, match="url 'nosuchproto://x' cannot be opened by fsspec"):
        FsspecTier(url="nosuchproto://x", block_bytes=4096, fingerprint=FINGERPRINT)


def test_registered_as_a_plugin(tmp_path):
    spec = make_plugin_manager().tiers()["fsspec"]
    url = f"memory://corekv-{uuid.uuid4().hex}"
    with make_tier(spec, {"url": url}, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        assert isinstance(tier, FsspecTier) and tier.capacity_bytes is None
    assert spec.admin is FsspecAdmin
