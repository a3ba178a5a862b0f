"""The waiting-queue policies (``engine.scheduling``): what each order guarantees, on generated
queues (hypothesis); what the scheduler admits under each; and that no policy changes an output.

Generated queues draw their prompts from a tiny token alphabet in blocks of two tokens, so
prompts share prefixes of every length; a drawn set of cached prefixes stands for the backend
(a sequence's match is its longest leading run of cached blocks, never its last token).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.config.schema import EngineConfig as EngineConfigSchema
from corekv.hashing import PrefixKey, chain_seed
from corekv.plugin import make_plugin_manager
from corekv.engine.block_manager import BlockManager
from corekv.engine.kv_pool import KVPool
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams
from corekv.engine.scheduler import SCHEDULING_POLICIES, Scheduler
from corekv.engine.scheduling import (DFS_WEIGHT_QUEUE_LIMIT, ORDER_BY_POLICY, expected_output_tokens,
                                      order_dfs_weight, order_lof, order_lpm)
from corekv.engine.sequence import Sequence

BLOCK_SIZE = 2
NAMESPACE = chain_seed("scheduling-policy-tests", BLOCK_SIZE)


def make_seq(prompt_ids, request_id, max_tokens=8, *, num_output_tokens=0, preempted=False) -> Sequence:
    seq = Sequence(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   PrefixKey(prompt_ids, BLOCK_SIZE, NAMESPACE))
    for _ in range(num_output_tokens):
        seq.append_token(9)
    seq.num_preemptions = int(preempted)
    return seq


@st.composite
def queues(draw):
    """(waiting sequences, a match count function standing for a backend's cache); as in the
    scheduler's queue, the preempted sequences are at the front."""
    num_seqs = draw(st.integers(0, 14))
    seqs = []
    for i in range(num_seqs):
        prompt = draw(st.lists(st.integers(1, 2), min_size=1, max_size=11))
        max_tokens = draw(st.sampled_from([1, 4, 16]))
        seqs.append(make_seq(prompt, f"r{i}", max_tokens,
                             num_output_tokens=draw(st.integers(0, max_tokens - 1)),
                             preempted=draw(st.booleans()) and draw(st.booleans())))
    seqs.sort(key=lambda s: not s.num_preemptions)  # the scheduler requeues the preempted at the front
    cached = set()
    for seq in draw(st.lists(st.sampled_from(seqs), max_size=4)) if seqs else ():
        cached.update(seq.key.block_hashes[:draw(st.integers(0, len(seq.key.block_hashes)))])

    def num_matched_blocks(seq):
        reusable = seq.key.block_hashes[:(seq.num_tokens - 1) // BLOCK_SIZE]
        return next((i for i, h in enumerate(reusable) if h not in cached), len(reusable))

    return seqs, num_matched_blocks


def fresh_part(order):
    return [s for s in order if not s.num_preemptions]


def contiguous(order, members) -> bool:
    positions = [i for i, s in enumerate(order) if s in members]
    return not positions or positions[-1] - positions[0] + 1 == len(positions)


def reference_dfs(seqs_and_paths):
    """The walk spelled out on the whole tree: one node per prefix of whole blocks, children
    heaviest first (ties: first seen), then the sequences whose path ends at the node."""
    root = {"children": {}, "seqs": [], "weight": 0}
    for seq, path in seqs_and_paths:
        node = root
        node["weight"] += 1
        for block_hash in path:
            node = node["children"].setdefault(block_hash, {"children": {}, "seqs": [], "weight": 0})
            node["weight"] += 1
        node["seqs"].append(seq)

    def walk(node):
        for child in sorted(node["children"].values(), key=lambda c: -c["weight"]):
            yield from walk(child)
        yield from node["seqs"]

    return list(walk(root))


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- every policy ----------------------------------------------------------------------------
@SETTINGS
@given(queues(), st.sampled_from(SCHEDULING_POLICIES))
def test_every_policy_returns_a_permutation_with_the_preempted_first(queue, policy):
    seqs, num_matched_blocks = queue
    order = ORDER_BY_POLICY[policy](seqs, num_matched_blocks)
    assert sorted(map(id, order)) == sorted(map(id, seqs))
    preempted = [s for s in seqs if s.num_preemptions]
    assert {id(s) for s in order[:len(preempted)]} == {id(s) for s in preempted}
    if policy in ("fcfs", "dfs-weight"):
        assert order[:len(preempted)] == preempted  # in queue order; lpm and lof sort them too


def test_the_config_offers_exactly_the_policies_the_scheduler_knows():
    field = next(f for f in EngineConfigSchema.__dataclass_fields__.values() if f.name == "scheduling")
    assert set(field.metadata["check"]["choices"]) == set(SCHEDULING_POLICIES) == {"lpm", "fcfs", "dfs-weight", "lof"}


# -- lof and lpm -----------------------------------------------------------------------------
def assert_sorted_by_descending_key_then_queue_order(order, seqs, key):
    for a, b in zip(order, order[1:]):
        assert key(a) >= key(b)
        if key(a) == key(b):
            assert seqs.index(a) < seqs.index(b)


@SETTINGS
@given(queues())
def test_lof_sorts_by_the_tokens_max_tokens_still_allows_and_keeps_queue_order_for_ties(queue):
    seqs, num_matched_blocks = queue
    order = fresh_part(order_lof(seqs, num_matched_blocks))
    assert_sorted_by_descending_key_then_queue_order(order, seqs, expected_output_tokens)


def test_lof_expects_max_tokens_minus_what_was_generated():
    assert expected_output_tokens(make_seq([1, 2, 3], "a", 16)) == 16
    assert expected_output_tokens(make_seq([1, 2, 3], "a", 16, num_output_tokens=10)) == 6


@SETTINGS
@given(queues())
def test_lpm_sorts_by_cached_blocks_and_keeps_queue_order_for_ties(queue):
    seqs, num_matched_blocks = queue
    order = fresh_part(order_lpm(seqs, num_matched_blocks))
    assert_sorted_by_descending_key_then_queue_order(order, seqs, num_matched_blocks)


# -- dfs-weight ------------------------------------------------------------------------------
@SETTINGS
@given(queues())
def test_dfs_weight_puts_cached_prefixes_first_and_keeps_every_group_of_sharers_adjacent(queue):
    seqs, num_matched_blocks = queue
    order = fresh_part(order_dfs_weight(seqs, num_matched_blocks))
    hot = [s for s in order if num_matched_blocks(s)]
    assert order[:len(hot)] == hot  # every sequence with a cached prefix before any without
    cold = order[len(hot):]
    for part, path_of in ((hot, lambda s: s.key.block_hashes[:num_matched_blocks(s)]),
                          (cold, lambda s: s.key.block_hashes)):
        for block_hash in {h for s in part for h in path_of(s)}:
            sharers = [s for s in part if block_hash in path_of(s)]
            assert contiguous(part, sharers), "sequences sharing a prefix were split"


@SETTINGS
@given(queues())
def test_dfs_weight_equals_the_heaviest_subtree_first_walk_of_the_whole_tree(queue):
    seqs, num_matched_blocks = queue
    fresh = [s for s in seqs if not s.num_preemptions]
    hot = [(s, s.key.block_hashes[:num_matched_blocks(s)]) for s in fresh if num_matched_blocks(s)]
    cold = [(s, s.key.block_hashes) for s in fresh if not num_matched_blocks(s)]
    assert fresh_part(order_dfs_weight(seqs, num_matched_blocks)) == reference_dfs(hot) + reference_dfs(cold)


def test_dfs_weight_runs_the_bigger_group_first_and_a_groups_longest_shared_path_before_its_prefixes():
    small = [make_seq([1, 1, 1, 1, 5], "small-0"), make_seq([1, 1, 1, 1, 6], "small-1")]
    big = [make_seq([2, 2, 2, 2, 5], "big-0"), make_seq([2, 2, 2, 2, 6], "big-1"),
           make_seq([2, 2, 3], "big-short"), make_seq([2, 2, 2, 2, 2, 2, 7], "big-long")]
    queue = [small[0], big[2], small[1], big[0], big[3], big[1], make_seq([4, 4, 4], "alone")]
    order = order_dfs_weight(queue, lambda s: 0)  # nothing cached: the prompts' own tree
    assert [s.request_id for s in order] == [
        "big-long", "big-0", "big-1", "big-short", "small-0", "small-1", "alone"]


def test_dfs_weight_walks_only_the_oldest_new_sequences_of_a_long_queue():
    group = [make_seq([1, 1, 1, 1, i % 7], f"g{i}") for i in range(DFS_WEIGHT_QUEUE_LIMIT)]
    beyond = [make_seq([3, 3, 3, 3, 1], "late-0"), make_seq([1, 1, 1, 1, 1], "late-1")]
    preempted = make_seq([5, 5, 5], "back", preempted=True)
    order = order_dfs_weight([*group[:5], preempted, *group[5:], *beyond], lambda s: 0)
    assert order[0] is preempted and order[-2:] == beyond  # the late sharer is not pulled forward


# -- in the scheduler ------------------------------------------------------------------------
def make_scheduler(scheduling, num_blocks=64):
    backend = make_plugin_manager().backends()["radix"].factory(num_blocks, 4)
    pool = KVPool(1, num_blocks, 4, 1, 2, torch.float32, "cpu")
    return Scheduler(BlockManager(backend, pool), max_num_seqs=1, max_num_batched_tokens=64,
                     scheduling=scheduling, eos_token_ids=[0])


def admission_order(scheduler, requests):
    """Admit one request at a time (``max_num_seqs=1``); the ids in the order they ran."""
    namespace = chain_seed("scheduler-policy-tests", 4)
    for request_id, prompt, max_tokens in requests:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        scheduler.add(Sequence(request_id, prompt, params, PrefixKey(prompt, 4, namespace)))
    admitted = []
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        admitted += [item.seq.request_id for item in batch if item.seq.request_id not in admitted]
        seqs, _ = scheduler.advance(batch)
        scheduler.postprocess(seqs, [7] * len(seqs))
    return admitted


def test_lof_admits_the_longest_max_tokens_first():
    requests = [("short", list(range(1, 9)), 2), ("long", list(range(11, 19)), 9),
                ("mid", list(range(21, 29)), 5), ("mid-too", list(range(31, 39)), 5)]
    assert admission_order(make_scheduler("lof"), requests) == ["long", "mid", "mid-too", "short"]
    assert admission_order(make_scheduler("fcfs"), requests) == ["short", "long", "mid", "mid-too"]


def test_dfs_weight_admits_the_group_that_reuses_the_cached_prefix_together():
    shared = list(range(100, 116))  # 4 blocks
    requests = [("warm", shared + [1], 1), ("other-0", list(range(200, 217)), 1),
                ("hit-0", shared + [2, 3], 1), ("other-1", list(range(300, 317)), 1),
                ("hit-1", shared + [4, 5], 1)]
    order = admission_order(make_scheduler("dfs-weight"), requests)
    assert order[0] == "warm" and order[1:3] == ["hit-0", "hit-1"]  # warm ran first, then its sharers


# -- in the engine ---------------------------------------------------------------------------
SYSTEMS = ["You are a careful assistant. Answer briefly and cite the document. ",
           "Translate the following text into French, keeping its formatting. "]


def policy_prompts():
    prompts = []
    for i in range(12):  # interleaved groups sharing a 4-block prefix, and loners
        head = SYSTEMS[i % 2] if i % 3 else f"loner {i}: "
        prompts.append(head + f"question {i} about blocks, caches and queues" + "!" * (i % 5))
    return prompts


def test_greedy_outputs_are_the_same_under_every_policy_with_eviction_and_preemption(tiny_llama):
    prompts = policy_prompts()
    params = [SamplingParams(max_tokens=4 + 28 * (i % 4 == 0), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    results = {}
    for policy in SCHEDULING_POLICIES:
        cfg = Config(model="tiny", engine=EngineConfig(num_blocks=16, block_size=16, max_num_seqs=4,
                                                       max_num_batched_tokens=96, scheduling=policy),
                     cache=CacheConfig(backend="radix"))
        with Engine(cfg, model=tiny_llama) as engine:
            request_ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            finished = []
            while engine.has_unfinished_requests:
                finished += engine.step()
            by_id = {o.request_id: o for o in finished}
            results[policy] = ([by_id[r].token_ids for r in request_ids], [o.request_id for o in finished],
                               engine.stats())
    reference = results["fcfs"][0]
    for policy, (token_ids, _, _) in results.items():
        assert token_ids == reference, f"{policy} changed an output"
    # NOTE: not vacuous: the policies did reorder the work, and the pool did evict and preempt.
    assert len({tuple(finish_order) for _, finish_order, _ in results.values()}) == len(results)
    assert len({stats["prompt_tokens_reused"] for _, _, stats in results.values()}) > 1
    assert all(stats["num_preemptions"] for policy, (_, _, stats) in results.items() if policy != "fcfs")
