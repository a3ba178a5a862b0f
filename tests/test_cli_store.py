"""``corekv store stats|ls|verify|clear`` on a real LMDB store filled by a real Engine running a
tiny Llama saved to disk, the CLI's built-in default config, and ``generate --stats`` reporting
blocks reloaded from LMDB by a second process."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import yaml

import corekv
from corekv.block_format import HEADER_SIZE, fingerprint_digest
from corekv.cli import main
from corekv.config import load_config
from corekv.offload.build import fingerprint_bytes

SCRIPT = Path(sys.executable).with_name("corekv")
PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again and again.",
           "A KV cache keeps the keys and values of earlier tokens so they are not recomputed."]


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("COREKV_")}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd,
                          env={**full_env, **(env or {})}, timeout=300)


@pytest.fixture
def tiny_folder(tiny_model_folder) -> str:
    return str(tiny_model_folder)


def write_config(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump({
        "model": model, "device": "cpu",
        "engine": {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 256},
        "cache": {"tiers": [{"type": "lmdb", "path": str(tmp_path / "kv"), "size": "64MiB",
                             "sync": False}]}}))
    return path


@pytest.fixture
def store(tmp_path, tiny_folder):
    """A config whose lmdb tier holds what an Engine flushed on close; returns (path, fp12, layout)."""
    path = write_config(tmp_path, tiny_folder)
    with corekv.Engine.from_config(load_config(path, env={})) as engine:
        engine.generate(PROMPTS, corekv.SamplingParams(max_tokens=2, temperature=0.0))
        fp12 = fingerprint_digest(fingerprint_bytes(engine.model.fingerprint)).hex()[:12]
        layout = f"{str(engine.model.dtype).removeprefix('torch.')}{list(engine.kv_pool.block_shape)}"
        block_bytes = engine.kv_pool.bytes_per_block
    return path, fp12, layout, block_bytes


def store_json(capsys, *args) -> tuple[int, object]:
    code = main(["store", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_store_opens_its_views_with_the_plugin_manager_it_read_the_config_with(store, capsys,
                                                                               monkeypatch):
    import corekv.config.reader
    import corekv.plugin
    import corekv.store

    made, real = [], corekv.plugin.make_plugin_manager

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    for module in (corekv.plugin, corekv.config.reader, corekv.store):
        monkeypatch.setattr(module, "make_plugin_manager", counting)
    path, fp12, _, _ = store
    code, rows = store_json(capsys, "stats", "--config", str(path))
    assert code == 0 and [row["name"] for row in rows] == ["lmdb"] and len(made) == 1
    code, result = store_json(capsys, "clear", "--config", str(path), "--yes")  # loads the model
    assert code == 0 and result["model"] == fp12 and len(made) == 2


def test_stats_names_the_model_layout_and_counts(store, capsys):
    path, fp12, layout, block_bytes = store
    code, rows = store_json(capsys, "stats", "--config", str(path))
    assert code == 0
    [row] = rows
    assert row["name"] == "lmdb" and row["capacity_bytes"] == 64 << 20
    assert row["entries"] > 0 and row["bytes"] == row["entries"] * (HEADER_SIZE + block_bytes)
    assert row["models"] == {fp12: {"entries": row["entries"], "bytes": row["bytes"],
                                    "layouts": [layout]}}
    assert main(["store", "stats", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"model {fp12}: {row['entries']} entries" in text and layout in text


def test_ls_lists_entries_up_to_the_limit(store, capsys):
    path, fp12, layout, block_bytes = store
    code, rows = store_json(capsys, "ls", "--config", str(path), "--limit", "2")
    assert code == 0 and len(rows) == 2
    for row in rows:
        assert row["model"] == fp12 and row["bytes"] == HEADER_SIZE + block_bytes
        assert f"{row['dtype']}{row['shape']}" == layout and len(bytes.fromhex(row["key"])) >= 16


def flip_a_payload_byte(lmdb_path: Path) -> bytes:
    """Flip one payload byte of the first entry with plain lmdb (as disk corruption would)."""
    env = lmdb.open(str(lmdb_path), max_dbs=2, subdir=True)
    try:
        blocks = env.open_db(b"blocks")
        with env.begin(write=True) as txn:
            key, value = next(iter(txn.cursor(db=blocks)))
            corrupt = bytearray(value)
            corrupt[HEADER_SIZE + 5] ^= 0x40
            txn.put(key, bytes(corrupt), db=blocks)
    finally:
        env.close()
    return key


def test_verify_finds_a_flipped_byte_and_deletes_it(store, capsys):
    path, *_ = store
    code, [clean] = store_json(capsys, "verify", "--config", str(path))
    assert code == 0 and clean["bad"] == 0 and clean["good"] > 1
    flip_a_payload_byte(path.parent / "kv")
    code, [found] = store_json(capsys, "verify", "--config", str(path))
    assert code == 1
    assert (found["good"], found["bad"], found["deleted"]) == (clean["good"] - 1, 1, 0)
    assert found["bad_entries"][0]["reason"].startswith("checksum")
    code, [fixed] = store_json(capsys, "verify", "--config", str(path), "--delete-bad")
    assert code == 1 and fixed["deleted"] == 1
    code, [after] = store_json(capsys, "verify", "--config", str(path))
    assert code == 0 and (after["good"], after["bad"]) == (clean["good"] - 1, 0)


def test_verify_and_stats_cover_entries_of_another_model(store, capsys, tmp_path):
    """A second model (another fingerprint and layout) written through the real LMDB tier."""
    from corekv.tiers.lmdb import LMDBTier

    path, fp12, layout, _ = store
    with LMDBTier(path=str(tmp_path / "kv"), size=64 << 20, block_bytes=64, fingerprint=b"other",
                  dtype="float16", shape=(2, 16), sync=False) as other:
        assert other.put([(bytes([i]) * 16, bytes(range(i, i + 64))) for i in range(3)]) == 3
        other_fp12 = other.fp12
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["models"][other_fp12] == {"entries": 3, "bytes": 3 * (HEADER_SIZE + 64),
                                         "layouts": ["float16[2, 16]"]}
    code, [checked] = store_json(capsys, "verify", "--config", str(path))
    assert code == 0 and checked["good"] == row["entries"]
    code, result = store_json(capsys, "clear", "--config", str(path), "--model", other_fp12, "--yes")
    assert code == 0 and result["deleted"] == {"lmdb": 3}
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert set(row["models"]) == {fp12}


def test_clear_requires_yes_then_empties_the_store(store, capsys):
    path, fp12, *_ = store
    assert main(["store", "clear", "--config", str(path)]) == 2
    assert "add --yes" in capsys.readouterr().err
    code, result = store_json(capsys, "clear", "--config", str(path), "--yes")  # this model
    assert code == 0 and result["model"] == fp12 and result["deleted"]["lmdb"] > 0
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["entries"] == 0 and row["models"] == {}
    code, result = store_json(capsys, "clear", "--config", str(path), "--all-models", "--yes")
    assert result["deleted"] == {"lmdb": 0}


def test_prune_to_a_size_keeps_the_newest_entries_and_says_what_went(store, capsys):
    path, fp12, _, block_bytes = store
    entry_bytes = HEADER_SIZE + block_bytes
    code, [before] = store_json(capsys, "stats", "--config", str(path))
    assert before["entries"] >= 4
    half = before["entries"] // 2
    code, [dry] = store_json(capsys, "prune", "--config", str(path), "--max-size",
                             str(half * entry_bytes), "--dry-run")
    assert code == 0 and dry["dry_run"] and dry["deleted"] == before["entries"] - half
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["entries"] == before["entries"]  # a dry run deletes nothing
    code, [pruned] = store_json(capsys, "prune", "--config", str(path), "--max-size",
                                str(half * entry_bytes), "--older-than", "1w", "--yes")
    assert (pruned["deleted"], pruned["by_size"], pruned["by_age"]) == (before["entries"] - half,
                                                                        before["entries"] - half, 0)
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["entries"] == half and row["bytes"] == half * entry_bytes
    assert main(["store", "prune", "--config", str(path), "--older-than", "0s", "--yes"]) == 0
    assert f"lmdb: deleted {half} of {half} entries" in capsys.readouterr().out
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["entries"] == 0


@pytest.mark.parametrize("args, message", [
    (["--older-than", "7x", "--yes"], "argument --older-than: got '7x'; expected a number and a unit"),
    (["--older-than=-1d", "--yes"], "argument --older-than: got '-1d'"),
    (["--max-size", "10XB", "--yes"], "argument --max-size: got '10XB'; expected a size"),
    (["--max-size", "0", "--yes"], "argument --max-size: got '0'; expected a size >= 1 byte"),
    (["--yes"], "store prune needs --older-than AGE, --max-size SIZE or both"),
    (["--older-than", "7d"], "store prune deletes entries and asks no question: add --yes"),
])
def test_prune_refuses_bad_values_naming_the_flag(store, capsys, args, message):
    path, *_ = store
    assert main(["store", "prune", "--config", str(path), *args]) == 2
    assert message in capsys.readouterr().err
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["entries"] > 0


def test_store_without_tiers_or_with_an_unknown_tier_is_a_config_error(tmp_path, capsys):
    path = tmp_path / "plain.yaml"
    path.write_text("device: cpu\n")
    assert main(["store", "stats", "--config", str(path)]) == 2
    assert "no cache.tiers" in capsys.readouterr().err
    path.write_text("cache:\n  tiers:\n    - {type: host, size: 1MiB}\n")
    assert main(["store", "stats", "--config", str(path)]) == 2
    assert "lives in one process's memory" in capsys.readouterr().err
    path.write_text(f"cache:\n  tiers:\n    - {{type: lmdb, path: {tmp_path / 'kv'}}}\n")
    assert main(["store", "ls", "--config", str(path), "--tier", "lmbd"]) == 2
    assert "--tier: got 'lmbd'; expected one of ['lmdb']" in capsys.readouterr().err


def test_the_cli_uses_the_packaged_defaults_when_no_config_is_named(tmp_path):
    result = run("config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["model"] == "smollm2-135m-instruct"
    assert [(t["type"], t["path"], t["size"]) for t in printed["cache"]["tiers"]] == [
        ("lmdb", "./kvstore", "2GiB")]
    assert load_config(env={}).cache.tiers == ()  # the Python API keeps the device-only defaults
    assert "built-in defaults" in run("--help", cwd=tmp_path).stdout


def by_tier(stderr: str) -> dict[str, int]:
    """``cached tokens by tier: device=0, lmdb=80`` as a dict."""
    line = next(line for line in stderr.splitlines() if line.startswith("cached tokens by tier: "))
    pairs = line.removeprefix("cached tokens by tier: ").split(", ")
    return {k: int(v) for k, v in (pair.split("=") for pair in pairs if pair != "none")}


def test_generate_stats_shows_lmdb_hits_in_a_second_process(tmp_path, tiny_folder, capsys):
    """The first run is a real separate process; the later ones run in this process (a new
    Engine, so an empty device pool: every reused token must come from LMDB)."""
    path = write_config(tmp_path, tiny_folder)
    args = ("generate", "--config", str(path), "--prompt", PROMPTS[1], "--max-tokens", "3")
    first = run(*args, "--stats", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert by_tier(first.stderr).get("lmdb", 0) == 0
    assert main([*args, "--stats"]) == 0
    second = capsys.readouterr()
    assert second.out == first.stdout  # same answer whether the prefix was recomputed or reloaded
    reloaded = by_tier(second.err)["lmdb"]
    assert reloaded > 0 and reloaded % 4 == 0  # whole blocks of block_size 4
    assert f"cached tokens: {reloaded} of " in second.err
    assert any(line.startswith("time to first token: ") for line in second.err.splitlines())
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["text"] + "\n" == first.stdout
    assert data["cached_tokens_by_tier"]["lmdb"] == reloaded
    assert data["stats"]["tiers"] and data["stats"]["prompt_tokens_reused"] == reloaded


def test_warm_several_prompts_prints_the_total_and_the_stats_as_json(tmp_path, tiny_folder, capsys):
    path = write_config(tmp_path, tiny_folder)
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(PROMPTS[0] + "\n\n")
    assert main(["warm", "--config", str(path), "--prompts-file", str(prompts_file),
                 "--prompt", PROMPTS[1], "--stats", "--json"]) == 0
    captured = capsys.readouterr()
    found = re.fullmatch(r"warmed (\d+) prompt tokens in 2 prompts: kept in tier lmdb for later processes\n",
                         captured.out)
    assert found, captured.out
    count = int(found.group(1))
    stats = json.loads(captured.err)
    assert count > 0 and count % 4 == 0
    assert stats["prompt_tokens"] >= count and "lmdb" in stats["tiers"]


# -- the other persistent tiers, filled by their real tier classes (no engine needed) ---------------
def fill(tier_cls, options: dict, fingerprint: bytes, num: int) -> str:
    with tier_cls(**options, block_bytes=32, fingerprint=fingerprint, dtype="float32",
                  shape=(2, 4)) as tier:
        assert tier.put([(bytes([i + 1]) * 16, bytes([i]) * 32) for i in range(num)]) == num
        return tier.fp12


@pytest.mark.parametrize("kind", ["fsspec", "redis"])
def test_store_commands_on_fsspec_and_redis(kind, tmp_path, capsys, request):
    if kind == "fsspec":
        from corekv.tiers.fsspec import FsspecTier as tier_cls

        options = {"url": f"file://{tmp_path / 'fs'}"}
    else:
        from redis_server import RedisServer

        from corekv.tiers.redis import RedisTier as tier_cls

        server = RedisServer(tmp_path).start()
        request.addfinalizer(server.stop)
        options = {"url": server.url}
    fp_a, fp_b = fill(tier_cls, options, b"model-a", 3), fill(tier_cls, options, b"model-b", 2)
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump({"cache": {"tiers": [{"type": kind, **options}]}}))
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert code == 0 and row["entries"] == 5
    assert {m: (i["entries"], i["layouts"]) for m, i in row["models"].items()} == {
        fp_a: (3, ["float32[2, 4]"]), fp_b: (2, ["float32[2, 4]"])}
    # corrupt one entry of model b in the store's own way
    if kind == "fsspec":
        victim = next(p for p in (tmp_path / "fs" / fp_b).rglob("*") if p.is_file())
        victim.write_bytes(victim.read_bytes()[:-1])  # truncated
    else:
        import redis

        client = redis.Redis.from_url(server.url)
        key = next(client.scan_iter(match=f"corekv:{fp_b}:*"))
        client.set(key, client.get(key)[:-1])
        client.close()
    code, [checked] = store_json(capsys, "verify", "--config", str(path), "--delete-bad")
    assert code == 1 and (checked["good"], checked["bad"], checked["deleted"]) == (4, 1, 1)
    assert checked["bad_entries"][0]["model"] == fp_b
    assert checked["bad_entries"][0]["reason"].startswith("truncated")
    code, result = store_json(capsys, "clear", "--config", str(path), "--model", fp_a, "--yes")
    assert result["deleted"] == {kind: 3}
    code, [row] = store_json(capsys, "stats", "--config", str(path))
    assert row["entries"] == 1 and set(row["models"]) == {fp_b}
