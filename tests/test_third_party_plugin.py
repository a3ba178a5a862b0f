"""The example third-party package (examples/third_party_plugin) installs, is found, and runs.

The package is copied to a temporary folder (so its build leaves nothing in the repository),
installed into this venv with pip (no index, no build isolation: offline and fast), checked, and
uninstalled when the module's tests are done, so other tests stay hermetic. Its runtime
dependency ``zstandard`` and the build backend ``setuptools`` come from corekv's ``test`` extra.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from corekv.block_format import HEADER_SIZE
from corekv.plugin import AUTOLOAD_ENV, make_plugin_manager
from corekv.testing.tier import block_payload, make_keys

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "examples" / "third_party_plugin"
DISTRIBUTION = "corekv-example-plugins"
pytest.importorskip("zstandard", reason="the example package needs zstandard (corekv's test extra)")


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)


def env_with_autoload() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(AUTOLOAD_ENV, None)  # third-party entry points load only with autoload on
    return env


def run_corekv(*args: str) -> subprocess.CompletedProcess:
    """The corekv CLI in a fresh process that loads the installed entry points."""
    return subprocess.run([sys.executable, "-c", "from corekv.cli import main; raise SystemExit(main())",
                           *args], capture_output=True, text=True, timeout=300, env=env_with_autoload())


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    source = tmp_path_factory.mktemp("package") / "third_party_plugin"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    result = pip("install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(source))
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    importlib.invalidate_caches()
    yield source
    result = pip("uninstall", "-y", "-q", DISTRIBUTION)
    importlib.invalidate_caches()
    assert result.returncode == 0, f"pip uninstall failed:\n{result.stdout}\n{result.stderr}"


def test_corekv_plugins_lists_its_tier_and_backend_with_the_distribution(installed):
    result = run_corekv("plugins", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["tiers"]["compressed_host"]["distribution"] == DISTRIBUTION
    assert info["backends"]["lfu_blocks"]["distribution"] == DISTRIBUTION
    assert set(info["tiers"]["compressed_host"]["options"]) == {"size", "level", "shuffle"}
    assert info["tiers"]["compressed_files"]["distribution"] == DISTRIBUTION
    assert info["plugins"]["lfu_blocks"] == {"distribution": DISTRIBUTION}


def test_plain_corekv_plugins_table_names_the_distribution(installed):
    result = run_corekv("plugins")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    assert rows["compressed_host"][1] == DISTRIBUTION and rows["lfu_blocks"][1] == DISTRIBUTION


def test_autoload_off_keeps_third_party_plugins_out(installed):
    manager = make_plugin_manager(autoload=False)
    assert "lfu_blocks" not in manager.backends() and "compressed_host" not in manager.tiers()


def test_its_own_conformance_tests_pass(installed):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(installed / "tests")], capture_output=True, text=True, timeout=600,
                            cwd=installed, env=env_with_autoload())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    num_passed = int(re.search(r"(\d+) passed", result.stdout).group(1))
    # NOTE: the tier, admin-view and backend suites make over 200 tests; fewer means one did not run
    assert num_passed >= 200, f"expected every conformance suite to run, got:\n{result.stdout[-2000:]}"


def test_its_fifo_eviction_policy_is_chosen_in_yaml_for_a_backend_and_a_tier(installed, tmp_path, monkeypatch):
    """corekv_register_eviction_policies: a third party's policy is a name in the config like
    corekv's own, reaching the backend and the tier built from it."""
    import corekv
    from corekv.eviction import resolve_policy_options
    from corekv.tier_factory import make_tier

    config = tmp_path / "cache.yaml"
    config.write_text("cache:\n  backend: hash_blocks\n  backend_options: {eviction: fifo}\n"
                      "  tiers:\n    - {type: host, size: 1MiB, eviction: fifo}\n")
    with pytest.raises(corekv.ConfigError, match=r"backend_options\.eviction: got 'fifo'; expected "
                       r"one of lfu, lru, priority"):
        corekv.load_config(config, env={}, plugin_manager=make_plugin_manager(autoload=False))
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    manager = make_plugin_manager()
    assert manager.eviction_policies()["fifo"].distribution == DISTRIBUTION
    cfg = corekv.load_config(config, env={}, plugin_manager=manager)
    spec = manager.backends()["hash_blocks"]
    backend = spec.factory(8, 4, **resolve_policy_options(spec.options, cfg.cache.backend_options, manager))
    assert backend.eviction.name == "fifo"
    tier_cfg = cfg.cache.tiers[0]
    tier_spec = manager.tiers()["host"]
    with make_tier(tier_spec, resolve_policy_options(tier_spec.options, tier_cfg.options, manager),
                   block_bytes=64, fingerprint=b"m") as tier:
        assert tier.eviction.name == "fifo"


