"""The scheduler and block manager on their own: real backends and a real (tiny) KV pool, no model.

A step is simulated as the engine runs it (schedule, advance, postprocess) with a fixed next token,
so these tests pin down the decisions alone: budgets, chunking, ordering, preemption, forks.
"""
from __future__ import annotations

import pytest
import torch

from corekv.hashing import PrefixKey, chain_seed
from corekv.plugin import make_plugin_manager
from corekv.engine.block_manager import BlockManager
from corekv.engine.kv_pool import KVPool
from corekv.engine.sampling import SamplingParams
from corekv.engine.scheduler import LPM_QUEUE_LIMIT, Scheduler
from corekv.engine.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
NAMESPACE = chain_seed("scheduler-tests", BLOCK_SIZE)
EOS = 0


def make_scheduler(num_blocks=64, backend="hash_blocks", budget=16, max_num_seqs=8, scheduling="fcfs",
                   chunked=True, caching=True, prefill_first=False):
    backend = make_plugin_manager().backends()[backend].factory(num_blocks, BLOCK_SIZE)
    pool = KVPool(1, num_blocks, BLOCK_SIZE, 1, 2, torch.float32, "cpu")
    blocks = BlockManager(backend, pool, enable_prefix_caching=caching)
    return Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     scheduling=scheduling, enable_chunked_prefill=chunked, prefill_first=prefill_first,
                     eos_token_ids=[EOS])


