"""The offload facade moves whole blocks between a real KV pool and real tiers (host, LMDB)."""
from __future__ import annotations

import torch

from corekv.backend import EvictedBlock
from corekv.offload import Offload, TierRun
from corekv.engine.kv_pool import KVPool
from corekv.hashing import PrefixKey, chain_seed
from corekv.plugin import hookimpl, make_plugin_manager
from corekv.tiers.host import HostTier
from corekv.tiers.lmdb import LMDBTier

BLOCK = 4
FINGERPRINT = b"test-model"


def make_pool(num_blocks: int = 8) -> KVPool:
    pool = KVPool(num_layers=2, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=2, head_dim=4,
                  dtype=torch.float32, device="cpu")
    pool.storage.copy_(torch.randn_like(pool.storage))
    return pool


def tier_kwargs(pool: KVPool) -> dict:
    return dict(block_bytes=pool.bytes_per_block, fingerprint=FINGERPRINT, dtype="float32",
                shape=pool.block_shape)


def device_hits(manager: Offload, key: PrefixKey, num_blocks: int) -> None:
    """Admit a request whose first ``num_blocks`` blocks of ``key`` hit on the device (counted
    for ``offload_min_hits``) and that loads nothing from the tiers."""
    assert manager.load(object(), key, num_blocks, num_blocks, []) == {}


def make_key(num_blocks: int, salt: str | None = None) -> PrefixKey:
    return PrefixKey(list(range(100, 100 + num_blocks * BLOCK)), BLOCK, chain_seed("m", BLOCK, salt))


def test_write_back_then_reload_gives_the_same_bytes(tmp_path):
    pool = make_pool()
    host = HostTier(size=4 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool)
    key = make_key(3)
    original = pool.read_blocks([0, 1, 2]).clone()
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2])])
    manager.flush()
    pool.storage[:3].zero_()

    runs = manager.reloader.lookup(key, 0, 3)
    assert runs == [TierRun(0, 3)]
    loaded = manager.reloader.load(key, 0, runs, [5, 6, 7])
    assert loaded == {"host": 3}
    assert torch.equal(pool.read_blocks([5, 6, 7]), original)
    assert manager.stats()["host"]["reloaded_blocks"] == 3
    manager.close()


def test_a_prefix_can_continue_from_one_tier_into_the_next(tmp_path):
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    disk = LMDBTier(path=str(tmp_path / "kv"), size=1 << 22, **tier_kwargs(pool))
    key = make_key(4)
    original = pool.read_blocks([0, 1, 2, 3]).clone()
    payload = original.view(torch.uint8).reshape(4, -1).numpy()
    host.put([(key.block_hashes[i], payload[i]) for i in range(2)])
    disk.put([(key.block_hashes[i], payload[i]) for i in range(2, 4)])
    manager = Offload([host, disk], pool)

    runs = manager.reloader.lookup(key, 0, 4)
    assert runs == [TierRun(0, 2), TierRun(1, 2)]
    assert manager.reloader.load(key, 0, runs, [4, 5, 6, 7]) == {"host": 2, "lmdb": 2}
    assert torch.equal(pool.read_blocks([4, 5, 6, 7]), original)
    manager.flush()
    assert host.exists(key.block_hashes) == 2, "write-back promotes at eviction, not at reload"
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [4, 5, 6, 7])])
    manager.flush()
    assert host.exists(key.block_hashes) == 4
    manager.close()


def test_write_through_promotes_lower_tier_hits_at_reload(tmp_path):
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    disk = LMDBTier(path=str(tmp_path / "kv"), size=1 << 22, **tier_kwargs(pool))
    key = make_key(2)
    payload = pool.read_blocks([0, 1]).view(torch.uint8).reshape(2, -1).numpy()
    disk.put([(h, payload[i]) for i, h in enumerate(key.block_hashes)])
    manager = Offload([host, disk], pool, write_policy="write_through", prefetch_blocks=0)
    assert manager.reloader.load(key, 0, manager.reloader.lookup(key, 0, 2), [4, 5]) == {"lmdb": 2}
    manager.flush()
    assert host.exists(key.block_hashes) == 2
    manager.close()


