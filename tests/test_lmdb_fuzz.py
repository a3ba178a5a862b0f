"""No damaged LMDB page kills a process (issue 37): a store written by the real tier, its pages
damaged on disk (random bytes, and the fields LMDB trusts: a leaf's data size, an overflow page
number, a branch's child, a page's header), is either refused at open with an error naming the
file, or read with every entry its original bytes or a counted miss; ``corekv store verify``
and ``ls`` answer in one line. Each case runs in a real child process, where a SIGBUS would show
as its exit status."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from corekv.testing.tier import block_payload, make_keys
from corekv.tiers.lmdb import LMDBTier

FINGERPRINT = b"corekv-testing-model-fingerprint"
SCRIPT = Path(sys.executable).with_name("corekv")
NUM_BLOCKS, BLOCK_BYTES = 40, 4096
_PAGE_HEADER = struct.Struct("=QHHHH")
_NODE = struct.Struct("=HHHH")
_P_BRANCH, _P_LEAF, _F_BIGDATA = 0x01, 0x02, 0x01

# NOTE: the child reads every case in turn and prints one JSON line per case before the next, so
# a signal names the case it died on.
CHILD = textwrap.dedent("""
    import json, sys
    from corekv.errors import ConfigError, CoreKVError
    from corekv.testing.tier import block_payload, make_keys
    from corekv.tiers.lmdb import LMDBAdmin, LMDBTier
    from corekv.block_format import check_entry, EntryError

    keys = make_keys(int(sys.argv[2]))
    for case in json.loads(open(sys.argv[1]).read()):
        result = {"case": case}
        try:
            tier = LMDBTier(path=case, size=4 * 1024**2, block_bytes=4096,
                            fingerprint=b"corekv-testing-model-fingerprint", sync=False)
        except ConfigError as e:
            result["open"] = str(e)
        else:
            with tier:
                got = tier.get(keys)
                result["wrong"] = sum(1 for k, v in zip(keys, got)
                                      if v is not None and bytes(v) != block_payload(k, 4096))
                result["hits"] = sum(v is not None for v in got)
                result["damage"] = tier.damage
        try:
            admin = LMDBAdmin(path=case, size=4 * 1024**2)
        except CoreKVError as e:
            result["admin"] = str(e)
        else:
            try:
                for entry in admin.entries():
                    try:
                        check_entry(entry.key, entry.data, None)
                    except EntryError:
                        pass
                result["admin"] = "ok"
            except CoreKVError as e:
                result["admin"] = str(e)
            finally:
                admin.close()
        print(json.dumps(result), flush=True)