def make_seq(prompt_ids, request_id="r", max_tokens=8, n=1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    return Sequence(request_id, prompt_ids, params, PrefixKey(prompt_ids, BLOCK_SIZE, NAMESPACE))


def prompt(start, length):
    return list(range(start, start + length))


def step(scheduler, token_id=7):
    """One engine step without a model: every sampled token is ``token_id``."""
    batch = scheduler.schedule()
    seqs, _ = scheduler.advance(batch)
    finished = scheduler.postprocess(seqs, [token_id] * len(seqs))
    return batch, finished


def test_decodes_go_first_and_prefill_takes_what_is_left_of_the_budget():
    scheduler = make_scheduler(budget=16)
    decoders = [make_seq(prompt(100 * i, 5), f"d{i}") for i in range(3)]
    for seq in decoders:
        scheduler.add(seq)
    step(scheduler)  # prefill the three short prompts (15 tokens)
    long = make_seq(prompt(1000, 40), "long")
    scheduler.add(long)
    batch, _ = step(scheduler)
    assert [(item.seq.request_id, item.num_tokens) for item in batch] == [
        ("d0", 1), ("d1", 1), ("d2", 1), ("long", 13)]
    batch, _ = step(scheduler)
    assert [item.num_tokens for item in batch] == [1, 1, 1, 13]
    assert batch[-1].start_pos == 13


def test_a_long_prompt_is_chunked_across_steps_and_never_exceeds_the_budget():
    scheduler = make_scheduler(budget=16)
    seq = make_seq(prompt(0, 45))
    scheduler.add(seq)
    sizes = []
    while seq.num_output_tokens == 0:
        batch, _ = step(scheduler)
        assert sum(item.num_tokens for item in batch) <= 16
        sizes.append(batch[0].num_tokens)
    assert sizes == [16, 16, 13]


def test_without_chunking_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    scheduler = make_scheduler(budget=16, chunked=False)
    first, second = make_seq(prompt(0, 10), "a"), make_seq(prompt(100, 10), "b")
    scheduler.add(first)
    scheduler.add(second)
    batch, _ = step(scheduler)
    assert [(i.seq.request_id, i.num_tokens) for i in batch] == [("a", 10)]
    batch, _ = step(scheduler)
    assert [(i.seq.request_id, i.num_tokens) for i in batch] == [("a", 1), ("b", 10)]


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_keeps_arrival_order():
    # "hit" needs 2 new tokens, "miss" 12: the whole budget, so under FCFS "hit" waits a step.
    for scheduling, expected in (("lpm", ["hit", "miss"]), ("fcfs", ["miss"])):
        scheduler = make_scheduler(budget=12, scheduling=scheduling)
        warm = make_seq(prompt(500, 12), "warm", max_tokens=1)
        scheduler.add(warm)
        while not warm.is_finished:
            step(scheduler)
        scheduler.add(make_seq(prompt(900, 12), "miss"))
        scheduler.add(make_seq(prompt(500, 12) + [1, 2], "hit"))
        batch, _ = step(scheduler)
        assert [item.seq.request_id for item in batch] == expected, scheduling


def test_lpm_falls_back_to_fcfs_on_a_long_queue():
    scheduler = make_scheduler(num_blocks=512, budget=8, scheduling="lpm", max_num_seqs=1)
    cached = make_seq(prompt(500, 8), "warm", max_tokens=1)
    scheduler.add(cached)
    while not cached.is_finished:
        step(scheduler)
    for i in range(LPM_QUEUE_LIMIT):
        scheduler.add(make_seq(prompt(10_000 + 20 * i, 8), f"q{i}"))
    scheduler.add(make_seq(prompt(500, 8) + [1], "hit"))  # queue now longer than the limit
    batch, _ = step(scheduler)
    assert [item.seq.request_id for item in batch] == ["q0"]


def test_matched_blocks_head_the_table_and_the_last_prompt_token_is_always_computed():
    scheduler = make_scheduler(budget=64)
    first = make_seq(prompt(0, 12), "a", max_tokens=1)
    scheduler.add(first)
    step(scheduler)
    again = make_seq(prompt(0, 12), "b", max_tokens=1)  # 3 full blocks, all cached
    scheduler.add(again)
    batch, _ = step(scheduler)
    assert again.num_cached_tokens == 8  # (12 - 1) // 4 blocks: the last token is recomputed
    assert [(item.start_pos, item.num_tokens) for item in batch] == [(8, 4)]


def test_preemption_frees_the_newest_running_sequence_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=6, budget=64)
    a, b = make_seq(prompt(0, 8), "a", max_tokens=12), make_seq(prompt(100, 8), "b", max_tokens=12)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # both prefilled: 2 blocks each, 2 free
    for _ in range(8):
        step(scheduler)
        if scheduler.num_preemptions:
            break
    assert scheduler.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and scheduler.waiting[0] is b
    assert a.status is SequenceStatus.RUNNING
    while scheduler.has_unfinished:
        step(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert scheduler.blocks.backend.num_free_blocks == 6


def test_max_num_seqs_caps_the_running_list():
    scheduler = make_scheduler(budget=64, max_num_seqs=2)
    for i in range(4):
        scheduler.add(make_seq(prompt(100 * i, 4), f"s{i}"))
    step(scheduler)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


def test_a_head_that_can_never_fit_is_aborted_instead_of_spinning():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    too_big = make_seq(prompt(0, 30), "big")  # needs 8 blocks of a 4-block pool
    scheduler.add(too_big)
    batch, finished = step(scheduler)
    assert batch == [] and finished == [too_big] and too_big.finish_reason == "abort"
    assert not scheduler.has_unfinished


def test_fork_shares_blocks_and_copies_the_partial_block_before_writing():
    scheduler = make_scheduler(num_blocks=16, budget=64)
    scheduler.make_fork = lambda parent, index: parent.fork(index, None, None)
    parent = make_seq(prompt(0, 6), "r", max_tokens=3, n=3)  # 1 full block + a partial one
    scheduler.add(parent)
    blocks = scheduler.blocks
    step(scheduler)
    assert len(scheduler.running) == 3
    tables = [seq.block_table for seq in scheduler.running]
    assert tables[0] == tables[1] == tables[2]
    assert blocks.backend.num_free_blocks == 16 - 2  # shared, not duplicated
    pool = blocks.kv_pool
    pool.storage[tables[0][1]] = 5.0  # the shared partial block's KV
    step(scheduler)  # every sibling writes into block 1: two copy it first, the last writes in place
    assert blocks.num_cow_copies == 2
    assert len({seq.block_table[1] for seq in scheduler.running}) == 3
    assert all(seq.block_table[0] == tables[0][0] for seq in scheduler.running)
    assert all(bool((pool.storage[seq.block_table[1]] == 5.0).all()) for seq in scheduler.running)
    while scheduler.has_unfinished:
        step(scheduler)
    assert not blocks.shared_refs and blocks.backend.num_free_blocks == 16


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_finished_sequences_free_everything_into_the_backend(backend):
    scheduler = make_scheduler(num_blocks=32, backend=backend, budget=8)
    for i in range(5):
        scheduler.add(make_seq(prompt(10 * i, 3 + 4 * i), f"s{i}", max_tokens=5))
    while scheduler.has_unfinished:
        step(scheduler)
    assert scheduler.blocks.backend.num_free_blocks == 32
    assert scheduler.num_output_tokens == 25


def test_pending_forks_count_against_max_num_seqs():
    scheduler = make_scheduler(budget=16, max_num_seqs=4)
    parent = make_seq(prompt(0, 20), "n3", n=3)  # prefilled over 2 steps, then 3 sequences
    scheduler.add(parent)
    step(scheduler)
    scheduler.add(make_seq(prompt(100, 4), "a"))
    scheduler.add(make_seq(prompt(200, 4), "b"))
    while parent.num_pending_forks:
        step(scheduler)
        assert len(scheduler.running) + parent.num_pending_forks <= 4
    assert len(scheduler.running) == 4 and [s.request_id for s in scheduler.waiting] == ["b"]


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_a_prompt_sharing_an_in_flight_prefix_waits_a_step_and_then_reuses_it(backend):
    # "a" and "b" share 3 full blocks; the budget fits both, but "b" admitted now would compute its
    # own copy of them. "c" shares nothing and is admitted past the held-back "b".
    scheduler = make_scheduler(backend=backend, budget=64)
    shared = prompt(0, 12)
    a, b = make_seq(shared + prompt(100, 6), "a"), make_seq(shared + prompt(200, 6), "b")
    c = make_seq(prompt(300, 6), "c")
    for seq in (a, b, c):
        scheduler.add(seq)
    batch, _ = step(scheduler)
    assert [(i.seq.request_id, i.num_tokens) for i in batch] == [("a", 18), ("c", 6)]
    batch, _ = step(scheduler)
    assert [(i.seq.request_id, i.start_pos, i.num_tokens) for i in batch] == [
        ("a", 18, 1), ("c", 6, 1), ("b", 12, 6)]
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 12
    assert scheduler.num_computed_tokens == 18 + 6 + 2 + 6


def test_a_chunked_producer_holds_back_its_followers_until_its_blocks_are_cached():
    # "a"'s 8 full prompt blocks take three 12-token chunks; each follower waits for "a"'s blocks
    # and none is starved: all finish, and none recomputes the shared prefix.
    scheduler = make_scheduler(budget=12)
    shared = prompt(0, 32)
    seqs = [make_seq(shared + prompt(100 * (i + 1), 3), f"s{i}", max_tokens=2) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    admitted_while_a_prefills = []
    while seqs[0].num_computed_tokens < seqs[0].num_prompt_tokens:
        batch, _ = step(scheduler)
        admitted_while_a_prefills += [i.seq.request_id for i in batch if i.seq is not seqs[0]]
    assert admitted_while_a_prefills == []
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 2 for s in seqs)
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32, 32]