def test_a_corrupt_entry_ends_the_reload_and_is_counted(tmp_path):
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key = make_key(3)
    payload = pool.read_blocks([0, 1, 2]).view(torch.uint8).reshape(3, -1).numpy().copy()
    host.put([(h, payload[i]) for i, h in enumerate(key.block_hashes)])
    slot = host.key_to_slot[key.block_hashes[1]]
    host._rows[slot, -1] ^= 0xFF  # flip a payload byte behind the checksum
    manager = Offload([host], pool)

    runs = manager.reloader.lookup(key, 0, 3)
    assert manager.reloader.load(key, 0, runs, [5, 6, 7]) == {"host": 1}
    assert host.stats()["faults"] == 1
    assert host.exists(key.block_hashes) == 1  # the bad entry is gone
    manager.close()


def test_salts_never_share_tier_entries():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool)
    key_a, key_b = make_key(2, salt="a"), make_key(2, salt="b")
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key_a.block_hashes, [0, 1])])
    manager.flush()
    assert manager.reloader.lookup(key_a, 0, 2) == [TierRun(0, 2)]
    assert manager.reloader.lookup(key_b, 0, 2) == []
    manager.close()


def test_write_through_offloads_on_cache_and_write_back_does_not():
    pool = make_pool()
    key = make_key(2)
    for policy, expected in (("write_through", 2), ("write_back", 0)):
        host = HostTier(size=8 * 4096, **tier_kwargs(pool))
        manager = Offload([host], pool, write_policy=policy)
        manager.cached(key, [0, 1], start=0)
        manager.flush()
        assert host.num_entries == expected, policy
        manager.close()


def test_offload_min_hits_keeps_never_reused_blocks_off_the_tiers():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, offload_min_hits=1)
    key = make_key(2)
    device_hits(manager, key, 1)  # only block 0 was ever hit
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1])])
    manager.flush()
    assert host.exists(key.block_hashes[:1]) == 1
    assert host.exists(key.block_hashes[1:]) == 0
    manager.close()


def test_hit_counts_are_not_kept_without_offload_min_hits():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool)  # offload_min_hits=0: every block is offloaded
    key = make_key(3)
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2])])
    manager.flush()
    device_hits(manager, key, 3)
    assert manager.reloader.load(key, 0, manager.reloader.lookup(key, 0, 3), [5, 6, 7]) == {"host": 3}
    manager.arrived("prefetch", key, 0, 3)
    prefetch = manager.prefetches["prefetch"]
    assert manager.load("prefetch", key, 0, 3, [4, 5, 6]) == {"host": 3}
    assert manager.hit_counts == {}, "device hits and reloads are not counted when nothing needs them"
    manager.close()


def test_a_blocks_hit_count_is_dropped_when_it_is_evicted_after_the_offload_decision():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, offload_min_hits=2)
    key = make_key(2)
    device_hits(manager, key, 2)
    device_hits(manager, key, 1)
    assert manager.hit_counts == {key.block_hashes[1]: 1, key.block_hashes[0]: 2}
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1])])
    manager.flush()
    assert host.exists(key.block_hashes[:1]) == 1 and host.exists(key.block_hashes[1:]) == 0
    assert manager.hit_counts == {}, "an evicted block's count leaves with it"
    # cached again: the count starts over, one hit is not enough this time
    device_hits(manager, key, 2)
    manager.evicted([EvictedBlock(key.block_hashes[1], 1)])
    manager.flush()
    assert host.exists(key.block_hashes[1:]) == 0
    manager.close()


