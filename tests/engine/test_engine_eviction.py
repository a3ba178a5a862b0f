"""The engine under each eviction policy: a request's priority reaches the backend through its
PrefixKey, so under ``priority`` a high-priority prefix outlives newer ones that LRU would keep."""
from __future__ import annotations

import pytest

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def make_engine(model, eviction: str, backend: str) -> Engine:
    return Engine(Config(model="tiny", engine=EngineConfig(num_blocks=12, block_size=BLOCK,
                                                           max_num_batched_tokens=128),
                         cache=CacheConfig(backend=backend, backend_options={"eviction": eviction})),
                  model=model)


def prompt(start: int) -> list[int]:
    return list(range(start, start + 3 * BLOCK))   # three full blocks (+4 generated: a fourth)


@pytest.mark.parametrize("backend", ["radix", "hash_blocks"])
@pytest.mark.parametrize("eviction, kept", [("lru", "newest"), ("priority", "paid")])
def test_a_high_priority_prefix_outlives_newer_ones_only_under_the_priority_policy(
        tiny_llama, backend, eviction, kept):
    with make_engine(tiny_llama, eviction, backend) as engine:
        assert engine.backend.eviction.name == eviction
        paid, newer = prompt(10), [prompt(70), prompt(130), prompt(190)]
        engine.generate(paid, GREEDY, priority=5)
        for p in newer:   # the pool holds three prefixes: the third evicts one block
            engine.generate(p, GREEDY)
        paid_cached = len(engine.backend.match(engine.prefix_key(paid)))
        oldest_free_cached = len(engine.backend.match(engine.prefix_key(newer[0])))
    # NOTE: radix evicts the whole three-block leaf, hash_blocks one block from the tail
    if kept == "paid":
        assert paid_cached == 3 and oldest_free_cached < 3
    else:
        assert paid_cached < 3 and oldest_free_cached == 3


def test_warm_gives_its_blocks_the_priority(tiny_llama):
    with make_engine(tiny_llama, "priority", "radix") as engine:
        paid = prompt(10)
        assert engine.warm(paid, pin=False, priority=5) == 3 * BLOCK
        for start in (70, 130, 190):
            engine.generate(prompt(start), GREEDY)
        assert len(engine.backend.match(engine.prefix_key(paid))) == 3


@pytest.mark.parametrize("bad", ["high", 1.5, True])
def test_a_priority_must_be_an_int(tiny_llama, bad):
    with make_engine(tiny_llama, "priority", "radix") as engine:
        with pytest.raises(TypeError, match="^priority"):
            engine.generate(prompt(10), GREEDY, priority=bad)


@pytest.mark.parametrize("backend", ["radix", "hash_blocks"])
@pytest.mark.parametrize("kind", ["host", "lmdb"])
@pytest.mark.parametrize("eviction, is_paid_kept", [("lru", False), ("priority", True)])
def test_a_high_priority_prefix_outlives_newer_ones_in_a_tier_only_under_the_priority_policy(
        tiny_llama, tmp_path, backend, kind, eviction, is_paid_kept):
    """Blocks take their priority from the device into the tier (``EvictedBlock.priority``
    through the offload writer to ``Tier.put``): under ``priority`` a full tier drops the
    unpaid prefix and keeps the paid one, under LRU it drops both (the oldest)."""
    from tier_helpers import make_engine as make_tier_engine, tier_config
    from corekv.block_format import HEADER_SIZE

    def distinct(i: int) -> list[int]:   # three full blocks; the first token sets the chain apart
        return [i] + list(range(100, 100 + 3 * BLOCK - 1))

    with make_tier_engine(tiny_llama) as probe:
        entry_bytes = probe.kv_pool.bytes_per_block + HEADER_SIZE
    # room for about four prefixes of three blocks (LMDB's pages and B-tree take some of it)
    size = {"host": 12 * entry_bytes, "lmdb": 24 * (entry_bytes + 4096)}[kind]
    tier = tier_config(kind, tmp_path, size=size, eviction=eviction)
    with make_tier_engine(tiny_llama, [tier], backend=backend) as engine:
        paid, free = distinct(1), distinct(2)
        engine.generate(paid, GREEDY, priority=5)
        engine.generate(free, GREEDY, priority=0)
        for i in range(3, 12):   # newer prompts push both out of the pool, then out of the tier
            engine.generate(distinct(i), GREEDY)
        engine.offload.flush()
        stored = engine.offload.tiers[0]
        assert stored.stats()["evictions"] > 0
        paid_held = stored.exists(engine.prefix_key(paid).block_hashes[:3])
        free_held = stored.exists(engine.prefix_key(free).block_hashes[:3])
    assert free_held < 3
    assert paid_held == 3 if is_paid_kept else paid_held < 3