def test_a_held_back_prompt_survives_its_producer_being_preempted():
    # 7 blocks: a growing decode ("d") preempts the producer "a" mid-prefill; "b" (a's 4-block
    # prefix + 2 tokens) waits behind "a" and neither deadlocks nor starves: every request
    # finishes within a bounded number of steps and "b" still reuses a's prefix.
    scheduler = make_scheduler(num_blocks=7, budget=4)
    d = make_seq(prompt(500, 4), "d", max_tokens=20)
    scheduler.add(d)
    step(scheduler)
    a = make_seq(prompt(0, 17), "a", max_tokens=3)
    b = make_seq(prompt(0, 16) + [5, 6], "b", max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(100):
        if not scheduler.has_unfinished:
            break
        step(scheduler)
    assert scheduler.num_preemptions == 1 and a.num_preemptions == 1
    assert (d.num_output_tokens, a.num_output_tokens, b.num_output_tokens) == (20, 3, 3)
    assert b.num_cached_tokens == 16


def test_without_prefix_caching_nothing_is_held_back():
    scheduler = make_scheduler(budget=64, caching=False)
    a, b = make_seq(prompt(0, 12) + [1], "a"), make_seq(prompt(0, 12) + [2], "b")
    scheduler.add(a)
    scheduler.add(b)
    batch, _ = step(scheduler)
    assert [i.seq.request_id for i in batch] == ["a", "b"]


def _two_decoders_filling_the_pool(prefill_first):
    """An 8-block pool: two 12-token prompts (3 blocks each) prefilled, their first tokens then
    take the last 2 blocks in the next step's decodes."""
    scheduler = make_scheduler(num_blocks=8, budget=64, prefill_first=prefill_first)
    a, b = make_seq(prompt(0, 12), "a", max_tokens=12), make_seq(prompt(100, 12), "b", max_tokens=12)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    return scheduler, a, b


def test_prefill_first_preempts_the_newest_decode_for_a_prompt_that_does_not_fit():
    scheduler, a, b = _two_decoders_filling_the_pool(prefill_first=True)
    c = make_seq(prompt(200, 8), "c", max_tokens=4)
    scheduler.add(c)
    batch, _ = step(scheduler)
    assert [(item.seq.request_id, item.num_tokens) for item in batch] == [("a", 1), ("c", 8)]
    assert c.num_output_tokens == 1 and scheduler.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_output_tokens == 1 and list(scheduler.waiting) == [b]
    while scheduler.has_unfinished:
        step(scheduler)
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (12, 12, 4)
    assert scheduler.blocks.backend.num_free_blocks == 8


def test_without_prefill_first_the_prompt_waits_for_the_decodes():
    scheduler, a, b = _two_decoders_filling_the_pool(prefill_first=False)
    c = make_seq(prompt(200, 8), "c", max_tokens=4)
    scheduler.add(c)
    batch, _ = step(scheduler)
    assert [item.seq.request_id for item in batch] == ["a", "b"]
    assert c.num_output_tokens == 0 and scheduler.num_preemptions == 0


def test_prefill_first_requeues_a_victim_ahead_of_later_prompts():
    """No starvation: a prompt arriving after a victim was preempted waits behind it (it cannot
    preempt its way ahead of the victim)."""
    scheduler, a, b = _two_decoders_filling_the_pool(prefill_first=True)
    c = make_seq(prompt(200, 8), "c", max_tokens=4)
    scheduler.add(c)
    step(scheduler)  # c preempts b (test above)
    late = make_seq(prompt(300, 8), "late", max_tokens=4)
    scheduler.add(late)
    assert scheduler._admission_order() == [b, late]
    while late.num_output_tokens == 0:
        step(scheduler)
    assert b.num_output_tokens > 1, "the later prompt got its first token before the victim resumed"
    while scheduler.has_unfinished:
        step(scheduler)
    assert [s.num_output_tokens for s in (a, b, c, late)] == [12, 12, 4, 4]


def test_prefill_first_never_preempts_a_prompt_still_prefilling():
    scheduler = make_scheduler(num_blocks=4, budget=4, prefill_first=True)
    long = make_seq(prompt(0, 16), "long", max_tokens=1)  # all 4 blocks, prefilled 4 tokens a step
    scheduler.add(long)
    step(scheduler)
    short = make_seq(prompt(100, 4), "short", max_tokens=1)
    scheduler.add(short)
    batch, _ = step(scheduler)
    assert [item.seq.request_id for item in batch] == ["long"] and scheduler.num_preemptions == 0
    while scheduler.has_unfinished:
        step(scheduler)
    assert long.num_output_tokens == short.num_output_tokens == 1 and scheduler.num_preemptions == 0


def test_prefill_first_never_preempts_a_victim_again_for_prompts_queued_after_it():
    """A stream of new prompts, one per step, each needing blocks the decoding ``d`` holds: ``d``
    is preempted for the first one only; prompts queued after its requeue wait for it (it would
    otherwise be swapped in and straight out again every step and never finish)."""
    scheduler = make_scheduler(num_blocks=8, budget=64, prefill_first=True)
    d = make_seq(prompt(0, 20), "d", max_tokens=10)
    scheduler.add(d)
    step(scheduler)
    step(scheduler)
    prompts = []
    for i in range(40):
        prompts.append(make_seq(prompt(1000 * (i + 1), 12), f"p{i}", max_tokens=1))
        scheduler.add(prompts[-1])
        step(scheduler)
        if d.is_finished:
            break
    assert d.num_output_tokens == 10 and d.num_preemptions == 1


def test_prefill_first_preempts_nothing_when_even_every_decode_would_not_make_room():
    """The decodes would free 4 blocks and the pool has 1 more, the prompt needs 6 (a prefill
    holds the rest): the decodes keep running instead of being swapped out for nothing."""
    scheduler = make_scheduler(num_blocks=12, budget=16, prefill_first=True)
    a, b = make_seq(prompt(0, 4), "a", max_tokens=8), make_seq(prompt(100, 4), "b", max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # a, b: 1 block each, decoding (a second block each next step)
    holder = make_seq(prompt(200, 26), "holder", max_tokens=1)  # 7 blocks, prefilled over 2 steps
    scheduler.add(holder)
    step(scheduler)
    big = make_seq(prompt(300, 24), "big", max_tokens=1)  # 6 blocks
    scheduler.add(big)
    batch, _ = step(scheduler)
    assert [(item.seq.request_id, item.num_tokens) for item in batch] == [("a", 1), ("b", 1), ("holder", 12)]
    assert scheduler.num_preemptions == 0 and big.status is SequenceStatus.WAITING
