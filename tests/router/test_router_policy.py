"""Routing decisions of cache_aware and round_robin over real Worker objects (no network: a
policy reads only each worker's load and cache view)."""
from __future__ import annotations

import pytest

from corekv.router.policy import CacheAwareConfig, CacheAwarePolicy, RoundRobinPolicy, make_policy
from corekv.router.workers import Worker

BLOCK = 4
SYSTEM = list(range(100, 132))  # 8 blocks


def workers(n=3, **trees):
    out = [Worker(i, f"http://127.0.0.1:{9000 + i}", block_size=BLOCK, max_tree_blocks=1000)
           for i in range(n)]
    for index, token_ids in trees.items():
        out[int(index[1:])].routed_tree.insert(token_ids)
    return out


def policy(**kwargs):
    return CacheAwarePolicy(CacheAwareConfig(**kwargs))


def test_follows_the_longest_cached_prefix():
    ws = workers(w1=SYSTEM + [1, 2, 3, 4], w2=SYSTEM[:8])
    choice = policy().choose(ws, SYSTEM + [9, 9, 9, 9])
    assert (choice.worker.index, choice.reason, choice.matched_tokens) == (1, "cache", 32)


def test_below_the_threshold_goes_where_the_least_is_cached():
    ws = workers(w0=SYSTEM, w1=list(range(500, 540)), w2=[7] * 8)
    choice = policy(cache_threshold=0.5).choose(ws, SYSTEM[:8] + [1] * 32)  # 8 of 40 tokens
    assert (choice.worker.index, choice.reason) == (2, "free_cache")


def test_equal_matches_go_to_the_least_loaded():
    ws = workers(w0=SYSTEM, w1=SYSTEM, w2=[5] * 4)
    ws[0].load = 3
    assert policy().choose(ws, SYSTEM).worker.index == 1


def test_imbalanced_load_overrides_the_cache():
    ws = workers(w0=SYSTEM)
    ws[0].load, ws[1].load, ws[2].load = 10, 2, 4
    choice = policy(balance_abs_threshold=4, balance_rel_threshold=2.0).choose(ws, SYSTEM)
    assert (choice.worker.index, choice.reason) == (1, "balance")


@pytest.mark.parametrize("loads, imbalanced", [((10, 7), False),   # abs gap 3 <= 4
                                               ((10, 6), False),   # gap 4 is not > 4
                                               ((12, 7), False),   # 12 <= 7 * 2
                                               ((15, 7), True)])   # gap 8 > 4 and 15 > 14
def test_balance_needs_both_thresholds(loads, imbalanced):
    ws = workers(2, w0=SYSTEM)
    ws[0].load, ws[1].load = loads
    choice = policy(balance_abs_threshold=4, balance_rel_threshold=2.0).choose(ws, SYSTEM)
    assert (choice.reason == "balance") is imbalanced
    assert choice.worker.index == (1 if imbalanced else 0)


def test_salts_are_separate_namespaces():
    ws = workers(2)
    ws[0].routed_tree.insert(SYSTEM, "tenant-a")
    ws[1].load = 0
    assert policy().choose(ws, SYSTEM, "tenant-a").worker.index == 0
    assert policy().choose(ws, SYSTEM, "tenant-b").reason == "free_cache"


def test_events_view_also_follows_prompts_still_in_flight():
    ws = workers(2)
    ws[0].events_tree = type(ws[0].routed_tree)(BLOCK)  # as if subscribed: the tree is empty
    ticket = ws[0].begin(SYSTEM + [1, 2, 3, 4], None)
    assert ws[0].match(SYSTEM + [8, 8, 8, 8], None) == len(SYSTEM)
    ws[0].finish(ticket)
    assert ws[0].match(SYSTEM, None) == 0 and ws[0].load == 0


def test_an_untokenized_prompt_goes_to_the_least_loaded():
    ws = workers(w0=SYSTEM)
    ws[0].load = 1
    assert policy().choose(ws, []).worker.index == 1


def test_round_robin_cycles_and_skips_missing_workers():
    ws = workers(3)
    rr = RoundRobinPolicy()
    assert [rr.choose(ws, SYSTEM).worker.index for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose([ws[0], ws[2]], SYSTEM).worker.index == 2
    assert rr.choose([ws[0], ws[2]], SYSTEM).worker.index == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"cache_threshold": 1.5}, "cache_threshold: got 1.5"),
    ({"balance_abs_threshold": -1}, "balance_abs_threshold: got -1"),
    ({"balance_rel_threshold": 0.5}, "balance_rel_threshold: got 0.5"),
    ({"balance_rel_threshold": float("inf")}, "balance_rel_threshold: got inf")])
def test_bad_thresholds_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheAwareConfig(**kwargs)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="cache_aware, round_robin"):
        make_policy("random")


def test_a_burst_of_new_prompts_spreads_over_event_fed_workers():
    """Events describe a prompt only after its prefill; meanwhile the prompt still counts."""
    ws = workers(3)
    for w in ws:
        w.events_tree = type(w.routed_tree)(BLOCK)
    ws[0].events_tree.store([b"h"], None, [7] * BLOCK)  # one block: no longer the emptiest
    chosen = []
    for i in range(3):
        prompt = [i] * 16
        worker = policy().choose(ws, prompt).worker
        worker.begin(prompt, None)
        chosen.append(worker.index)
    assert sorted(chosen) == [0, 1, 2]