def test_corekv_store_lists_verifies_and_clears_its_file_tier(installed, tmp_path, monkeypatch):
    """The file tier declares an admin view, so ``corekv store`` reads it with no code in corekv;
    the in-memory tier declares none and is skipped with a note."""
    from corekv.tier_factory import make_tier

    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    spec = make_plugin_manager().tiers()["compressed_files"]
    model_to_keys = {}
    for fingerprint, num in ((b"model-a", 3), (b"model-b", 2)):
        with make_tier(spec, {"path": str(tmp_path / "kv"), "level": 3}, block_bytes=64,
                       fingerprint=fingerprint, dtype="float32", shape=(2, 8)) as tier:
            keys = make_keys(num, salt=fingerprint.decode())
            assert tier.put([(k, block_payload(k, 64)) for k in keys]) == num
            model_to_keys[tier.fp12] = keys
    config = tmp_path / "cache.yaml"
    config.write_text("cache:\n  tiers:\n    - {type: compressed_host, size: 1MiB}\n"
                      f"    - {{type: compressed_files, path: {tmp_path / 'kv'}}}\n")
    skipped = ("note: skipped tier compressed_host (compressed_host: lives in one process's "
               "memory, nothing persists to inspect)")

    listed = run_corekv("store", "ls", "--config", str(config), "--json")
    assert listed.returncode == 0, listed.stderr
    assert skipped in listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted((r["model"], r["key"]) for r in rows) == sorted(
        (model, k.hex()) for model, keys in model_to_keys.items() for k in keys)
    assert {(r["tier"], r["bytes"], r["dtype"], str(r["shape"])) for r in rows} == {
        ("compressed_files", HEADER_SIZE + 64, "float32", "[2, 8]")}

    fp_b = [model for model, keys in model_to_keys.items() if len(keys) == 2][0]
    next((tmp_path / "kv" / fp_b).iterdir()).write_bytes(b"not a zstd frame")
    verified = run_corekv("store", "verify", "--config", str(config), "--delete-bad")
    assert verified.returncode == 1, verified.stderr
    assert verified.stdout.splitlines()[0] == "compressed_files: 4 good, 1 bad, 1 deleted"
    assert f"(model {fp_b}): truncated" in verified.stdout
    cleared = run_corekv("store", "clear", "--config", str(config), "--all-models", "--yes")
    assert (cleared.returncode, cleared.stdout) == (0, "compressed_files: deleted 4 entries of every model\n")
    stats = run_corekv("store", "stats", "--config", str(config))
    assert (stats.returncode, stats.stdout) == (0, "compressed_files (compressed_files): 0 entries, 0 B of unbounded\n")


def test_an_engine_runs_from_a_yaml_config_that_selects_its_backend_and_tier(
        installed, tiny_model_folder, tmp_path, monkeypatch):
    import corekv
    from corekv.tier_factory import make_tier

    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    config_path = tmp_path / "cache.yaml"
    config_path.write_text(f"""\
model: {tiny_model_folder}
dtype: float32
device: cpu
engine:
  block_size: 16
  num_blocks: 12
cache:
  backend: lfu_blocks
  backend_options: {{frequency_cap: 4}}
  tiers:
    - {{type: compressed_host, size: 4MiB, level: 3}}
""")
    cfg = corekv.load_config(config_path)
    assert cfg.cache.tiers[0].options == {"size": 4 * 2**20, "level": 3, "shuffle": True}
    greedy = corekv.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    system = "You are a terse assistant. Answer in one word. " * 2
    with corekv.Engine.from_config(cfg) as engine:
        backend = engine.backend
        assert type(backend).__module__ == "corekv_example_plugins.lfu_blocks"
        assert backend.frequency_cap == 4
        first = engine.generate(system + "Q1", greedy)[0]
        repeats = [engine.generate(system + "Q1", greedy)[0] for _ in range(2)]
        assert first.num_cached_tokens == 0 and all(r.num_cached_tokens > 0 for r in repeats)
        assert all(r.token_ids == first.token_ids for r in repeats)  # a hit changes no output
        # NOTE: only the blocks the repeats hit count as hot: the last prompt token is always
        # computed, so a prompt ending on a block boundary never hits its last block.
        hot = backend.match(engine.prefix_key(first.prompt_token_ids))[:repeats[0].num_cached_tokens // 16]
        assert hot and all(backend.hit_count(b) == 2 for b in hot)
        for i in range(6):  # one-off prompts overflow the small pool: LRU would evict the hot prefix
            engine.generate(f"Unrelated one-off prompt number {i} " * 3, greedy)
        assert backend.match(engine.prefix_key(first.prompt_token_ids))[:len(hot)] == hot

        # The tier the config selected, built as the engine builds tiers, round-trips real KV.
        tier_cfg = cfg.cache.tiers[0]
        pool = engine.kv_pool
        spec = engine.plugin_manager.tiers()[tier_cfg.type]
        with make_tier(spec, tier_cfg.options, block_bytes=pool.bytes_per_block,
                       fingerprint=engine.model.fingerprint, dtype="float32",
                       shape=pool.block_shape) as tier:
            blocks = pool.read_blocks(hot).numpy()
            hashes = [backend.block_hash(b) for b in hot]
            assert tier.put(list(zip(hashes, blocks))) == len(hot)
            out = np.zeros_like(blocks)
            assert tier.get_into(hashes, list(out)) == [True] * len(hot)
            assert np.array_equal(out, blocks) and tier.compression_ratio > 1.0
        # NOTE: once the engine builds cache.tiers itself, its stats name the configured tier.
        if engine.stats()["tiers"]:
            assert "compressed_host" in engine.stats()["tiers"]
