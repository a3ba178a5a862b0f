"""Reload only where it beats recompute: a tier slower than the engine's prefill is bypassed once
measured, and ``cache.max_load_tokens`` caps what a request loads; outputs never change."""
from __future__ import annotations

import dataclasses
import time

from tier_helpers import BLOCK, GREEDY, PROMPT, evict, make_config, tier_config
from corekv.engine.llm_engine import Engine


def make_engine(model, tiers, **cache):
    config = make_config(tiers)
    return Engine(dataclasses.replace(config, cache=dataclasses.replace(config.cache, **cache)), model=model)


def uncached_tokens(model):
    with Engine(make_config(), model=model) as engine:
        return engine.generate(PROMPT, GREEDY)[0].token_ids


def slowed(tier, seconds_per_block: float):
    """``tier`` (a real host tier) made slow by a wrapper around its reads: every ``get_into``
    sleeps ``seconds_per_block`` per block asked for, then reads as usual."""
    get_into = tier.get_into

    def slow_get_into(keys, rows):
        time.sleep(seconds_per_block * len(keys))
        return get_into(keys, rows)

    tier.get_into = slow_get_into
    return tier


def test_a_tier_slower_than_recompute_is_bypassed_and_outputs_stay_the_same(tiny_llama, tmp_path):
    reference = uncached_tokens(tiny_llama)
    with make_engine(tiny_llama, [tier_config("host", tmp_path)], reload_policy="cost") as engine:
        slowed(engine.offload.tiers[0], 0.05)  # 50 ms a block; the tiny model computes one in < 1 ms
        outputs = []
        for _ in range(8):  # each round reloads (and times) PROMPT's 4 blocks until measured
            outputs.append(engine.generate(PROMPT, GREEDY)[0])
            evict(engine)
            if engine.stats()["reload"]["skipped_lookups"]:
                break
        bypassed = engine.generate(PROMPT, GREEDY)[0]
        stats = engine.stats()["reload"]
    assert outputs[1].cached_tokens_by_tier == {"device": 0, "host": 4 * BLOCK}  # unmeasured: loaded
    assert bypassed.cached_tokens_by_tier == {"device": 0}
    # NOTE: once measured, the tier is not even asked: its 4 hits could not save their load
    assert stats["skipped_lookups"] >= 2 and stats["load_s_per_block"]["host"] > stats["prefill_s_per_token"] * BLOCK
    assert all(out.token_ids == reference for out in outputs + [bypassed])


def test_always_loads_the_slow_tier(tiny_llama, tmp_path):
    with make_engine(tiny_llama, [tier_config("host", tmp_path)], reload_policy="always") as engine:
        slowed(engine.offload.tiers[0], 0.01)
        for _ in range(5):
            engine.generate(PROMPT, GREEDY)
            evict(engine)
        last = engine.generate(PROMPT, GREEDY)[0]
        stats = engine.stats()["reload"]
    assert last.cached_tokens_by_tier == {"device": 0, "host": 4 * BLOCK}
    assert stats["skipped_blocks"] == 0 and stats["load_s_per_block"]["host"] is not None


def test_max_load_tokens_caps_the_blocks_a_request_loads(tiny_llama, tmp_path):
    reference = uncached_tokens(tiny_llama)
    with make_engine(tiny_llama, [tier_config("host", tmp_path)], max_load_tokens=2 * BLOCK + 5) as engine:
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        capped = engine.generate(PROMPT, GREEDY)[0]
    assert capped.cached_tokens_by_tier == {"device": 0, "host": 2 * BLOCK}
    assert capped.token_ids == reference