""")


def fill(path: Path) -> int:
    """A store of NUM_BLOCKS blocks written by the tier; returns its page size."""
    with LMDBTier(path=str(path), size=4 * 1024**2, block_bytes=BLOCK_BYTES, fingerprint=FINGERPRINT,
                  sync=False) as tier:
        keys = make_keys(NUM_BLOCKS)
        for i in range(0, NUM_BLOCKS, 4):
            assert tier.put([(k, block_payload(k, BLOCK_BYTES)) for k in keys[i:i + 4]]) == 4
        return tier.env.stat()["psize"]


def tree_pages(data: bytes, page_bytes: int) -> dict[str, list[int]]:
    """Page numbers of the branch and leaf pages (page 2 on: 0 and 1 are the meta pages)."""
    found: dict[str, list[int]] = {"branch": [], "leaf": [], "bigdata_leaf": []}
    for number in range(2, len(data) // page_bytes):
        page = data[number * page_bytes:(number + 1) * page_bytes]
        pgno, _, flags, lower, _ = _PAGE_HEADER.unpack_from(page)
        if pgno != number or flags & 0x04:
            continue  # an overflow page's data, or a free page never written
        if flags & _P_BRANCH:
            found["branch"].append(number)
        elif flags & _P_LEAF:
            found["leaf"].append(number)
            offsets = struct.unpack_from(f"={(lower - 16) // 2}H", page, 16)
            if any(_NODE.unpack_from(page, o)[2] & _F_BIGDATA for o in offsets):
                found["bigdata_leaf"].append(number)
    return found


def node_offsets(data: bytearray, page_bytes: int, number: int) -> list[int]:
    base = number * page_bytes
    lower = _PAGE_HEADER.unpack_from(data, base)[3]
    return [base + o for o in struct.unpack_from(f"={(lower - 16) // 2}H", data, base + 16)]


def damage(data: bytearray, page_bytes: int, kind: str, rng: random.Random) -> None:
    pages = tree_pages(bytes(data), page_bytes)
    if kind == "random bytes":
        number = rng.randrange(2, len(data) // page_bytes)
        for _ in range(rng.randint(1, 16)):
            data[number * page_bytes + rng.randrange(page_bytes)] = rng.randrange(256)
    elif kind == "random 8 bytes in a tree page":
        number = rng.choice(pages["leaf"] + pages["branch"])
        at = number * page_bytes + rng.randrange(page_bytes - 8)
        data[at:at + 8] = rng.randbytes(8)
    elif kind in ("leaf data size", "overflow page number", "leaf key size", "node offset"):
        number = rng.choice(pages["bigdata_leaf"] if kind != "leaf key size" else pages["leaf"])
        node = rng.choice(node_offsets(data, page_bytes, number))
        lo, hi, flags, key_bytes = _NODE.unpack_from(data, node)
        if kind == "leaf data size":  # the attacker's case: the file keeps its length
            size = rng.choice([0xFFFFFFFF, 0x7FFFFFFF, len(data), (lo | hi << 16) * 3, 1 << 20])
            _NODE.pack_into(data, node, size & 0xFFFF, size >> 16, flags, key_bytes)
        elif kind == "leaf key size":
            _NODE.pack_into(data, node, lo, hi, flags, rng.choice([0xFFFF, page_bytes, 4000]))
        elif kind == "overflow page number" and flags & _F_BIGDATA:
            at = node + _NODE.size + key_bytes
            struct.pack_into("=Q", data, at, rng.choice([len(data) // page_bytes - 1,
                                                          len(data) // page_bytes + 5, 2**40, 0]))
        else:
            base = number * page_bytes
            lower = _PAGE_HEADER.unpack_from(data, base)[3]
            struct.pack_into("=H", data, base + 16 + 2 * rng.randrange((lower - 16) // 2),
                             rng.choice([page_bytes - 2, 0, 17, 0xFFFF]))
    elif kind == "branch child":
        number = rng.choice(pages["branch"] or pages["leaf"])
        node = rng.choice(node_offsets(data, page_bytes, number))
        _NODE.pack_into(data, node, rng.randrange(1 << 16), rng.randrange(1 << 16), 0,
                        _NODE.unpack_from(data, node)[3])
    elif kind == "page header":
        number = rng.choice(pages["leaf"] + pages["branch"])
        _PAGE_HEADER.pack_into(data, number * page_bytes, rng.choice([number, number + 1]), 0,
                               rng.choice([0, 0x02, 0x01, 0x04]), rng.choice([16, 4000, 0xFFFF]),
                               rng.choice([0, 16, 0xFFFF]))
    else:
        raise AssertionError(kind)


KINDS = ["random bytes", "random 8 bytes in a tree page", "leaf data size", "overflow page number",
         "leaf key size", "node offset", "branch child", "page header"]
NUM_CASES = 96  # 12 per kind


@pytest.fixture(scope="module")
def damaged_stores(tmp_path_factory) -> list[tuple[str, str]]:
    root = tmp_path_factory.mktemp("fuzz")
    page_bytes = fill(root / "written")
    # NOTE: a compacted copy holds live pages only, so every damaged tree page is one a reader meets
    with LMDBTier(path=str(root / "written"), size=4 * 1024**2, block_bytes=BLOCK_BYTES,
                  fingerprint=FINGERPRINT, sync=False) as tier:
        (root / "original").mkdir()
        tier.env.copy(str(root / "original"), compact=True)
    original = (root / "original" / "data.mdb").read_bytes()
    rng = random.Random(37)
    cases = []
    for i in range(NUM_CASES):
        kind = KINDS[i % len(KINDS)]
        data = bytearray(original)
        damage(data, page_bytes, kind, rng)
        case = root / f"case{i:03d}"
        case.mkdir()
        (case / "data.mdb").write_bytes(bytes(data))
        cases.append((str(case), kind))
    return cases


def test_no_damage_kills_a_reader_or_returns_wrong_kv(damaged_stores, tmp_path):
    case_list = tmp_path / "cases.json"
    case_list.write_text(json.dumps([case for case, _ in damaged_stores]))
    result = subprocess.run([sys.executable, "-c", CHILD, str(case_list), str(NUM_BLOCKS)],
                            capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = dict(damaged_stores)
    if result.returncode != 0:
        died_on = damaged_stores[len(lines)] if len(lines) < len(damaged_stores) else None
        pytest.fail(f"the reader ended with {result.returncode} "
                    f"({signal.Signals(-result.returncode).name if result.returncode < 0 else 'exit'}) "
                    f"on {died_on}: {result.stderr[-2000:]}")
    assert len(lines) == NUM_CASES
    for line in lines:
        kind = kinds[line["case"]]
        assert line.get("wrong", 0) == 0, (kind, line)
        if "open" in line:
            assert "data.mdb" in line["open"] and "move its folder away or delete it" in line["open"]
        assert line["admin"] == "ok" or "damaged" in line["admin"] or "data.mdb" in line["admin"], line
    # most damage is found at open, before anything maps the file; the rest are misses
    assert sum("open" in line for line in lines) >= NUM_CASES // 2


def test_the_attackers_damage_kills_plain_lmdb(damaged_stores):
    """What the checks prevent: a leaf's data size set past the file kills a plain reader."""
    case = next(c for c, kind in damaged_stores if kind == "leaf data size")
    plain = textwrap.dedent("""
        import sys, lmdb
        env = lmdb.open(sys.argv[1], max_dbs=2, map_size=4 * 1024**2)
        blocks = env.open_db(b"blocks")
        with env.begin() as txn:
            print(sum(len(value) for _, value in txn.cursor(db=blocks)))
    """)
    copy = Path(case).with_name("plain")
    shutil.copytree(case, copy)
    result = subprocess.run([sys.executable, "-c", plain, str(copy)], capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGBUS, result


def test_damage_lmdb_reports_after_open_quarantines_the_store(tmp_path, caplog):
    """A page damaged while the tier has the store open, which LMDB itself reports (a leaf page
    whose flags are gone: CorruptedError), makes every lookup a counted miss from then on, with one
    error log naming the store and the fix; nothing is written to it any more."""
    page_bytes = fill(tmp_path / "kv")
    keys = make_keys(NUM_BLOCKS)
    with LMDBTier(path=str(tmp_path / "kv"), size=4 * 1024**2, block_bytes=BLOCK_BYTES,
                  fingerprint=FINGERPRINT, sync=False) as tier:
        assert bytes(tier.get(keys[:1])[0]) == block_payload(keys[0], BLOCK_BYTES)
        path = tmp_path / "kv" / "data.mdb"
        data = bytearray(path.read_bytes())
        for number in tree_pages(bytes(data), page_bytes)["bigdata_leaf"]:
            struct.pack_into("=H", data, number * page_bytes + 10, 0)  # mp_flags: no longer a leaf
        with open(path, "r+b") as f:  # in place: the mapped pages change under the reader
            f.write(data)
        assert tier.get(keys) == [None] * NUM_BLOCKS
        assert tier.damage is not None and "Corrupted" in tier.damage
        errors = tier.stats()["errors"]
        assert tier.get(keys[:3]) == [None] * 3 and tier.stats()["errors"] == errors
        assert tier.put([(keys[0], block_payload(keys[0], BLOCK_BYTES))]) == 0
    damaged = [r for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 1 and "corekv store verify" in damaged[0].getMessage()


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COREKV_")}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


@pytest.mark.parametrize("kind", ["leaf data size", "page header", "branch child"])
@pytest.mark.parametrize("action", ["verify", "ls"])
def test_store_verify_and_ls_say_the_store_is_damaged_in_one_line(damaged_stores, tmp_path, kind,
                                                                    action):
    case = next(c for c, k in damaged_stores if k == kind)
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [{"type": "lmdb", "path": case,
                                                           "size": "4MiB"}]}}))
    result = run_cli("store", action, "--config", str(config), cwd=tmp_path)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("corekv: error: tier 'lmdb': ") and "damaged" in result.stderr