def test_hit_counts_never_hold_more_blocks_than_the_pool():
    """Counts of blocks that left the device without an eviction (never cached, e.g. swapped in
    without prefix caching) are dropped least recently counted first."""
    pool = make_pool(8)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, offload_min_hits=1)
    key, other = make_key(8), make_key(3, salt="other")
    device_hits(manager, key, 8)
    device_hits(manager, key, 1)  # block 0 is now the most recently counted
    device_hits(manager, other, 3)
    assert len(manager.hit_counts) == pool.num_blocks
    assert set(manager.hit_counts) == {key.block_hashes[0], *key.block_hashes[4:], *other.block_hashes}
    assert manager.hit_counts[key.block_hashes[0]] == 2
    manager.close()


class FailingOffloadHook:
    """A plugin whose ``corekv_on_blocks_offloaded`` raises (a plugin's bug)."""

    @hookimpl
    def corekv_on_blocks_offloaded(self, tier, block_hashes):
        raise RuntimeError("a plugin's bug")


def test_a_batch_that_fails_after_its_write_gives_its_queue_room_back():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    hooks = make_plugin_manager([FailingOffloadHook()], autoload=False).hook
    manager = Offload([host], pool, queue_blocks=2, hooks=hooks)
    key = make_key(4)
    evicted = [EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2, 3])]
    manager.evicted(evicted[:2])  # written, then the hook raises on the writer thread
    manager.flush()
    assert manager.num_queued_blocks == 0
    manager.evicted(evicted[2:])  # the queue has its full room again
    manager.flush()
    assert manager.stats()["host"]["offload_skips"] == 0
    assert host.exists(key.block_hashes) == 4
    manager.close()


def test_a_snapshot_that_fails_gives_its_queue_room_back():
    import pytest

    from collections import Counter

    from corekv.offload.writer import OffloadWriter

    writer = OffloadWriter(Counter(), queue_blocks=2)

    def failing_snapshot():
        raise RuntimeError("the pool is gone")

    with pytest.raises(RuntimeError, match="pool is gone"):
        writer.submit([b"k" * 16, b"j" * 16], failing_snapshot, [])
    assert writer.num_queued_blocks == 0
    assert writer.submit([b"k" * 16, b"j" * 16], lambda: torch.zeros((2, 8), dtype=torch.uint8), [])
    writer.join()
    assert writer.num_queued_blocks == 0
    writer.close()


def test_the_writer_thread_runs_at_the_lowest_cpu_priority_and_the_caller_keeps_its_own():
    """The writer never competes with the compute threads for a core (issue 40's warm reload):
    its thread alone is at nice 19; the thread that built it keeps its priority."""
    import os
    import sys
    from collections import Counter

    import pytest

    from corekv.offload.writer import WRITER_NICE, OffloadWriter

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux's")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    writer = OffloadWriter(Counter(), queue_blocks=2)
    try:
        assert writer.submit([b"k" * 16], lambda: torch.zeros((1, 8), dtype=torch.uint8), [])
        writer.join()  # the thread has started and set its priority
        assert os.getpriority(os.PRIO_PROCESS, writer._thread.native_id) == WRITER_NICE
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
    finally:
        writer.close()


