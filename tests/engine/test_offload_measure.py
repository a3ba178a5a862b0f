"""The measurement that seeds the reload cost model when a tier opens (corekv.offload.measure):
on real tiers, and bounded on a store that never answers (tests/stalled_endpoint.py)."""
from __future__ import annotations

import pytest

import corekv
from corekv.offload.measure import PROBE_KEY, measure_tier
from corekv.testing.tier import TierTests
from corekv.tiers.host import HostTier
from corekv.tiers.lmdb import LMDBTier
from corekv.tiers.redis import RedisTier
from stalled_endpoint import stalled_endpoint  # noqa: F401 (fixture)

BLOCK = 4096


def test_a_tier_that_answers_is_measured_and_keeps_one_probe_entry(tmp_path):
    with LMDBTier(path=str(tmp_path / "kv"), size=16 << 20, block_bytes=BLOCK,
                  fingerprint=TierTests.fingerprint, sync=False) as tier:
        first = measure_tier(tier)
        again = measure_tier(tier)  # another process's start: the same entry, nothing added
        assert first is not None and again is not None
        assert first.latency_s >= 0 and first.s_per_block >= 0
        assert first.bytes_per_s is None or first.bytes_per_s > 0
        assert list(tier.keys()) == [PROBE_KEY] and tier.contains(PROBE_KEY)


def test_a_stalled_store_is_not_measured_and_costs_about_one_deadline(stalled_endpoint):  # noqa: F811
    with RedisTier(url=f"redis://127.0.0.1:{stalled_endpoint.port}/0", socket_timeout=0.2,
                   retry_interval=60, block_bytes=BLOCK, fingerprint=TierTests.fingerprint) as tier:
        assert measure_tier(tier) is None
        assert tier.stats()["errors"] == 1  # one call met the deadline; the cool-down took the rest


def test_a_failing_tier_is_not_measured_and_raises_nothing():
    class Broken(HostTier):
        def _contains_entries(self, keys):
            raise RuntimeError("a plugin's bug")

    with Broken(size=1 << 20, block_bytes=BLOCK, fingerprint=TierTests.fingerprint) as tier:
        assert measure_tier(tier) is None


@pytest.mark.parametrize("policy, is_seeded", [("cost", True), ("always", False)])
def test_an_engine_seeds_its_cost_model_under_the_cost_policy_only(tiny_llama, tmp_path, policy, is_seeded):
    config = {"model": "tiny", "engine": {"num_blocks": 16, "block_size": 16},
              "cache": {"reload_policy": policy,
                        "tiers": [{"type": "host", "size": "1MiB"},
                                  {"type": "lmdb", "path": str(tmp_path / "kv"), "size": "16MiB", "sync": False}]}}
    with corekv.Engine.from_config(config, model=tiny_llama) as engine:
        stats = engine.stats()["reload"]
    assert stats["seeded"] == (["host", "lmdb"] if is_seeded else [])
    assert (stats["load_s_per_block"]["lmdb"] is not None) == is_seeded


def test_an_engine_starts_with_a_stalled_tier_under_the_cost_policy(tiny_llama, stalled_endpoint):  # noqa: F811
    config = {"model": "tiny", "engine": {"num_blocks": 16, "block_size": 16},
              "cache": {"reload_policy": "cost",
                        "tiers": [{"type": "host", "size": "1MiB"},
                                  {"type": "redis", "url": f"redis://127.0.0.1:{stalled_endpoint.port}/0",
                                   "socket_timeout": 0.2, "retry_interval": 60}]}}
    with corekv.Engine.from_config(config, model=tiny_llama) as engine:
        out = engine.generate("a prompt of a few blocks, long enough to fill two of them at least",
                              corekv.SamplingParams(max_tokens=2, temperature=0.0))[0]
        stats = engine.stats()["reload"]
    assert out.error is None and len(out.token_ids) == 2
    assert stats["seeded"] == ["host"]
