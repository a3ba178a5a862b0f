"""compressed_files: corekv's tier and admin-view conformance suites, plus its own layout."""
import pytest

from corekv.errors import ConfigError
from corekv.plugin import make_plugin_manager
from corekv.testing import StoreAdminTests, TierTests
from corekv.testing.tier import block_payload, make_keys
from corekv_example_plugins.compressed_files import CompressedFilesAdmin, CompressedFilesTier

FINGERPRINT = b"example-plugin-model"


class TestCompressedFilesConformance(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        return CompressedFilesTier(path=tmp_path / "kv", block_bytes=block_bytes,
                                   fingerprint=self.fingerprint)


class TestCompressedFilesAdminConformance(StoreAdminTests):
    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return CompressedFilesTier(path=tmp_path / "kv", block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return CompressedFilesAdmin(path=tmp_path / "kv")


def test_entries_are_compressed_files_that_survive_a_restart(tmp_path):
    keys = make_keys(3)
    payloads = [bytes(4096) for _ in keys]  # zeros: they compress to almost nothing
    with CompressedFilesTier(path=tmp_path, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        assert tier.put(list(zip(keys, payloads))) == 3
        files = sorted((tmp_path / tier.fp12).iterdir())
        assert [f.name for f in files] == sorted(f"{k.hex()}.zst" for k in keys)
        assert all(f.stat().st_size < 4096 // 10 for f in files)
    with CompressedFilesTier(path=tmp_path, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        assert [bytes(p) for p in tier.get(keys)] == payloads
        assert set(tier.keys()) == set(keys)


def test_a_damaged_file_is_a_counted_fault_and_removed(tmp_path):
    key = make_keys(1)[0]
    with CompressedFilesTier(path=tmp_path, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        tier.put_one(key, block_payload(key, 4096))
        (tmp_path / tier.fp12 / f"{key.hex()}.zst").write_bytes(b"not a zstd frame")
        assert tier.get_one(key) is None
        assert tier.stats()["faults"] == 1 and tier.contains_many([key]) == [False]


def test_the_admin_view_of_a_missing_folder_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no compressed_files store at"):
        CompressedFilesAdmin(path=tmp_path / "never-written")


def test_a_bad_level_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match="level must be an int from 1") as caught:
        CompressedFilesTier(path=tmp_path, level=23, block_bytes=4096, fingerprint=FINGERPRINT)
    assert caught.value.path == "level"


def test_registered_through_the_entry_point_with_its_admin_view():
    spec = make_plugin_manager(autoload=True).tiers()["compressed_files"]
    assert spec.distribution == "corekv-example-plugins"
    assert spec.factory is CompressedFilesTier and spec.admin is CompressedFilesAdmin