class GatedHostTier(HostTier):
    """A real host tier whose writes wait for a gate, so a test can hold the offload queue full."""

    def __init__(self, gate, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate

    def _write_entries(self, items):
        self.gate.wait(timeout=30)
        return super()._write_entries(items)


def test_blocks_whose_write_is_in_flight_load_from_the_writers_snapshots_across_batches():
    """load_blocks copies a block whose write is still queued from the writer's snapshot (views
    of each batch, no second copy), across two batches, after their pool slots were reused."""
    import threading

    from corekv.offload.facade import IN_FLIGHT

    pool = make_pool(16)
    gate = threading.Event()
    host = GatedHostTier(gate, size=16 * 4096, **tier_kwargs(pool))
    hashes = make_key(4).block_hashes
    original = pool.read_blocks([0, 1, 2, 3]).clone()
    manager = Offload([host], pool, queue_blocks=8)
    # two batches held at the gate: the first's write is running, the second's queued
    manager.evicted([EvictedBlock(hashes[0], 0), EvictedBlock(hashes[1], 1)])
    manager.evicted([EvictedBlock(hashes[2], 2), EvictedBlock(hashes[3], 3)])
    pool.storage.zero_()  # the slots are reused: only the snapshots hold the bytes now
    try:
        assert manager.load_blocks(hashes, [10, 11, 12, 13]) == {IN_FLIGHT: 4}
        assert torch.equal(pool.read_blocks([10, 11, 12, 13]), original)
    finally:
        gate.set()
        manager.flush()
    assert host.exists(hashes) == 4
    manager.close()


def test_a_full_offload_queue_skips_and_counts_instead_of_waiting():
    import threading

    pool = make_pool()
    gate = threading.Event()
    host = GatedHostTier(gate, size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, queue_blocks=2)
    key = make_key(3)
    evicted = [EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2])]
    manager.evicted(evicted[:2])  # fills the queue; the writer is held at the gate
    manager.evicted(evicted[2:])  # no room: skipped and counted, on_evict returns at once
    gate.set()
    manager.flush()
    assert manager.stats()["host"]["offload_skips"] == 1
    assert host.exists(key.block_hashes) == 2
    manager.close()


def test_an_empty_queue_takes_a_batch_larger_than_its_bound():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, queue_blocks=2)
    key = make_key(3)
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2])])
    manager.flush()
    assert manager.stats()["host"]["offload_skips"] == 0
    assert host.exists(key.block_hashes) == 3
    manager.close()


def test_a_closed_tier_is_a_miss_not_an_error():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool)
    host.close()
    key = make_key(2)
    assert manager.reloader.lookup(key, 0, 2) == []
    manager.evicted([EvictedBlock(key.block_hashes[0], 0)])
    manager.flush()
    manager.close()


def test_opted_out_blocks_stay_off_the_tiers_until_evicted():
    pool = make_pool()
    key = make_key(2)
    evicted = [EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1])]
    for policy in ("write_back", "write_through"):
        host = HostTier(size=8 * 4096, **tier_kwargs(pool))
        manager = Offload([host], pool, write_policy=policy)
        manager.cached(key, [0, 1], 0, offload=False)
        manager.evicted(evicted)
        manager.flush()
        assert host.exists(key.block_hashes) == 0, policy
        assert not manager.opted_out, "an evicted block's opt-out is forgotten with it"
        manager.cached(key, [0, 1], 0)  # cached again by a request that opted in
        manager.evicted(evicted)
        manager.flush()
        assert host.exists(key.block_hashes) == 2, policy
        manager.close()


def test_flush_to_chosen_tiers_writes_more_blocks_than_the_queue_holds(tmp_path):
    pool = make_pool(8)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    disk = LMDBTier(path=str(tmp_path / "kv"), size=1 << 22, **tier_kwargs(pool))
    manager = Offload([host, disk], pool, queue_blocks=2)
    key = make_key(6)
    manager.flush(list(zip(key.block_hashes, range(6))), tiers=[disk])
    assert disk.exists(key.block_hashes) == 6 and host.exists(key.block_hashes) == 0
    assert manager.stats()["lmdb"]["offloads"] == 6 and manager.stats()["lmdb"]["skips"] == 0
    manager.close()


