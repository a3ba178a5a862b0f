"""The lmdb tier: real LMDB files in tmp_path, real processes sharing and crashing on them."""
import os
import signal
import struct
import subprocess
import sys
import textwrap

import lmdb
import pytest

from corekv.errors import ConfigError
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.testing.tier_admin import StoreAdminTests
from corekv.tier_factory import make_tier
from corekv.tiers.lmdb import LMDBAdmin, LMDBTier

FINGERPRINT = TierTests.fingerprint


class TestLMDBTier(TierTests):
    def make_tier(self, tmp_path, block_bytes):
        return LMDBTier(path=str(tmp_path / "kv"), size=1024**2, block_bytes=block_bytes,
                        fingerprint=self.fingerprint, eviction=self.eviction)


class TestLMDBTierLFU(TestLMDBTier):
    """LFU reads hit counts from the store's ``stats`` records (written with the access stamps)."""
    eviction = "lfu"


class TestLMDBTierPriority(TestLMDBTier):
    """Priorities live in the store's ``stats`` records, beside the hits."""
    eviction = "priority"


class TestLMDBAdmin(StoreAdminTests):
    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return LMDBTier(path=str(tmp_path / "kv"), size=1024**2, block_bytes=block_bytes,
                        fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return LMDBAdmin(path=str(tmp_path / "kv"), size=1024**2)


def open_tier(path, size=4 * 1024**2, block_bytes=4096, **kwargs):
    return LMDBTier(path=str(path), size=size, block_bytes=block_bytes, fingerprint=FINGERPRINT, **kwargs)


def test_entries_survive_a_restart(tmp_path):
    keys = make_keys(5)
    with open_tier(tmp_path) as tier:
        tier.put([(k, block_payload(k, 4096)) for k in keys])
    with open_tier(tmp_path) as tier:
        assert [bytes(p) for p in tier.get(keys)] == [block_payload(k, 4096) for k in keys]
        assert tier.num_entries == 5 and set(tier.keys()) == set(keys)


def test_a_path_opens_once_per_process(tmp_path):
    with open_tier(tmp_path):
        with pytest.raises(ValueError, match="already open in this process"):
            open_tier(tmp_path)
        with pytest.raises(ValueError, match="already open in this process"):
            LMDBAdmin(path=str(tmp_path), size=1024**2)
    open_tier(tmp_path).close()  # reopening after close is fine
    with LMDBAdmin(path=str(tmp_path), size=1024**2):
        with pytest.raises(ValueError, match="already open in this process"):
            open_tier(tmp_path)


def test_the_admin_view_of_a_missing_store_is_file_not_found_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no LMDB store at {tmp_path / 'kv'}"):
        LMDBAdmin(path=str(tmp_path / "kv"), size=1024**2)
    assert not (tmp_path / "kv").exists()


def test_flipped_bytes_on_disk_are_a_miss_and_removed(tmp_path):
    """Tampering through a raw LMDB write, as another program sharing the file could do."""
    key = make_keys(1)[0]
    with open_tier(tmp_path) as tier:
        tier.put_one(key, block_payload(key, 4096))
        db_key = tier.codec.model_digest[:6] + key
        with tier.env.begin(write=True) as txn:
            entry = bytearray(txn.get(db_key, db=tier._blocks))
            entry[2000] ^= 0xFF
            txn.put(db_key, bytes(entry), db=tier._blocks)
    with open_tier(tmp_path) as tier:
        assert tier.get_one(key) is None
        assert tier.stats()["faults"] == 1 and tier.num_entries == 0


def test_a_foreign_model_never_reads_another_models_blocks(tmp_path):
    key = make_keys(1)[0]
    with open_tier(tmp_path) as tier:
        tier.put_one(key, block_payload(key, 4096))
    with LMDBTier(path=str(tmp_path), size=4 * 1024**2, block_bytes=4096, fingerprint=b"other") as other:
        assert other.get_one(key) is None and other.num_entries == 0
    with open_tier(tmp_path) as tier:
        assert tier.get_one(key) is not None


def test_lru_eviction_keeps_recently_read_blocks(tmp_path):
    with open_tier(tmp_path, size=600 * 1024) as tier:
        keys = make_keys(200, salt="lru")
        tier.put([(k, block_payload(k, 4096)) for k in keys[:10]])
        for key in keys[10:]:
            tier.get([keys[0]])  # keep block 0 hot
            tier.put_one(key, block_payload(key, 4096))
        assert tier.stats()["evictions"] > 0
        assert tier.used_bytes <= 0.9 * tier.capacity_bytes
        assert tier.get_one(keys[0]) is not None, "the hot block was evicted"
        assert tier.get_one(keys[1]) is None, "a cold old block was kept"


def test_a_stats_record_written_before_priorities_reads_as_priority_0(tmp_path):
    """Stores written by a corekv before priorities hold 12-byte ``<QI`` stats records (stored
    at, hits): they read as priority 0, a hit rewrites them in the new format, and eviction
    under ``priority`` orders them among the new ones."""
    paid, old = make_keys(2, salt="paid"), make_keys(2, salt="old")
    with open_tier(tmp_path, size=600 * 1024, eviction="priority") as tier:
        tier.put([(k, block_payload(k, 4096)) for k in paid], priorities=[5, 5])
        tier.put([(k, block_payload(k, 4096)) for k in old])
    env = lmdb.open(str(tmp_path), max_dbs=3, subdir=True)
    with env.begin(write=True) as txn:   # what the older corekv wrote for the old entries
        stats = env.open_db(b"stats", txn=txn)
        old_db_keys = [k for k, _ in txn.cursor(db=stats) if k.endswith(tuple(old))]
        assert len(old_db_keys) == 2
        for db_key in old_db_keys:
            stored_at, _, _ = struct.unpack("<QIi", txn.get(db_key, db=stats))
            txn.put(db_key, struct.pack("<QI", stored_at, 3), db=stats)
    env.close()
    with open_tier(tmp_path, size=600 * 1024, eviction="priority") as tier:
        assert tier.get_one(old[0]) is not None   # a hit on an old record: flushed at close
    env = lmdb.open(str(tmp_path), max_dbs=3, subdir=True)
    with env.begin() as txn:
        records = {k: v for k, v in txn.cursor(db=env.open_db(b"stats", txn=txn)) if k in old_db_keys}
    env.close()
    assert sorted(len(v) for v in records.values()) == [12, 16]
    rewritten = next(v for v in records.values() if len(v) == 16)
    assert struct.unpack("<QIi", rewritten)[1:] == (4, 0)   # its hits kept, priority 0
    with open_tier(tmp_path, size=600 * 1024, eviction="priority") as tier:
        for key in make_keys(200, salt="fill"):   # priority 1: above the old entries, below paid
            tier.put([(key, block_payload(key, 4096))], priorities=[1])
        assert tier.stats()["evictions"] > 0 and tier.stats()["errors"] == 0
        assert [tier.get_one(k) is not None for k in paid + old] == [True, True, False, False]


def test_map_full_evicts_and_retries_when_proactive_eviction_is_off(tmp_path):
    with open_tier(tmp_path, size=600 * 1024, evict_high=1.0, evict_low=0.5) as tier:
        keys = make_keys(300, salt="full")
        stored = sum(tier.put([(k, block_payload(k, 4096))]) for k in keys)
        stats = tier.stats()
        assert stats["evictions"] > 0 and stored == stats["puts"] and stats["errors"] == 0
        assert tier.get_one(keys[-1]) is not None


def test_a_batch_bigger_than_the_map_is_skipped_without_raising(tmp_path):
    with open_tier(tmp_path, size=256 * 1024) as tier:
        keys = make_keys(100, salt="huge")
        stored = tier.put([(k, block_payload(k, 4096)) for k in keys])
        assert 0 <= stored < 100
        assert tier.stats()["skips"] == 100 - stored
        assert all(p is None or bytes(p) == block_payload(k, 4096)
                   for k, p in zip(keys, tier.get(keys)))


WRITER = textwrap.dedent("""
    import sys
    from corekv.testing.tier import block_payload, make_keys
    from corekv.tiers.lmdb import LMDBTier
    path, salt, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tier = LMDBTier(path=path, size=int(sys.argv[5]), block_bytes=4096,
                    fingerprint=b"corekv-testing-model-fingerprint")
    keys = make_keys(n, salt=salt)
    for i in range(0, n, 4):
        tier.put([(k, block_payload(k, 4096)) for k in keys[i:i + 4]])
        print(i + 4, flush=True)
    if mode == "wait":
        print("ready", flush=True)
        other = make_keys(n, salt=sys.stdin.readline().strip())
        got = tier.get(other)
        ok = all(p is not None and bytes(p) == block_payload(k, 4096) for k, p in zip(other, got))
        print("read-ok" if ok else "read-bad", flush=True)
    tier.close()
""")


def start_writer(path, salt, n, mode, size=4 * 1024**2):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), salt, str(n), mode, str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_two_processes_share_one_environment(tmp_path):
    with open_tier(tmp_path) as tier:  # open in this process for the whole exchange
        child = start_writer(tmp_path, "child", 16, "wait")
        while child.stdout.readline().strip() != "ready":
            assert child.poll() is None, "the writer process died"
        child_keys = make_keys(16, salt="child")
        assert [bytes(p) for p in tier.get(child_keys)] == [block_payload(k, 4096) for k in child_keys]
        parent_keys = make_keys(16, salt="parent")
        tier.put([(k, block_payload(k, 4096)) for k in parent_keys])
        child.stdin.write("parent\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "read-ok"
        assert child.wait(timeout=60) == 0


def test_sigkill_during_a_write_loop_leaves_a_consistent_store(tmp_path):
    # a map of ~90 entries: the writer evicts while it is killed, too
    child = start_writer(tmp_path, "killed", 100_000, "loop", size=800 * 1024)
    written = 0
    while written < 200:
        line = child.stdout.readline()
        assert line, "the writer process died"
        written = int(line)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    with open_tier(tmp_path, size=800 * 1024) as tier:
        keys = list(tier.keys())
        assert keys, "nothing committed survived"
        payloads = tier.get(keys)
        assert tier.stats()["faults"] == 0
        assert all(bytes(p) == block_payload(k, 4096) for k, p in zip(keys, payloads))
        more = make_keys(8, salt="after-kill")
        assert tier.put([(k, block_payload(k, 4096)) for k in more]) == 8


def test_registered_as_a_plugin_with_defaults(tmp_path):
    spec = make_plugin_manager().tiers()["lmdb"]
    with make_tier(spec, {"path": str(tmp_path), "size": 1024**2}, block_bytes=4096,
                   fingerprint=FINGERPRINT) as tier:
        assert isinstance(tier, LMDBTier) and tier.is_persistent and tier.is_shared
        assert tier.capacity_bytes == 1024**2
    assert spec.admin is LMDBAdmin


@pytest.mark.parametrize("kwargs, option, message", [
    ({"size": 100}, "size", "size must be at least 4 block entries"),
    ({"evict_high": 0.5, "evict_low": 0.8}, "evict_low", "0 < evict_low < evict_high <= 1"),
    ({"evict_high": 1.5}, "evict_high", "0 < evict_low < evict_high <= 1"),
    ({"path": ""}, "path", "path must be a directory path, got ''"),
])
def test_bad_options_name_the_option(tmp_path, kwargs, option, message):
    with pytest.raises(ConfigError, match=message) as caught:
        LMDBTier(**{"path": str(tmp_path), "size": 1024**2, "block_bytes": 4096,
                    "fingerprint": FINGERPRINT, **kwargs})
    assert caught.value.path == option


def test_reads_of_a_full_map_never_raise_while_recording_access(tmp_path):
    """Access stamps are flushed every 256 hits in a write transaction, which a full map may refuse."""
    with open_tier(tmp_path, size=256 * 1024, evict_high=1.0, evict_low=0.99) as tier:
        keys = make_keys(64, salt="full-reads")
        for key in keys:
            tier.put_one(key, block_payload(key, 4096))
        present = [k for k, p in zip(keys, tier.get(keys)) if p is not None]
        assert present, "nothing fitted in the map"
        for _ in range(300 // len(present) + 1):
            assert all(p is not None for p in tier.get(present))
        assert tier.stats()["faults"] == 0
