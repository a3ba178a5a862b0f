"""The shm tier: real LMDB stores on the machine's real /dev/shm (tmpfs), real processes sharing
them, reading while another is killed mid-write."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

from corekv.errors import ConfigError
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.testing.tier_admin import StoreAdminTests
from corekv.tier_factory import make_tier
from corekv.tiers.shm import ShmAdmin, ShmTier, file_system_type

FINGERPRINT = TierTests.fingerprint
pytestmark = pytest.mark.skipif(file_system_type("/dev/shm") != "tmpfs", reason="needs /dev/shm on tmpfs")


@pytest.fixture
def shm_path():
    path = f"/dev/shm/corekv-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


class TestShmTier(TierTests):
    @pytest.fixture(autouse=True)
    def _shm(self, shm_path):
        self.path = shm_path

    def make_tier(self, tmp_path, block_bytes):
        return ShmTier(path=self.path, size=1024**2, block_bytes=block_bytes, fingerprint=self.fingerprint,
                       eviction=self.eviction)


class TestShmTierLFU(TestShmTier):
    eviction = "lfu"


class TestShmTierPriority(TestShmTier):
    eviction = "priority"


class TestShmAdmin(StoreAdminTests):
    @pytest.fixture(autouse=True)
    def _shm(self, shm_path):
        self.path = shm_path

    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return ShmTier(path=self.path, size=1024**2, block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return ShmAdmin(path=self.path, size=1024**2)


def open_tier(path, size=4 * 1024**2, **kwargs):
    return ShmTier(path=path, size=size, block_bytes=4096, fingerprint=FINGERPRINT, **kwargs)


def test_registered_as_a_plugin_with_defaults_on_dev_shm(shm_path):
    spec = make_plugin_manager().tiers()["shm"]
    assert spec.options["path"].default == "/dev/shm/corekv"
    with make_tier(spec, {"path": shm_path, "size": 1024**2}, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
        assert isinstance(tier, ShmTier) and tier.is_shared and tier.is_persistent
        assert tier.capacity_bytes == 1024**2 and tier.name == "shm"
    assert spec.admin is ShmAdmin


def test_a_size_beyond_the_memory_file_system_is_refused_naming_both(shm_path):
    total = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(ConfigError, match=r"size .* is more than the .* bytes of the tmpfs") as caught:
        open_tier(shm_path, size=total + 1024**3)
    assert caught.value.path == "size"
    assert not os.path.exists(shm_path)  # refused before anything was created


def test_a_folder_on_disk_works_with_a_warning(tmp_path, caplog):
    if file_system_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is in memory here")
    with open_tier(str(tmp_path / "kv")) as tier:
        assert tier.put_one(b"k" * 16, block_payload(b"k" * 16, 4096))
    assert "not in memory" in caplog.text


READER_WRITER = textwrap.dedent("""
    import sys
    from corekv.testing.tier import block_payload, make_keys
    from corekv.tiers.shm import ShmTier
    path, role, salt = sys.argv[1], sys.argv[2], sys.argv[3]
    tier = ShmTier(path=path, size=int(sys.argv[4]), block_bytes=4096,
                   fingerprint=b"corekv-testing-model-fingerprint")
    if role == "write":
        keys = make_keys(100_000, salt=salt)
        for i in range(0, len(keys), 4):
            tier.put([(k, block_payload(k, 4096)) for k in keys[i:i + 4]])
            print(i + 4, flush=True)
    else:  # read the given salt's first 16 blocks over and over; any wrong byte is fatal
        keys = make_keys(16, salt=salt)
        rounds = 0
        while True:
            for k, p in zip(keys, tier.get(keys)):
                assert p is None or bytes(p) == block_payload(k, 4096), "wrong bytes served"
            rounds += 1
            if rounds % 50 == 0:
                print(rounds, tier.stats()["hits"], tier.stats()["faults"], flush=True)
""")


def start(path, role, salt, size):
    return subprocess.Popen([sys.executable, "-c", READER_WRITER, path, role, salt, str(size)],
                            stdout=subprocess.PIPE, text=True)


def read_until(child, predicate):
    while True:
        line = child.stdout.readline()
        assert line, f"process {child.args[3]} died (exit {child.poll()})"
        if predicate(line.split()):
            return line.split()


def test_kill_9_of_a_writer_mid_write_leaves_readers_serving_and_the_store_consistent(shm_path):
    """Three processes on one store: this one, a reader in a loop, and a writer that evicts (the
    map holds ~90 entries) until it is killed with SIGKILL; the reader never sees a wrong byte
    and keeps hitting, and the store takes new writes after."""
    size = 800 * 1024
    with open_tier(shm_path, size=size) as tier:
        mine = make_keys(16, salt="mine")
        tier.put([(k, block_payload(k, 4096)) for k in mine])
        reader = start(shm_path, "read", "mine", size)
        writer = start(shm_path, "write", "killed", size)
        try:
            read_until(writer, lambda f: int(f[0]) >= 200)
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(timeout=30)
            before = read_until(reader, lambda f: True)
            tier.put([(k, block_payload(k, 4096)) for k in mine])  # back after the writer evicted them
            after = read_until(reader, lambda f: int(f[1]) > int(before[1]))
            assert after[2] == "0"  # no entry failed its checks
        finally:
            reader.kill()
            reader.wait(timeout=30)
        keys = list(tier.keys())
        assert keys and all(bytes(p) == block_payload(k, 4096) for k, p in zip(keys, tier.get(keys)))
        assert tier.stats()["faults"] == 0
        more = make_keys(8, salt="after-kill")
        assert tier.put([(k, block_payload(k, 4096)) for k in more]) == 8
        assert tier.used_bytes <= size


def test_the_store_outlives_the_process_that_filled_it(shm_path):
    writer = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from corekv.testing.tier import block_payload, make_keys
        from corekv.tiers.shm import ShmTier
        with ShmTier(path=sys.argv[1], size=4 * 1024**2, block_bytes=4096,
                     fingerprint=b"corekv-testing-model-fingerprint") as tier:
            tier.put([(k, block_payload(k, 4096)) for k in make_keys(10, salt="gone")])
    """), shm_path], timeout=120)
    assert writer.returncode == 0
    with open_tier(shm_path) as tier:
        keys = make_keys(10, salt="gone")
        assert [bytes(p) for p in tier.get(keys)] == [block_payload(k, 4096) for k in keys]
