"""A damaged LMDB store is a clean error that names the file, what is wrong and the fix, never a
signal: the lmdb tier and ``corekv store`` read LMDB's meta pages before anything maps the data
file. Real stores written by the real tier, damaged on disk the way a full disk, a crash or a bad
copy leaves them; where a signal could kill, the reader is a real separate process."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import yaml

from corekv.cli import main
from corekv.errors import ConfigError
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import block_payload, make_keys
from corekv.tier_factory import make_tier
from corekv.tiers.lmdb import LMDBTier
from corekv.tiers.lmdb_file import check_lmdb_file

FINGERPRINT = b"corekv-testing-model-fingerprint"
SCRIPT = Path(sys.executable).with_name("corekv")
NUM_BLOCKS = 40


def open_tier(path: Path) -> LMDBTier:
    return LMDBTier(path=str(path), size=4 * 1024**2, block_bytes=4096, fingerprint=FINGERPRINT,
                    sync=False)


def fill(path: Path) -> tuple[Path, int]:
    """A store of NUM_BLOCKS blocks written by the tier; returns its data file and page size."""
    with open_tier(path) as tier:
        keys = make_keys(NUM_BLOCKS)
        for i in range(0, NUM_BLOCKS, 4):
            assert tier.put([(k, block_payload(k, 4096)) for k in keys[i:i + 4]]) == 4
        page_bytes = tier.env.stat()["psize"]
        assert (path / "data.mdb").stat().st_size == (tier.env.info()["last_pgno"] + 1) * page_bytes
    return path / "data.mdb", page_bytes


def damage(path: Path, how: str) -> tuple[Path, int, int]:
    """A filled store at ``path``, its data file damaged: (the file, size before, size after)."""
    data_file, page_bytes = fill(path)
    size = data_file.stat().st_size
    if how == "half":
        os.truncate(data_file, size // 2)
    elif how == "one page short":
        os.truncate(data_file, size - page_bytes)
    elif how == "zero-length":
        os.truncate(data_file, 0)
    elif how == "100 bytes":
        os.truncate(data_file, 100)
    else:
        assert how == "garbage"
        data_file.write_bytes(bytes(range(256)) * (size // 256))
    return data_file, size, data_file.stat().st_size


def write_config(tmp_path: Path, store: Path) -> Path:
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [
        {"type": "lmdb", "path": str(store), "size": "64MiB"}]}}))
    return config


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COREKV_")}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


DAMAGE = [("half", "is truncated: "), ("one page short", "is truncated: "),
          ("garbage", "is not an LMDB data file (meta page 0 has magic ")]
PLAIN_LMDB_READ = textwrap.dedent("""
    import sys, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin() as txn:
        print(sum(len(value) for _, value in txn.cursor(db=blocks)))
