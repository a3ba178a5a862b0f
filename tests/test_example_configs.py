"""The YAML files in examples/configs/: each loads, says what its name promises, and round-trips.

Loading validates every field and every tier's options against the installed plugins; it does not
connect to Redis or open LMDB, so these tests need neither.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import corekv
from corekv.config import dump_config

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
NAMES = ("minimal", "tiered", "shared", "multitenant", "pinned", "vllm")
TIER_TYPES = {  # what each file's name promises
    "minimal": [],
    "tiered": ["host", "lmdb"],
    "shared": ["host", "redis"],
    "multitenant": ["host"],  # NOTE: memory only, so multi_tenant.py's checks start from a fresh cache
    "pinned": ["host", "lmdb"],
    "vllm": ["shm", "lmdb"],  # NOTE: the connector's config: only the cache section applies
}


def load(name: str) -> corekv.Config:
    return corekv.load_config(CONFIGS / f"{name}.yaml", env={})


def test_every_example_config_is_tested():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_for_the_default_model_with_the_promised_tiers(name):
    cfg = load(name)
    assert cfg.model == "smollm2-135m-instruct"
    assert [t.type for t in cfg.cache.tiers] == TIER_TYPES[name]
    assert cfg.engine.enable_prefix_caching


@pytest.mark.parametrize("name", NAMES)
def test_config_explains_its_choices_in_comments(name):
    lines = (CONFIGS / f"{name}.yaml").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith(f"# {name}.yaml:"), "the first line says what the file is for"
    commented = [ln for ln in lines if "#" in ln]
    assert len(commented) >= 4, f"{name}.yaml: explain the choices in comments"


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trips_through_dump_config(name):
    cfg = load(name)
    assert corekv.load_config(dump_config(cfg), env={}) == cfg


def test_tier_options_are_filled_and_converted():
    tiered, shared = load("tiered"), load("shared")
    lmdb = tiered.cache.tiers[1].options
    assert lmdb["path"] == "./kvstore" and lmdb["size"] == 4 * 2**30 and lmdb["sync"] is True
    redis = shared.cache.tiers[1].options
    assert redis["url"] == "redis://127.0.0.1:6379/0" and redis["ttl"] == 86400
    # NOTE: other processes must hit this one's blocks as soon as they are full
    assert shared.cache.write_policy == "write_through"


def test_pinned_config_pins_a_shared_and_a_tenant_prefix():
    cfg = load("pinned")
    entries = cfg.cache.pinned
    assert [e.salt for e in entries] == [None, "tenant-a"]
    assert all(e.chat and e.text for e in entries)
    assert 0 < cfg.cache.max_pinned_fraction < 1


def test_pinned_config_starts_an_engine_that_pins_its_prefixes(tmp_path):
    """A real engine (a tiny random Llama instead of SmolLM2, the LMDB store in tmp_path)."""
    import dataclasses

    from corekv.config import TierConfig
    from corekv.engine.tiny_model import make_tiny_llama

    cfg = load("pinned")
    tiers = tuple(TierConfig(t.type, t.name, {**t.options, "path": str(tmp_path / "kvstore")})
                  if t.type == "lmdb" else t for t in cfg.cache.tiers)
    cfg = dataclasses.replace(cfg, device="cpu",
                              cache=dataclasses.replace(cfg.cache, tiers=tiers))
    with corekv.Engine.from_config(cfg, model=make_tiny_llama()) as engine:
        assert engine.stats()["kv_num_pinned_blocks"] > 0
        system = [{"role": "system", "content": cfg.cache.pinned[1].text}]
        # the tenant's prefix is pinned under its salt only
        assert engine.unpin(system, cache_salt="tenant-a") > 0
        assert engine.unpin(system) == 0
    assert (tmp_path / "kvstore" / "data.mdb").exists()
