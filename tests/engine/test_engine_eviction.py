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