def test_park_and_unpark_bring_a_preempted_sequence_back_byte_identical():
    """Swap: the full blocks are parked under their hashes (reloaded like any offloaded block),
    the partial last one under a private key that unpark brings back once and then deletes."""
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, swap_tier=0)
    key = make_key(3)
    original = pool.read_blocks([0, 1, 2]).clone()
    parked = manager.park("seq-0", key, [0, 1, 2], num_computed=2 * BLOCK + 1)
    assert (parked.num_full_blocks, parked.num_computed_tokens, parked.num_blocks) == (2, 2 * BLOCK + 1, 3)
    assert parked.private_key not in key.block_hashes
    again = manager.park("seq-0", key, [0, 1, 2], num_computed=2 * BLOCK + 1)  # already there
    assert again.num_blocks == 3 and manager.stats()["host"]["swapped_out_blocks"] == 3
    pool.storage[:3].zero_()
    assert manager.reloader.load(key, 0, manager.reloader.lookup(key, 0, 2), [3, 4]) == {"host": 2}
    assert manager.unpark(parked, [3, 4, 5], num_full_loaded=2) == 2 * BLOCK + 1
    assert torch.equal(pool.read_blocks([3, 4, 5]), original)
    assert not host.contains(parked.private_key), "an unparked private entry is deleted"
    stats = manager.stats()["host"]
    assert stats["swapped_in_blocks"] == 1 and stats["reloads"] == 2
    manager.close()


def test_a_partial_block_is_recomputed_when_the_blocks_before_it_did_not_all_come_back():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, swap_tier=0)
    key = make_key(3)
    parked = manager.park("seq-1", key, [0, 1, 2], num_computed=2 * BLOCK + 1)
    assert manager.unpark(parked, [3, 4, 5], num_full_loaded=1) is None
    assert not host.contains(parked.private_key) and manager.stats()["host"]["swapped_in_blocks"] == 0
    left = manager.park("seq-2", key, [0, 1, 2], num_computed=2 * BLOCK + 1)
    manager.left("seq-2", left)  # aborted while waiting: its private entry goes too
    assert not host.contains(left.private_key)
    manager.close()


# -- prefetch ---------------------------------------------------------------------------------
def offloaded(pool: KVPool, key: PrefixKey, tier) -> torch.Tensor:
    """Store ``key``'s blocks (taken from pool blocks 0..) in ``tier``; returns their bytes."""
    n = len(key.block_hashes)
    original = pool.read_blocks(list(range(n))).clone()
    payload = original.view(torch.uint8).reshape(n, -1).numpy()
    tier.put([(h, payload[i]) for i, h in enumerate(key.block_hashes)])
    return original


def test_a_prefetched_prefix_loads_the_same_bytes_as_a_synchronous_load():
    pool = make_pool(12)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key = make_key(3)
    original = offloaded(pool, key, host)
    manager = Offload([host], pool)
    manager.arrived("prefetch", key, 0, 3)
    prefetch = manager.prefetches["prefetch"]
    prefetch.future.result()  # the job ran: admission finds the rows ready
    assert manager.prefetch_stats()["num_staged_blocks"] == 3
    host.delete(key.block_hashes)  # gone from the tier since: the staged bytes still serve

    assert manager.load("prefetch", key, 0, 3, [5, 6, 7]) == {"host": 3}
    assert torch.equal(pool.read_blocks([5, 6, 7]), original)
    stats = manager.prefetch_stats()
    assert stats["ready"] == 1 and stats["stopped"] == 0 and stats["used_blocks"] == 3
    assert stats["num_staged_blocks"] == 0, "admission released the staging"
    assert manager.stats()["host"]["prefetched_blocks"] == manager.stats()["host"]["reloads"] == 3
    manager.close()


def test_admission_rechecks_the_device_match_against_the_prefetch():
    pool = make_pool(16)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key = make_key(4)
    original = offloaded(pool, key, host)
    manager = Offload([host], pool)
    # the device gained block 0 since arrival: block 0's staged row is not used
    manager.arrived("grew", key, 0, 4)
    grew = manager.prefetches["grew"]
    grew.future.result()
    assert manager.load("grew", key, 1, 4, [8, 9, 10]) == {"host": 3}
    assert torch.equal(pool.read_blocks([8, 9, 10]), original[1:])
    assert manager.prefetch_stats()["dropped_blocks"] == 1
    # the device lost blocks 0-1 since arrival: they load synchronously, then the staged rows
    manager.arrived("shrank", key, 2, 4)
    shrank = manager.prefetches["shrank"]
    shrank.future.result()
    assert manager.load("shrank", key, 0, 4, [11, 12, 13, 14]) == {"host": 4}
    assert torch.equal(pool.read_blocks([11, 12, 13, 14]), original)
    assert manager.prefetch_stats()["used_blocks"] == 3 + 2
    manager.close()