""")


@pytest.mark.parametrize("how", ["half", "one page short"])
def test_plain_lmdb_dies_by_sigbus_reading_these_truncated_files(tmp_path, how):
    """What the checks below prevent: both truncations kill a process that maps the file."""
    damage(tmp_path / "kv", how)
    result = subprocess.run([sys.executable, "-c", PLAIN_LMDB_READ, str(tmp_path / "kv")],
                            capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGBUS


@pytest.mark.parametrize("how, says", [*DAMAGE, ("100 bytes", "is 100 bytes, too short for LMDB")])
def test_the_tier_refuses_a_damaged_data_file_naming_it_and_the_fix(tmp_path, how, says):
    data_file, size, damaged_size = damage(tmp_path / "kv", how)
    with pytest.raises(ConfigError) as caught:
        open_tier(tmp_path / "kv")
    assert caught.value.path == "path"
    message = str(caught.value)
    assert message.startswith(f"{data_file} {says}")
    if says == "is truncated: ":
        assert f"{damaged_size} of the {size} bytes its meta page names" in message
    assert "move its folder away or delete it" in message and "point path elsewhere" in message
    shutil.rmtree(tmp_path / "kv")  # the fix the message names; the failed open held nothing
    with open_tier(tmp_path / "kv") as tier:
        assert tier.num_entries == 0


def test_through_make_tier_the_error_names_the_config_field(tmp_path):
    data_file, *_ = damage(tmp_path / "kv", "half")
    spec = make_plugin_manager().tiers()["lmdb"]
    with pytest.raises(ConfigError) as caught:
        make_tier(spec, {"path": str(tmp_path / "kv")}, block_bytes=4096, fingerprint=FINGERPRINT,
                  where="cache.tiers[1]")
    assert caught.value.path == "cache.tiers[1].path"
    assert str(caught.value).startswith(f"cache.tiers[1].path: {data_file} is truncated: ")


@pytest.mark.parametrize("how, says", DAMAGE)
def test_store_verify_in_a_process_reports_the_damage_and_exits_1(tmp_path, how, says):
    data_file, *_ = damage(tmp_path / "kv", how)
    result = run_cli("store", "verify", "--config", str(write_config(tmp_path, tmp_path / "kv")),
                     cwd=tmp_path)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.startswith(f"corekv: error: tier 'lmdb': {data_file} {says}")
    assert result.stdout == ""


@pytest.mark.parametrize("action", ["stats", "ls"])
def test_store_stats_and_ls_report_a_truncated_file_too(tmp_path, action):
    data_file, *_ = damage(tmp_path / "kv", "half")
    result = run_cli("store", action, "--config", str(write_config(tmp_path, tmp_path / "kv")),
                     cwd=tmp_path)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert f"tier 'lmdb': {data_file} is truncated: " in result.stderr


def test_a_zero_length_data_file_is_an_empty_store(tmp_path, capsys):
    damage(tmp_path / "kv", "zero-length")
    assert check_lmdb_file(tmp_path / "kv") is None
    assert main(["store", "verify", "--config", str(write_config(tmp_path, tmp_path / "kv"))]) == 0
    assert capsys.readouterr().out == "lmdb: 0 good, 0 bad\n"
    key = make_keys(1, salt="after")[0]
    with open_tier(tmp_path / "kv") as tier:
        assert tier.num_entries == 0
        tier.put_one(key, block_payload(key, 4096))
        assert bytes(tier.get_one(key)) == block_payload(key, 4096)


def test_a_file_short_only_by_free_pages_is_healthy(tmp_path):
    """LMDB writes a page when it uses one: pages a transaction takes past the file's end and
    frees again count in the meta page's last page but are never written, nor read later."""
    data_file, _ = fill(tmp_path / "kv")
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"scratch", b"z" * 2_000_000)
        txn.delete(b"scratch")
    need_bytes = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    env.close()
    assert data_file.stat().st_size < need_bytes
    assert check_lmdb_file(tmp_path / "kv") is None
    result = run_cli("store", "verify", "--config", str(write_config(tmp_path, tmp_path / "kv")),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"lmdb: {NUM_BLOCKS} good, 0 bad\n"


def test_a_file_where_the_folder_should_be_is_a_path_error(tmp_path, capsys):
    (tmp_path / "kv").write_text("not a folder")
    where = re.escape(str(tmp_path / "kv"))
    with pytest.raises(ConfigError, match=f"^{where} is a file, not a directory") as caught:
        open_tier(tmp_path / "kv")
    assert caught.value.path == "path"
    with pytest.raises(ConfigError, match="NotADirectoryError") as caught:
        open_tier(tmp_path / "kv" / "below")
    assert caught.value.path == "path"
    assert main(["store", "stats", "--config", str(write_config(tmp_path, tmp_path / "kv"))]) == 1
    assert "is a file, not a directory" in capsys.readouterr().err


def test_a_garbage_lock_file_is_rebuilt_when_no_process_holds_it(tmp_path):
    fill(tmp_path / "kv")
    (tmp_path / "kv" / "lock.mdb").write_bytes(b"\xff" * 100)
    with open_tier(tmp_path / "kv") as tier:
        assert tier.num_entries == NUM_BLOCKS


HOLDER = textwrap.dedent("""
    import sys, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=2)
    print("open", flush=True)
    sys.stdin.readline()
""")


def test_a_garbage_lock_file_another_process_holds_is_a_path_error(tmp_path):
    fill(tmp_path / "kv")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "kv")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        with open(tmp_path / "kv" / "lock.mdb", "r+b") as lock_file:
            lock_file.write(b"\xff" * 64)  # same size: the holder's map stays whole
        with pytest.raises(ConfigError, match="its lock.mdb is not one this lmdb reads") as caught:
            open_tier(tmp_path / "kv")
        assert caught.value.path == "path" and "MDB_INVALID" in str(caught.value)
    finally:
        holder.kill()
        holder.wait(timeout=30)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes any file")
def test_a_read_only_store_is_a_path_error(tmp_path):
    fill(tmp_path / "kv")
    (tmp_path / "kv" / "lock.mdb").unlink()
    (tmp_path / "kv").chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="fix its permissions") as caught:
            open_tier(tmp_path / "kv")
        assert caught.value.path == "path"
    finally:
        (tmp_path / "kv").chmod(0o700)
