"""The engine with storage tiers: a prefix reloaded from host, LMDB, fsspec (file:// and memory://)
or Redis (a real redis-server) gives the same tokens and bit-identical logits as a device hit;
the per-tier output and stats; write-through and the per-request opt-out; config errors."""
from __future__ import annotations

import pytest
import torch

from corekv.engine.tiny_model import make_tiny_llama
from corekv.errors import ConfigError
from corekv.offload import NullOffload
from tier_helpers import (BLOCK, GREEDY, KINDS, PROMPT, LogitsProbe, evict, make_config, make_engine,
                          tier_config)
from corekv.engine.llm_engine import Engine


@pytest.fixture(scope="module")
def device_hit_reference(tiny_llama):
    """PROMPT's output and first-token logits when its prefix hits on the device (no tiers)."""
    with make_engine(tiny_llama, num_blocks=64) as engine:
        probe = LogitsProbe(engine)
        engine.generate(PROMPT, GREEDY)
        output, logits = probe.first_token_logits(engine, PROMPT)
    assert output.cached_tokens_by_tier == {"device": 4 * BLOCK}
    return output, logits


def tier_for(kind, tmp_path, request, **options):
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    return tier_config(kind, tmp_path, url, **options)


@pytest.mark.parametrize("kind", KINDS)
def test_a_reloaded_prefix_gives_bit_identical_logits(tiny_llama, device_hit_reference, kind, tmp_path, request):
    reference, reference_logits = device_hit_reference
    tier = tier_for(kind, tmp_path, request)
    with make_engine(tiny_llama, [tier]) as engine:
        probe = LogitsProbe(engine)
        first = engine.generate(PROMPT, GREEDY)[0]
        assert first.num_cached_tokens == 0
        evict(engine)
        assert engine.backend.match(engine.prefix_key(reference.prompt_token_ids)) == []
        output, logits = probe.first_token_logits(engine, PROMPT)
        stats = engine.stats()["tiers"][tier.name]
    assert output.token_ids == reference.token_ids == first.token_ids
    assert output.cached_tokens_by_tier == {"device": 0, tier.name: 4 * BLOCK}
    assert output.num_cached_tokens == reference.num_cached_tokens == 4 * BLOCK
    assert torch.equal(logits, reference_logits)
    assert stats["reloads"] == 4 and stats["offloads"] >= 4 and stats["faults"] == 0
    assert stats["hits"] >= 4 and stats["bytes"] > 0


def test_a_prefix_continues_from_host_into_lmdb_and_is_promoted(tiny_llama, device_hit_reference, tmp_path):
    reference, reference_logits = device_hit_reference
    lmdb_cfg = tier_config("lmdb", tmp_path)
    with make_engine(tiny_llama, [lmdb_cfg]) as engine:  # LMDB alone holds the prefix
        engine.generate(PROMPT, GREEDY)
    with make_engine(tiny_llama, [tier_config("host", tmp_path), lmdb_cfg]) as engine:
        probe = LogitsProbe(engine)
        output, logits = probe.first_token_logits(engine, PROMPT)
        assert output.cached_tokens_by_tier == {"device": 0, "lmdb": 4 * BLOCK}
        evict(engine)  # the reload was promoted to host; write-back also offloads on eviction
        again, again_logits = probe.first_token_logits(engine, PROMPT)
        assert again.cached_tokens_by_tier == {"device": 0, "host": 4 * BLOCK}
    assert output.token_ids == again.token_ids == reference.token_ids
    assert torch.equal(logits, reference_logits) and torch.equal(again_logits, reference_logits)


def test_write_through_offloads_as_blocks_fill(tiny_llama, tmp_path):
    tier = tier_config("host", tmp_path)
    with make_engine(tiny_llama, [tier], write_policy="write_through") as engine:
        engine.generate(PROMPT, GREEDY)
        engine.offload.flush()
        stats = engine.stats()["tiers"]["host"]
        key = engine.prefix_key(engine.encode(PROMPT))
        # 4 prompt blocks are full after the prefill (the 5th fills with generated tokens later)
        assert stats["offloads"] >= 4 and stats["evictions"] == 0
        assert engine.offload.tiers[0].exists(key.block_hashes[:4]) == 4


def test_the_per_request_opt_out_keeps_blocks_off_the_tiers(tiny_llama, tmp_path):
    for policy in ("write_back", "write_through"):
        with make_engine(tiny_llama, [tier_config("host", tmp_path)], write_policy=policy) as engine:
            engine.generate(PROMPT, GREEDY, offload=False)
            evict(engine)
            key = engine.prefix_key(engine.encode(PROMPT))
            assert engine.offload.tiers[0].exists(key.block_hashes) == 0, policy
            assert engine.stats()["tiers"]["host"]["offloads"] > 0, "the fillers were offloaded"
            again = engine.generate(PROMPT, GREEDY)[0]
            assert again.num_cached_tokens == 0
    with make_engine(tiny_llama, [tier_config("host", tmp_path)]) as engine:
        with pytest.raises(TypeError, match="offload.*bool"):
            engine.generate(PROMPT, GREEDY, offload="no")


