"""Swap preemption through the host and shm tiers (same outputs as recompute, fewer tokens recomputed) and
a property test of salt isolation at engine level across every tier kind."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from corekv.engine.sampling import SamplingParams
from corekv.errors import ConfigError
from corekv.hashing import PrefixKey, chain_seed
from corekv.offload.swap import _private_key
from tier_helpers import FILLERS, KINDS, evict, make_engine, tier_config

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
#: four prompts of 52-112 tokens growing by 40 (6-10 blocks each) in a 14-block pool: decodes
#: preempt, and the lengths differ so a victim is caught with a partly filled last block
SWAP_PROMPTS = [f"request {i} wants a long answer about paged attention" + " more" * (4 * i) for i in range(4)]
SWAP_POOL = 14


def run_preempting(model, tmp_path, preemption, kind="host"):
    with make_engine(model, [tier_config(kind, tmp_path)], num_blocks=SWAP_POOL, preemption=preemption) as engine:
        outputs = engine.generate(SWAP_PROMPTS, LONG)
        return [o.token_ids for o in outputs], engine.stats()


@pytest.mark.parametrize("kind", ["host", "shm"])  # the tiers whose class says supports_swap
def test_swap_preemption_equals_recompute_and_recomputes_less(tiny_llama, tmp_path, kind):
    recompute_tokens, recompute = run_preempting(tiny_llama, tmp_path, "recompute")
    swap_tokens, swap = run_preempting(tiny_llama, tmp_path, "swap", kind)
    assert recompute["num_preemptions"] > 0 and swap["num_preemptions"] > 0
    assert swap_tokens == recompute_tokens
    assert swap["num_swapped_out_blocks"] > 0 and swap["num_swapped_in_blocks"] > 0
    assert swap["tokens_computed"] < recompute["tokens_computed"]
    assert recompute["num_swapped_out_blocks"] == 0


def test_swap_refuses_to_start_without_a_tier_that_supports_swap(tiny_llama, tmp_path):
    """A config built by hand skips load_config's check; the engine's build refuses it too."""
    with pytest.raises(ConfigError, match=r"^engine.preemption: 'swap' needs a tier that can hold "
                                          r"swapped blocks \(supports_swap: host, shm\)") as info:
        make_engine(tiny_llama, [tier_config("lmdb", tmp_path)], num_blocks=SWAP_POOL, preemption="swap")
    assert info.value.path == "engine.preemption"


def test_private_swap_keys_differ_between_processes():
    """Processes sharing an shm tier never meet on a private key, even a forked child parking
    the same sequence under the same owner name."""
    key = PrefixKey(list(range(40)), 16, chain_seed("m", 16))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its key, then out without running the parent's cleanup
        os.write(write, _private_key(key, "req-0|0|1", 2, 40))
        os._exit(0)
    os.close(write)
    child_key = os.read(read, 64)
    os.waitpid(pid, 0)
    os.close(read)
    assert len(child_key) == 16 and child_key != _private_key(key, "req-0|0|1", 2, 40)
    assert _private_key(key, "req-0|0|1", 2, 40) == _private_key(key, "req-0|0|1", 2, 40)


def test_prefill_first_gives_first_tokens_sooner_and_the_same_outputs(tiny_llama, tmp_path):
    """engine.prefill_first: a waiting prompt preempts decodes (swapped to the host tier) for its
    blocks, so every request's first token comes in fewer steps; the outputs are those of the
    default order. Steps, not seconds: the decision is what is tested."""
    runs = {}
    for prefill_first in (False, True):
        with make_engine(tiny_llama, [tier_config("host", tmp_path)], num_blocks=SWAP_POOL, preemption="swap",
                         prefill_first=prefill_first) as engine:
            ids = [engine.add_request(p, LONG) for p in SWAP_PROMPTS]
            seqs, first_step, outputs, steps = list(engine.scheduler.waiting), {}, {}, 0
            while engine.has_unfinished_requests:
                outputs.update((o.request_id, o) for o in engine.step())
                steps += 1
                first_step.update((s.request_id, steps) for s in seqs
                                  if s.num_output_tokens and s.request_id not in first_step)
            runs[prefill_first] = ([outputs[i].token_ids for i in ids], [first_step[i] for i in ids], engine.stats())
    (default_tokens, default_first, _), (tokens, first, stats) = runs[False], runs[True]
    assert tokens == default_tokens
    assert stats["num_swapped_out_blocks"] > 0 and stats["num_swapped_in_blocks"] > 0
    assert max(first) < max(default_first) and sum(first) < sum(default_first), (first, default_first)


def test_swap_without_prefix_caching_still_restores_the_blocks(tiny_llama, tmp_path):
    recompute_tokens, _ = run_preempting(tiny_llama, tmp_path, "recompute")
    with make_engine(tiny_llama, [tier_config("host", tmp_path)], num_blocks=SWAP_POOL, preemption="swap",
                     enable_prefix_caching=False) as engine:
        outputs = engine.generate(SWAP_PROMPTS, LONG)
        stats = engine.stats()
    assert [o.token_ids for o in outputs] == recompute_tokens
    assert stats["num_preemptions"] > 0 and stats["num_swapped_in_blocks"] > 0


# NOTE: None and "" are the same salt (no salt), see corekv.hashing.chain_seed
SALTS = st.one_of(st.none(), st.text(min_size=1, max_size=6))


@pytest.mark.parametrize("kind", KINDS)
def test_no_cross_salt_hit_in_any_tier(tiny_llama, kind, tmp_path, request):
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    with make_engine(tiny_llama, [tier_config(kind, tmp_path, url)]) as engine:

        @settings(max_examples=3, deadline=None, database=None)
        @given(salts=st.lists(SALTS, min_size=2, max_size=2, unique=True),
               text=st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=40, max_size=60))
        def check(salts, text):
            owner, other = salts
            engine.generate(text, greedy, cache_salt=owner)
            evict(engine, FILLERS[:3])
            foreign = engine.generate(text, greedy, cache_salt=other)[0]
            assert foreign.num_cached_tokens == 0
            assert all(v == 0 for v in foreign.cached_tokens_by_tier.values()), foreign.cached_tokens_by_tier
            evict(engine, FILLERS[:3])
            # the owner's salt still finds its blocks in the tier: the check above could fail
            own = engine.generate(text, greedy, cache_salt=owner)[0]
            assert own.cached_tokens_by_tier.get(kind.split("-")[0], 0) > 0, own.cached_tokens_by_tier

        check()


def test_a_request_aborted_while_swapped_out_leaves_no_private_block(tiny_llama, tmp_path):
    with make_engine(tiny_llama, [tier_config("host", tmp_path)], num_blocks=SWAP_POOL, preemption="swap") as engine:
        ids = [engine.add_request(p, LONG) for p in SWAP_PROMPTS]
        swapped, outputs = None, {}
        while swapped is None and engine.has_unfinished_requests:
            outputs.update((o.request_id, o) for o in engine.step())
            swapped = next((s for s in engine.scheduler.waiting if s.swap and s.swap.private_key), None)
        assert swapped is not None, "no sequence was swapped out with a partial block; adjust the prompts"
        host = engine.offload.tiers[0]
        assert host.exists([swapped.swap.private_key]) == 1
        key = swapped.swap.private_key
        engine.abort(swapped.request_id)
        while engine.has_unfinished_requests:
            outputs.update((o.request_id, o) for o in engine.step())
        assert outputs[swapped.request_id].finish_reason == "abort"
        assert set(outputs) == set(ids)
        assert host.exists([key]) == 0
