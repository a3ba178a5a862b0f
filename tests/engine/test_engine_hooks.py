"""Plugin hooks the engine calls, and the builtin ``pinned`` plugin (warm and pin cache.pinned).

A recorder plugin object observes every event hook; the pinned plugin runs from a real config on
the tiny Llama (its chat template is ChatML over a byte tokenizer).
"""
from __future__ import annotations

import logging

import pytest

from corekv.backend import BlockEvent
from corekv.config import CacheConfig, Config, EngineConfig, PinnedPrefix
from corekv.errors import ConfigError
from corekv.plugin import hookimpl
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class Recorder:
    """Records every engine event hook call, in order."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def corekv_on_engine_started(self, engine):
        self.calls.append(("started", engine, engine.stats()["kv_num_blocks"]))

    @hookimpl
    def corekv_on_engine_closed(self, engine):
        # the tiers' writes are finished and the pool is still there
        self.calls.append(("closed", engine, engine.kv_pool is not None))

    @hookimpl
    def corekv_on_blocks_stored(self, events):
        self.calls.append(("stored", events))

    @hookimpl
    def corekv_on_blocks_removed(self, events):
        self.calls.append(("removed", events))

    @hookimpl
    def corekv_on_request_finished(self, output):
        self.calls.append(("finished", output))

    def hashes(self, kind):
        return [h for call in self.calls if call[0] == kind for e in call[1] for h in e.block_hashes]


def make_engine(loaded, *, num_blocks=64, backend="hash_blocks", pinned=(), max_pinned_fraction=0.5,
                plugins=()):
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=num_blocks, block_size=16),
                 cache=CacheConfig(backend=backend, pinned=tuple(pinned),
                                   max_pinned_fraction=max_pinned_fraction))
    return Engine(cfg, model=loaded, plugins=plugins)


def test_engine_started_is_called_once_when_the_engine_is_ready(tiny_llama):
    recorder = Recorder()
    with make_engine(tiny_llama, plugins=[recorder]) as engine:
        assert recorder.calls == [("started", engine, 64)]
    assert recorder.calls == [("started", engine, 64), ("closed", engine, True)]
    engine.close()  # idempotent: closed is called once
    assert len(recorder.calls) == 2


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_blocks_stored_and_removed_events_carry_the_block_hashes(tiny_llama, backend):
    recorder = Recorder()
    with make_engine(tiny_llama, num_blocks=8, backend=backend, plugins=[recorder]) as engine:
        prompt = list(range(3, 43))  # 40 tokens: 2 full blocks
        engine.generate(prompt, GREEDY)
        expected = engine.prefix_key(prompt).block_hashes[:2]
        assert recorder.hashes("stored")[:2] == expected
        assert recorder.hashes("removed") == []
        for i in range(4):  # 4 x 3 blocks through an 8-block pool: the first prompt's blocks go
            engine.generate([100 + i] * 40, GREEDY)
        removed = recorder.hashes("removed")
        assert set(expected) <= set(removed) and set(removed) <= set(recorder.hashes("stored"))


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_stored_events_are_runs_of_the_chain_with_parent_and_tokens_and_a_reset_is_cleared(tiny_llama,
                                                                                          backend):
    recorder = Recorder()
    with make_engine(tiny_llama, backend=backend, plugins=[recorder]) as engine:
        first = list(range(3, 43))                     # 40 tokens: 2 full blocks
        second = first[:32] + list(range(50, 70))      # shares those 2, then 1 more full block
        engine.generate(first, GREEDY)
        engine.generate(second, GREEDY)
        engine.backend.reset()
        engine.step()                                  # a step with nothing to run publishes it
    h1, h2 = engine.prefix_key(first).block_hashes, engine.prefix_key(second).block_hashes
    stored = [e for call in recorder.calls if call[0] == "stored" for e in call[1]]
    assert stored == [BlockEvent("stored", tuple(h1[:2]), None, tuple(first[:32]), 16),
                      BlockEvent("stored", (h2[2],), h2[1], tuple(second[32:48]), 16)]
    removed = [e for call in recorder.calls if call[0] == "removed" for e in call[1]]
    assert len(removed) == 1 and removed[0].is_cleared
    assert sorted(removed[0].block_hashes) == sorted([*h1[:2], h2[2]])


def test_request_finished_gets_each_output_once(tiny_llama):
    recorder = Recorder()
    with make_engine(tiny_llama, plugins=[recorder]) as engine:
        outputs = engine.generate(["a", "bb", "ccc"], GREEDY)
        engine.warm(list(range(3, 40)))  # internal: no request_finished
    finished = [call[1] for call in recorder.calls if call[0] == "finished"]
    assert sorted(finished, key=lambda o: o.request_id) == sorted(outputs, key=lambda o: o.request_id)


SYSTEM = "You are a helpful assistant."


def test_pinned_entries_are_warmed_pinned_and_survive_eviction_pressure(tiny_llama):
    ids = tuple(range(3, 50))  # 47 tokens: 2 full blocks
    pinned = [PinnedPrefix(token_ids=ids), PinnedPrefix(text=SYSTEM, chat=True),
              PinnedPrefix(text="tenant prefix " * 3, salt="tenant-a")]
    with make_engine(tiny_llama, num_blocks=24, pinned=pinned) as engine:
        system_ids = engine.encode([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
        tenant_ids = engine.encode("tenant prefix " * 3)
        expected_blocks = len(ids) // 16 + len(system_ids) // 16 + len(tenant_ids) // 16
        assert engine.stats()["kv_num_pinned_blocks"] == expected_blocks
        engine.warm(list(range(200, 240)), pin=False)  # cached but not pinned: pressure evicts it
        for i in range(12):  # pressure: 12 prompts of 3 blocks through the 18 unpinned blocks
            engine.generate([60 + i] * 40, GREEDY)
        assert engine.generate(list(range(200, 240)), GREEDY)[0].num_cached_tokens == 0
        hits = engine.generate([list(ids) + [9, 9],
                                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
                                tenant_ids + [7], tenant_ids + [7]],
                               GREEDY, cache_salt=[None, None, "tenant-a", None])
    assert expected_blocks == 6
    assert [o.num_cached_tokens for o in hits] == [32, 32, 32, 0]


def test_unpin_releases_what_warm_pinned(tiny_llama):
    prompt = list(range(3, 40))
    with make_engine(tiny_llama) as engine:
        assert engine.warm(prompt) == 32
        assert engine.stats()["kv_num_pinned_blocks"] == 2
        assert engine.unpin(prompt) == 32
        assert engine.stats()["kv_num_pinned_blocks"] == 0
        assert engine.warm(prompt, pin=False) == 32  # still cached, just not pinned


def test_warm_of_a_prompt_shorter_than_a_block_keeps_nothing_and_says_so(tiny_llama, caplog):
    with make_engine(tiny_llama) as engine, caplog.at_level(logging.WARNING):
        assert engine.warm(list(range(3, 18))) == 0  # 15 tokens, one short of a block
        assert engine.stats()["kv_num_pinned_blocks"] == 0 and engine.stats()["num_steps"] == 0
    assert "the prompt is 15 tokens, shorter than one 16-token block (engine.block_size)" in caplog.text


def test_a_bad_pinned_entry_is_named_in_the_error(tiny_llama):
    # NOTE: load_config checks the entries, once; the pinned plugin trusts what it read
    with pytest.raises(ConfigError, match=r"^cache\.pinned\[1\]: got neither text nor token_ids; "
                                          r"expected exactly one of them"):
        Engine.from_config({"model": "tiny", "engine": {"num_blocks": 64, "block_size": 16},
                            "cache": {"backend": "hash_blocks", "pinned": [{"text": "fine"}, {}]}},
                           model=tiny_llama)
    with pytest.raises(ConfigError, match=r"cache\.pinned\[0\] \(100 token ids\).*max_pinned_fraction"):
        make_engine(tiny_llama, pinned=[PinnedPrefix(token_ids=tuple(range(3, 103)))],
                    max_pinned_fraction=0.05)