def test_offload_min_hits_keeps_unreused_blocks_off_the_tiers(tiny_llama, tmp_path):
    cfg = make_config([tier_config("host", tmp_path)])
    cfg = type(cfg)(**{**cfg.__dict__, "cache": type(cfg.cache)(**{**cfg.cache.__dict__, "offload_min_hits": 1})})
    with Engine(cfg, model=tiny_llama) as engine:
        engine.generate(PROMPT, GREEDY)
        engine.generate(PROMPT, GREEDY)  # a device hit: PROMPT's blocks now qualify
        evict(engine)
        host = engine.offload.tiers[0]
        assert host.exists(engine.prefix_key(engine.encode(PROMPT)).block_hashes) == 4
        filler_key = engine.prefix_key(engine.encode("filler 0: unrelated text"))
        assert engine.stats()["tiers"]["host"]["offloads"] == 4, "fillers were never re-used"
        assert host.exists(filler_key.block_hashes[:1]) == 0


def test_without_tiers_the_engine_runs_on_a_null_offload(tiny_llama):
    """No tiers: the block manager calls a NullOffload's verbs like a real facade's (no branches),
    and the engine reports what it always did without tiers."""
    with make_engine(tiny_llama, preemption="swap") as engine:
        assert isinstance(engine.offload, NullOffload) and engine.blocks.offload is engine.offload
        first, second = engine.generate([PROMPT, PROMPT], GREEDY)
        stats = engine.stats()
    assert second.num_cached_tokens > 0 and second.cached_tokens_by_tier == {"device": second.num_cached_tokens}
    assert (stats["tiers"], stats["prefetch"], stats["reload"]) == ({}, {}, {})
    assert stats["num_swapped_out_blocks"] == 0


def test_config_errors_name_the_fix(tiny_llama, tmp_path):
    lmdb = tier_config("lmdb", tmp_path)
    with pytest.raises(ConfigError, match=r"engine.preemption.*swap.*a tier that can hold swapped blocks \(types: host, shm\)"):
        Engine.from_config({"model": "tiny", "engine": {"num_blocks": 12, "preemption": "swap"},
                            "cache": {"tiers": [{"type": "lmdb", **lmdb.options}]}}, model=tiny_llama)
    with pytest.raises(ConfigError, match="track_hashes"):
        cfg = make_config([tier_config("host", tmp_path)])
        cache = type(cfg.cache)(**{**cfg.cache.__dict__, "backend_options": {"track_hashes": False,
                                                                                "record_events": False}})
        Engine(type(cfg)(**{**cfg.__dict__, "cache": cache}), model=tiny_llama)


def test_a_foreign_model_never_hits(tiny_llama, tmp_path):
    """Keys carry the model fingerprint: another model's run finds nothing in the shared tier."""
    tier = tier_config("lmdb", tmp_path)
    with make_engine(tiny_llama, [tier]) as engine:
        engine.generate(PROMPT, GREEDY)
    other = make_tiny_llama(seed=1)
    with make_engine(other, [tier]) as engine:
        assert engine.generate(PROMPT, GREEDY)[0].num_cached_tokens == 0


def test_plugins_see_blocks_offloaded_and_loaded(tiny_llama, tmp_path):
    from corekv.plugin import hookimpl

    class Recorder:
        def __init__(self):
            self.offloaded, self.loaded = [], []

        @hookimpl
        def corekv_on_blocks_offloaded(self, tier, block_hashes):
            self.offloaded.append((tier, len(block_hashes)))

        @hookimpl
        def corekv_on_blocks_loaded(self, tier, block_hashes):
            self.loaded.append((tier, list(block_hashes)))

    recorder = Recorder()
    with Engine(make_config([tier_config("host", tmp_path)]), model=tiny_llama, plugins=(recorder,)) as engine:
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        engine.generate(PROMPT, GREEDY)
        key = engine.prefix_key(engine.encode(PROMPT))
    assert sum(n for tier, n in recorder.offloaded if tier == "host") >= 4
    assert recorder.loaded == [("host", key.block_hashes[:4])]


@pytest.mark.slow
def test_smollm2_prefix_from_lmdb_after_a_restart_gives_identical_logits(smollm2, tmp_path):
    """The real model: a prefix stored by one engine's close and reloaded by the next gives the
    device hit's tokens and bit-identical logits."""
    prompt = "You are a concise assistant. Explain in one sentence why caching the keys and values helps."
    params = GREEDY.__class__(max_tokens=3, temperature=0.0, ignore_eos=True)
    with make_engine(smollm2, num_blocks=16) as engine:
        probe = LogitsProbe(engine)
        engine.generate(prompt, params)
        reference, reference_logits = probe.first_token_logits(engine, prompt, params)
    tier = tier_config("lmdb", tmp_path, size=64 << 20)
    with make_engine(smollm2, [tier], num_blocks=16) as engine:
        engine.generate(prompt, params)
    with make_engine(smollm2, [tier], num_blocks=16) as engine:
        probe = LogitsProbe(engine)
        output, logits = probe.first_token_logits(engine, prompt, params)
    assert reference.num_cached_tokens > 0
    assert output.cached_tokens_by_tier == {"device": 0, "lmdb": reference.num_cached_tokens}
    assert output.token_ids == reference.token_ids
    assert torch.equal(logits, reference_logits)
