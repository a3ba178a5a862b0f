"""What a local user can put at an fsspec tier's entry path cannot hang, flood or litter a reader
(issue 37): a FIFO, a symlink to /dev/zero, a huge sparse file are misses read in bounded time
and memory; a failed write leaves no temporary object, and ``corekv store clear``/``verify``
sweep what a killed writer left. Real files, FIFOs and symlinks on the local disk; the full disk
is a real write failure, made by a file-size limit in a child process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from corekv.cli import main
from corekv.testing.tier import block_payload, make_keys
from corekv.tiers.fsspec import FsspecTier
from corekv.tiers.local_objects import (TMP_MARK, TMP_MAX_AGE_S, read_regular_file, sweep_temporary,
                                        write_aside)

FINGERPRINT = b"corekv-testing-model-fingerprint"
BLOCK_BYTES = 4096


def make_tier(root) -> FsspecTier:
    return FsspecTier(url=f"file://{root}", block_bytes=BLOCK_BYTES, fingerprint=FINGERPRINT)


def plant(path: str, kind: str) -> None:
    """Put a hostile ``kind`` of file at ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "3 GiB sparse file":
        with open(path, "wb") as f:
            f.truncate(3 * 1024**3)
    elif kind == "directory":
        os.mkdir(path)
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "symlink to /dev/zero", "3 GiB sparse file", "directory"]


def within(seconds: float, fn, *args):
    """``fn(*args)`` run on a thread that must finish within ``seconds`` (a FIFO read would not)."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_file_refuses_what_is_not_an_entry_without_reading_it(tmp_path, kind):
    path = str(tmp_path / "entry")
    plant(path, kind)
    with pytest.raises(OSError):
        within(5, read_regular_file, path, 1 << 20)


def test_read_regular_file_reads_an_entry_and_refuses_a_larger_one(tmp_path):
    path = tmp_path / "entry"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(str(path), 100) == b"x" * 100
    with pytest.raises(OSError, match="more than an entry's 99"):
        read_regular_file(str(path), 99)
    with pytest.raises(FileNotFoundError):
        read_regular_file(str(tmp_path / "absent"), 100)


@pytest.mark.parametrize("kind", KINDS)
def test_the_tier_reads_a_hostile_file_as_a_counted_miss_in_bounded_time(tmp_path, kind):
    keys = make_keys(3)
    with make_tier(tmp_path / "kv") as tier:
        tier.put([(k, block_payload(k, BLOCK_BYTES)) for k in keys[:2]])
        plant(tier._path(keys[2]), kind)
        started = time.perf_counter()
        got = within(10, tier.get, keys)
        assert time.perf_counter() - started < 5
        assert [bytes(v) for v in got[:2]] == [block_payload(k, BLOCK_BYTES) for k in keys[:2]]
        assert got[2] is None
        assert tier.stats()["errors"] + tier.stats()["faults"] >= 1


WRITE_ON_A_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from corekv.testing.tier import block_payload, make_keys
    from corekv.tiers.fsspec import FsspecTier
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # NOTE: then a write past the limit is EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    tier = FsspecTier(url="file://" + sys.argv[1], block_bytes=4096,
                      fingerprint=b"corekv-testing-model-fingerprint")
    key = make_keys(1)[0]
    print(tier.put([(key, block_payload(key, 4096))]), tier.stats()["errors"])
""")


def test_a_write_that_fails_on_a_full_disk_leaves_no_temporary_object(tmp_path):
    result = subprocess.run([sys.executable, "-c", WRITE_ON_A_FULL_DISK, str(tmp_path / "kv")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "0"  # nothing stored
    left = [name for _, _, names in os.walk(tmp_path / "kv") for name in names]
    assert left == []


def test_write_aside_removes_its_temporary_object_when_the_write_fails(tmp_path):
    def parts():
        yield b"half an entry"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_aside(str(tmp_path / "a" / "obj"), parts())
    assert os.listdir(tmp_path / "a") == []


def test_store_clear_and_verify_sweep_old_temporary_objects_only(tmp_path, capsys):
    keys = make_keys(2)
    with make_tier(tmp_path / "kv") as tier:
        tier.put([(k, block_payload(k, BLOCK_BYTES)) for k in keys])
        stale, fresh = (tier._path(keys[0]) + TMP_MARK + "stale", tier._path(keys[1]) + TMP_MARK + "fresh")
    for path in (stale, fresh):
        with open(path, "wb") as f:
            f.write(b"half")
    old = time.time() - TMP_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [{"type": "fsspec",
                                                           "url": f"file://{tmp_path / 'kv'}"}]}}))
    assert main(["store", "verify", "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith("fsspec: 2 good, 0 bad")
    assert not os.path.exists(stale) and os.path.exists(fresh)  # a write in progress stays
    os.utime(fresh, (old, old))
    assert main(["store", "clear", "--all-models", "--yes", "--config", str(config)]) == 0
    assert [n for _, _, names in os.walk(tmp_path / "kv") for n in names] == []
    assert sweep_temporary(str(tmp_path / "kv")) == 0


@pytest.mark.parametrize("kind", ["fifo", "3 GiB sparse file"])
def test_store_verify_reports_a_hostile_file_as_bad_in_bounded_time(tmp_path, capsys, kind):
    keys = make_keys(2)
    with make_tier(tmp_path / "kv") as tier:
        tier.put([(keys[0], block_payload(keys[0], BLOCK_BYTES))])
        plant(tier._path(keys[1]), kind)
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [{"type": "fsspec",
                                                           "url": f"file://{tmp_path / 'kv'}"}]}}))
    assert within(30, main, ["store", "verify", "--config", str(config)]) == 1
    assert capsys.readouterr().out.startswith("fsspec: 1 good, 1 bad")