def test_a_prefetch_that_vanished_or_missed_falls_back_to_what_the_tiers_hold(tmp_path):
    pool = make_pool(12)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key = make_key(3)
    manager = Offload([host], pool)
    manager.arrived("early", key, 0, 3)
    early = manager.prefetches["early"]  # nothing stored yet: stages nothing
    early.future.result()
    original = offloaded(pool, key, host)  # stored after the prefetch ran (another request's offload)
    assert manager.load("early", key, 0, 3, [5, 6, 7]) == {"host": 3}
    assert torch.equal(pool.read_blocks([5, 6, 7]), original)
    host.delete(key.block_hashes[1:])  # vanished before the next prefetch: it stages one block
    manager.arrived("late", key, 0, 3)
    late = manager.prefetches["late"]
    late.future.result()
    assert manager.load("late", key, 0, 3, [8, 9, 10]) == {"host": 1}
    assert manager.prefetch_stats()["staged_blocks"] == 1
    manager.close()


def test_dropping_a_prefetch_releases_its_staging_and_counts_it():
    pool = make_pool(12)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key = make_key(3)
    offloaded(pool, key, host)
    manager = Offload([host], pool)
    manager.arrived("prefetch", key, 0, 3)
    prefetch = manager.prefetches["prefetch"]
    manager.left("prefetch")
    manager.close()  # waits for a running job; its done-callback releases the staging
    stats = manager.prefetch_stats()
    assert stats["dropped"] == 1 and stats["num_staged_blocks"] == 0 and stats["used_blocks"] == 0
    assert stats["dropped_blocks"] == stats["staged_blocks"]


def test_a_queued_prefetch_is_cancelled_and_a_running_one_stops_at_admission():
    """The prefetch thread is held at a gate (a wrapper around the real staging function) until
    admission of the first request has asked it to stop, so the second job is still queued at
    its own admission: it is cancelled and loaded synchronously; the first job stops before its
    first tier call and admission loads those blocks itself (nothing fetched twice)."""
    import threading
    import time

    from corekv.offload.prefetch import Prefetcher

    pool = make_pool(16)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key_a, key_b = make_key(2, salt="a"), make_key(2, salt="b")
    original_a = offloaded(pool, key_a, host)
    original_b = offloaded(pool, key_b, host)
    manager = Offload([host], pool)
    entered = threading.Event()

    def gated_stage(prefetch, *args):
        entered.set()
        deadline = time.monotonic() + 30
        while not prefetch.stop_requested and time.monotonic() < deadline:
            time.sleep(0.001)
        return manager.reloader.stage(prefetch, *args)

    manager.prefetcher.close()
    manager.prefetcher = Prefetcher(gated_stage, max_blocks=8)
    manager.arrived("first", key_a, 0, 2)
    first = manager.prefetches["first"]
    entered.wait(timeout=30)
    manager.arrived("second", key_b, 0, 2)
    second = manager.prefetches["second"]  # queued behind the held job
    assert manager.load("second", key_b, 0, 2, [10, 11]) == {"host": 2}
    assert torch.equal(pool.read_blocks([10, 11]), original_b)
    assert manager.load("first", key_a, 0, 2, [12, 13]) == {"host": 2}
    assert torch.equal(pool.read_blocks([12, 13]), original_a)
    stats = manager.prefetch_stats()
    assert stats["fallbacks"] == 1 and stats["stopped"] == 1 and stats["staged_blocks"] == 0
    assert stats["used_blocks"] == 0 and stats["num_staged_blocks"] == 0
    assert host.stats()["hits"] == 4, "every block was read from the tier exactly once"
    manager.close()


