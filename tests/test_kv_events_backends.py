"""What the builtin backends put in their ``BlockEvent``s for KV-event publishers.

A stored event is one contiguous run of one hash chain, with the hash of the block before it
(``None`` at the chain's start), the run's tokens and the block size; a reset is one removed event
marked ``is_cleared``. Driven through the backend verbs the way the engine drives them
(``corekv.testing.Request``).
"""
from __future__ import annotations

import pytest

from corekv.backend import BlockEvent
from corekv.hashing import PrefixKey, chain_seed
from corekv.plugins.hash_blocks import HashBlockBackend
from corekv.plugins.radix import RadixBackend
from corekv.testing.backend import MODEL, Request, make_key, tokens

BS = 4
BACKENDS = {"hash_blocks": HashBlockBackend, "radix": RadixBackend}


@pytest.fixture(params=sorted(BACKENDS))
def make(request):
    return lambda num_blocks=16: BACKENDS[request.param](num_blocks, BS)


def stored(backend) -> list[BlockEvent]:
    return [e for e in backend.take_events() if e.kind == "stored"]


def test_a_new_prompt_is_one_stored_run_from_the_chain_start(make):
    b = make()
    r = Request(b, tokens(3 * BS + 2))
    assert stored(b) == [BlockEvent("stored", tuple(r.key.block_hashes), None,
                                    tuple(tokens(3 * BS)), BS)]


def test_a_prompt_extending_a_cached_prefix_stores_only_the_new_blocks_with_their_parent(make):
    b = make()
    first = Request(b, tokens(2 * BS + 1))
    first.finish()
    b.take_events()
    longer = tokens(2 * BS) + tokens(2 * BS, start=500)
    second = Request(b, longer)
    hashes = second.key.block_hashes
    assert second.num_hit_tokens == 2 * BS
    assert stored(b) == [BlockEvent("stored", tuple(hashes[2:]), hashes[1], tuple(longer[2 * BS:]), BS)]
    assert hashes[1] == first.key.block_hashes[1]


def test_decode_blocks_stored_later_continue_the_chain(make):
    b = make()
    prompt = tokens(BS + 1)
    r = Request(b, prompt)
    b.take_events()
    grown = prompt + [7] * (BS - 1)           # the next block fills up during decode
    key = make_key(grown, BS)
    b.cache(key, r.table[:2])
    hashes = key.block_hashes
    assert stored(b) == [BlockEvent("stored", (hashes[1],), hashes[0], tuple(grown[BS:2 * BS]), BS)]


def test_the_stored_runs_of_a_salted_chain_carry_its_salt(make):
    b = make()
    prompt = tokens(2 * BS + 1)
    seed = chain_seed(MODEL, BS, cache_salt="tenant-a")
    key = PrefixKey(prompt, BS, seed, cache_salt="tenant-a")
    table = b.allocate(3)
    b.cache(key, table[:2])
    grown = PrefixKey(prompt + [7] * (BS - 1), BS, seed, cache_salt="tenant-a")
    b.cache(grown, table)                     # the next block fills up during decode
    h = grown.block_hashes
    assert stored(b) == [
        BlockEvent("stored", tuple(h[:2]), None, tuple(prompt[:2 * BS]), BS, cache_salt="tenant-a"),
        BlockEvent("stored", (h[2],), h[1], tuple(grown.token_ids[2 * BS:]), BS, cache_salt="tenant-a")]


def test_hash_blocks_splits_a_stored_run_where_a_middle_block_is_cached_elsewhere():
    b = HashBlockBackend(16, BS)
    seq = tokens(4 * BS)
    key = make_key(seq, BS)
    a = b.allocate(3)
    b.cache(key, a)                           # blocks 0, 1, 2 of the chain
    b.free(a[:2])                             # 0 and 1 idle; 2 stays held
    b.free(b.allocate(b.num_free_blocks))     # pressure evicts 0 and 1 only
    b.take_events()
    fresh = b.allocate(4)                     # recomputed privately (no match: block 0 is gone)
    b.cache(key, fresh)                       # 0, 1 and 3 are new; 2 is cached in a[2]
    h = key.block_hashes
    assert stored(b) == [BlockEvent("stored", (h[0], h[1]), None, tuple(seq[:2 * BS]), BS),
                         BlockEvent("stored", (h[3],), h[2], tuple(seq[3 * BS:]), BS)]


def test_evictions_are_removed_events_of_hashes_stored_before(make):
    b = make(4)
    first = Request(b, tokens(2 * BS))
    first.finish()
    Request(b, tokens(4 * BS, start=900)).finish()
    events = b.take_events()
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    assert sorted(removed) == sorted(first.key.block_hashes)
    assert not any(e.is_cleared for e in events)
    kinds = [e.kind for e in events]
    assert kinds.index("removed") < len(kinds) - 1 and kinds[-1] == "stored"  # evicted, then stored


def test_reset_is_one_cleared_removed_event_listing_everything_cached(make):
    b = make()
    r = Request(b, tokens(2 * BS))
    r.finish()
    b.take_events()
    b.reset()
    [event] = b.take_events()
    assert event.kind == "removed" and event.is_cleared
    assert sorted(event.block_hashes) == sorted(r.key.block_hashes)
    b.reset()                                 # nothing cached: still a reset for subscribers
    assert b.take_events() == [BlockEvent("removed", (), is_cleared=True)]


def test_backends_built_without_events_record_none():
    for backend in (HashBlockBackend(8, BS, record_events=False),
                    RadixBackend(8, BS, record_events=False)):
        Request(backend, tokens(2 * BS)).finish()
        backend.reset()
        assert backend.take_events() == []
