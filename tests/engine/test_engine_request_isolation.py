"""One request's arguments cannot fail another's: the argument checks refuse what the sampler
cannot take, and behind them a request whose sampling still fails is aborted alone, with its
error, while the requests that shared its step finish exactly as they would without it.

The poisoned requests here carry values the checks refuse, written into a built SamplingParams
with ``object.__setattr__``: the only way to reach ``engine.step()`` with them now (the first
wall holds, see test_engine_sampling.py), and exactly what a check that misses a case would let
through."""
from __future__ import annotations

import math

import pytest

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

INNOCENT = [
    ("greedy", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
    ("seeded", SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)),
    ("penalised", SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3,
                                 ignore_eos=True)),
]
PROMPTS = ["the first innocent prompt", "a second innocent one", "and a third"]


def make_engine(loaded) -> Engine:
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=64, block_size=16,
                                                   max_num_batched_tokens=256),
                 cache=CacheConfig(backend="radix"))
    return Engine(cfg, model=loaded)


def poisoned(**fields) -> SamplingParams:
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)  # NOTE: past the checks, on purpose (see above)
    return params


@pytest.fixture(scope="module")
def alone(tiny_llama):
    """What each innocent request yields with no other request in the engine."""
    with make_engine(tiny_llama) as engine:
        return [engine.generate(p, params)[0].token_ids for p, (_, params) in zip(PROMPTS, INNOCENT)]


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 10**20},  # an int torch cannot convert: OverflowError in the processors
    {"temperature": math.nan},  # NaN weights: the sampler picks past the vocabulary
    {"temperature": 1e-300, "top_p": 0.5},  # float32 underflow: an index error in top-p
    {"temperature": 10**20, "seed": 3},
], ids=["repetition_penalty", "nan_temperature", "tiny_temperature", "huge_int_temperature"])
def test_a_request_whose_sampling_fails_is_aborted_alone(tiny_llama, alone, fields):
    with make_engine(tiny_llama) as engine:
        ids = [engine.add_request(p, params) for p, (_, params) in zip(PROMPTS, INNOCENT)]
        bad = engine.add_request("the poisoned prompt", poisoned(**fields))
        outputs = {}
        while engine.has_unfinished_requests:
            outputs.update((o.request_id, o) for o in engine.step())
        assert outputs[bad].finish_reason == "abort"
        assert "sampling this request failed" in outputs[bad].error
        for request_id, expected, (name, _) in zip(ids, alone, INNOCENT):
            assert outputs[request_id].error is None, name
            assert outputs[request_id].token_ids == expected, name
        # the engine keeps serving, its pool whole
        assert engine.generate(PROMPTS[0], INNOCENT[0][1])[0].token_ids == alone[0]
        assert engine.backend.num_free_blocks == engine.backend.num_blocks


def test_every_fork_of_a_failing_request_ends_and_the_others_go_on(tiny_llama, alone):
    with make_engine(tiny_llama) as engine:
        params = poisoned(repetition_penalty=10**20)
        object.__setattr__(params, "n", 3)
        good = engine.add_request(PROMPTS[1], INNOCENT[1][1])
        bad = engine.add_request("the poisoned prompt", params)
        outputs = {}
        while engine.has_unfinished_requests:
            outputs.update((o.request_id, o) for o in engine.step())
        assert [c.finish_reason for c in outputs[bad].outputs] == ["abort"] * 3
        assert outputs[good].token_ids == alone[1]


def test_generate_returns_the_failed_request_beside_the_others(tiny_llama, alone):
    with make_engine(tiny_llama) as engine:
        outs = engine.generate([PROMPTS[0], "poisoned"], [INNOCENT[0][1], poisoned(temperature=math.nan)])
    assert outs[0].token_ids == alone[0] and outs[0].error is None
    assert outs[1].finish_reason == "abort" and outs[1].error


class ExplodesOnPoison:
    """A real plugin whose finish hook fails for one request's output."""

    from corekv.plugin import hookimpl

    @hookimpl
    def corekv_on_request_finished(self, output) -> None:
        if "poisoned" in str(output.prompt):
            raise RuntimeError("plugin exploded")


def test_a_plugin_failing_on_one_requests_output_fails_that_request_alone(tiny_llama, alone):
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=256),
                 cache=CacheConfig(backend="radix"))
    with Engine(cfg, model=tiny_llama, plugins=(ExplodesOnPoison(),)) as engine:
        same = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        outs = engine.generate([PROMPTS[0], "the poisoned prompt"], [INNOCENT[0][1], same])
    assert outs[0].token_ids == alone[0] and outs[0].error is None
    assert "plugin exploded" in outs[1].error and len(outs[1].token_ids) == 10