def test_a_stopped_prefetch_keeps_what_it_staged_and_admission_loads_the_rest():
    """The job is held after its first tier call (a wrapper around the host tier's real
    ``get_into``) until admission asks it to stop: the staged chunk is copied from staging, the
    rest is loaded synchronously, each block read once."""
    import threading
    import time

    import corekv.offload.reload as reload_module

    pool = make_pool(16)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    key = make_key(reload_module._CHUNK + 2)
    original = offloaded(pool, key, host)
    manager = Offload([host], pool)
    real_get_into, calls, started = host.get_into, [], []
    first_call_done = threading.Event()

    def gated_get_into(keys, out):
        flags = real_get_into(keys, out)
        calls.append(len(keys))
        first_call_done.set()
        deadline = time.monotonic() + 30
        while not (started and started[0].stop_requested) and time.monotonic() < deadline:
            time.sleep(0.001)
        return flags

    host.get_into = gated_get_into
    num = len(key.block_hashes)
    manager.arrived("prefetch", key, 0, num)
    prefetch = manager.prefetches["prefetch"]
    started.append(prefetch)
    first_call_done.wait(timeout=30)
    host.get_into = real_get_into  # admission's synchronous load reads the tier directly
    ids = list(range(2, 2 + num))
    assert manager.load("prefetch", key, 0, num, ids) == {"host": num}
    assert torch.equal(pool.read_blocks(ids), original)
    stats = manager.prefetch_stats()
    assert calls == [reload_module._CHUNK] and stats["stopped"] == 1
    assert stats["staged_blocks"] == stats["used_blocks"] == reload_module._CHUNK
    assert host.stats()["hits"] == num, "every block was read from the tier exactly once"
    manager.close()


def test_prefetch_stages_at_most_its_bound_and_loads_the_rest_synchronously(tmp_path):
    pool = make_pool(16)
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    disk = LMDBTier(path=str(tmp_path / "kv"), size=1 << 22, **tier_kwargs(pool))
    key = make_key(4)
    original = offloaded(pool, key, disk)  # only in the lower tier: staged rows get promoted
    manager = Offload([host, disk], pool, prefetch_blocks=3, write_policy="write_through")
    manager.arrived("prefetch", key, 0, 4)
    prefetch = manager.prefetches["prefetch"]
    prefetch.future.result()
    assert manager.prefetch_stats()["num_staged_blocks"] == 3
    assert manager.load("prefetch", key, 0, 4, [8, 9, 10, 11]) == {"lmdb": 4}
    assert torch.equal(pool.read_blocks([8, 9, 10, 11]), original)
    manager.flush()
    assert host.exists(key.block_hashes) == 4, "staged and synchronous loads were both promoted"
    assert manager.stats()["lmdb"]["prefetched_blocks"] == 3
    manager.close()
    for bad in (-1, 1.5, True):
        try:
            Offload([], pool, prefetch_blocks=bad)
        except ValueError as e:
            assert "prefetch_blocks" in str(e)
        else:
            raise AssertionError(f"prefetch_blocks={bad!r} was accepted")


def test_pool_io_row_copies_match_the_pools_own_block_moves():
    import pytest

    from corekv.offload.pool_io import snapshot_blocks, write_rows

    pool = make_pool(8)
    snapshot = snapshot_blocks(pool, [5, 1, 3])
    assert torch.equal(snapshot, pool.read_blocks([5, 1, 3]).view(torch.uint8).reshape(3, -1))
    write_rows(pool, [0, 2, 4], snapshot)
    assert torch.equal(pool.read_blocks([0, 2, 4]), pool.read_blocks([5, 1, 3]))
    with pytest.raises(ValueError, match="rows must be uint8"):
        write_rows(pool, [0, 2], snapshot)
