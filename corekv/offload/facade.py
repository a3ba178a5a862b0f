"""The facade: the verbs the engine side calls, and the offload policy between the pool and the tiers.

Offload: ``write_back`` (default) copies a cached block out of the pool at the moment the backend
evicts it (before its slot is reused), ``write_through`` as soon as it is cached. The copy is
taken on the caller's thread (a memcpy); the tier writes run on one background thread behind a
bounded queue (:mod:`corekv.offload.writer`), and when that queue is full the blocks are skipped
and counted — generation never waits for a tier. Blocks reloaded from a lower tier reach the tiers
above it: with ``write_back`` when they are evicted, like any cached block (eviction writes every
tier that lacks a block); with ``write_through`` at once.

NOTE: promoting at reload under ``write_back`` would copy every reloaded block out of the pool
again on the admission path (inside TTFT) for a write that eviction makes anyway.

NOTE: an offloaded block goes to *every* tier that does not already hold it, not only the first:
with ``host`` above ``lmdb`` the fast tier catches re-use within the process while the persistent
one survives restarts. ``offload_min_hits`` keeps blocks that were never re-used off the tiers
(SSD wear): a block qualifies when it was hit on the device (or reloaded) that often while
resident, and its count is dropped when it is evicted. Blocks cached by a request that opted out
(``cached(..., offload=False)``) are kept off the tiers until they leave the device.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import torch

from corekv.backend import EvictedBlock
from corekv.hashing import BlockHash, PrefixKey
from corekv.offload.cost import ReloadCost
from corekv.offload.measure import TierMeasurement, measure_tier
from corekv.admission import AdmissionPolicy
from corekv.offload.planner import OffloadPlanner
from corekv.offload.pool_io import snapshot_blocks, write_rows
from corekv.offload.prefetch import Prefetch, Prefetcher
from corekv.offload.reload import Reloader
from corekv.offload.swap import Parked, Swap
from corekv.offload.tier_calls import safe_tier_call as _safe
from corekv.offload.writer import OffloadWriter, OnDone
from corekv.tier import Tier

__all__ = ["IN_FLIGHT", "Offload"]
#: where :meth:`Offload.load_blocks` found a block whose write was still queued
IN_FLIGHT = "in-flight"


class Offload:
    """Moves whole blocks between a device pool and an ordered list of tiers.

    The verbs, in a block's life: :meth:`arrived` (a request came: prefetch its tier hits),
    :meth:`load` (admission: load what the tiers hold after the device match), :meth:`cached`
    (blocks became cached: write-through), :meth:`evicted` (the backend reuses cached blocks'
    slots: write-back), :meth:`park` / :meth:`unpark` (swap preemption), :meth:`left` (a request
    left before admission) and :meth:`close`.

    Invariants: the offload queue holds at most ``queue_blocks`` blocks, or one batch if that
    batch alone is larger; prefetches stage at most ``prefetch_blocks`` blocks at once; tier
    failures never raise into the engine (the tiers count them as misses, skips or faults);
    ``hit_counts`` is empty when ``offload_min_hits`` is 0, else it counts only blocks on the
    device and never holds more than the pool's ``num_blocks`` entries (the least recently
    counted dropped first); ``opted_out`` holds only hashes cached on the device; a prefetch is
    kept per waiting request only, until :meth:`load` or :meth:`left`.

    NOTE: the ``num_blocks`` cap backs the eviction rule up for blocks that leave the device
    without an eviction callback (a swapped-in block without prefix caching is never cached, so
    never evicted). At most ``num_blocks`` blocks are resident at once, so where every counted
    block is cached the cap never drops a resident block's count.
    """

    def __init__(self, tiers: Sequence[Tier], kv_pool, *, write_policy: str = "write_back",
                 offload_min_hits: int = 0, queue_blocks: int = 256, hooks=None,
                 prefetch_blocks: int | None = None, swap_tier: int | None = None, backend=None,
                 on_done: OnDone | None = None, reload_cost: ReloadCost | None = None,
                 admission: AdmissionPolicy | None = None):
        """:param prefetch_blocks: blocks prefetches may stage in host memory at once (None: as
            many as the device pool holds; 0: no prefetch, admission loads synchronously).
        :param swap_tier: index of the tier swap preemption parks blocks in (None: no swap).
        :param backend: the prefix-cache backend over ``kv_pool``: its evictions are wired to
            :meth:`evicted` (until :meth:`close`), and at close the blocks it still caches are
            written to the persistent tiers, so a new process finds them.
        :param on_done: told when each offloaded block's write ended (:mod:`.writer`'s ``OnDone``).
        :param reload_cost: decides how many tier hits a request loads (:mod:`.cost`; default:
            all of them); the engine feeds it its step times through :attr:`cost`.
        :param admission: which cached blocks may go to the tiers (:mod:`corekv.admission`; default:
            the rule of ``offload_min_hits``).
        :raises ValueError: a backend that cannot report evicted blocks' hashes.

        NOTE: the arguments are checked here too although the config reader checked the config's
        values: tests and embedding code (the vLLM connector) build an Offload without a config.
        """
        self.planner = OffloadPlanner(write_policy=write_policy, offload_min_hits=offload_min_hits,
                                      max_tracked=kv_pool.num_blocks, admission=admission)
        if queue_blocks < 1:
            raise ValueError(f"queue_blocks must be >= 1, got {queue_blocks}")
        if prefetch_blocks is None:
            prefetch_blocks = kv_pool.num_blocks
        if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0 (0: no prefetch), got {prefetch_blocks!r}")
        if not tiers:
            raise ValueError("tiers must name at least one tier; without tiers there is nothing to offload")
        self.tiers = list(tiers)
        self.tier_names = [t.name for t in self.tiers]
        self.kv_pool = kv_pool
        self.queue_blocks = queue_blocks
        self.hooks = hooks  # a pluggy HookRelay (corekv_on_blocks_offloaded/loaded) or None
        self.backend = backend
        #: hashes cached by requests that opted out of offload; dropped when evicted
        self.opted_out: set[BlockHash] = set()
        #: per tier: "<name>.reloaded", ".prefetched", ".offloaded", ".offload_skips", ".swapped_*"
        self.counters = Counter()
        self.reloader = Reloader(self.tiers, kv_pool, self.counters, self._loaded, reload_cost)
        #: the reload-or-recompute cost model (:class:`~corekv.offload.cost.ReloadCost`)
        self.cost = self.reloader.cost
        self._writer: OffloadWriter | None = OffloadWriter(self.counters, queue_blocks=queue_blocks, hooks=hooks,
                                                           on_done=on_done)
        self.prefetcher = Prefetcher(self.reloader.stage, max_blocks=prefetch_blocks) if prefetch_blocks else None
        self.swap = (Swap(self.tiers[swap_tier], kv_pool, self.counters, self.reloader.load_into)
                     if swap_tier is not None else None)
        #: waiting requests' prefetches, until their admission (:meth:`load`) or :meth:`left`
        self.prefetches: dict[Hashable, Prefetch] = {}
        if backend is not None:
            try:
                backend.on_evict = self.evicted
            except ValueError:
                self._stop()
                raise

    # -- a request's blocks ------------------------------------------------------------------
    def arrived(self, request: Hashable, key: PrefixKey, num_device_blocks: int, max_blocks: int) -> None:
        """``request`` arrived: start fetching blocks ``num_device_blocks .. max_blocks - 1`` of
        ``key`` (its device match now, up to what it may reuse) into host staging."""
        if self.prefetcher is None or num_device_blocks >= max_blocks or request in self.prefetches:
            return
        prefetch = self.prefetcher.start(key, num_device_blocks, max_blocks)
        if prefetch is not None:
            self.prefetches[request] = prefetch

    def load(self, request: Hashable, key: PrefixKey, num_device_blocks: int, max_blocks: int,
             block_ids: Sequence[int]) -> dict[str, int]:
        """Admission of ``request``: its first ``num_device_blocks`` blocks hit on the device
        (counted for ``offload_min_hits``); load blocks ``num_device_blocks .. max_blocks - 1``
        of ``key`` into ``block_ids`` (one per block, in order) as far as the tiers hold them,
        from its prefetch's staging first.

        :returns: ``{tier name: blocks loaded}`` for the leading blocks that loaded.
        """
        if num_device_blocks:
            self.planner.count_hits(key.block_hashes[:num_device_blocks])
        prefetch = self.prefetches.pop(request, None)
        return self.reloader.load_prefix(key, num_device_blocks, max_blocks, block_ids,
                                         self.prefetcher, prefetch)

    def load_blocks(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> dict[str, int]:
        """Load the chain ``hashes`` (a prefix's blocks from some block on) into ``block_ids``
        (one per block, in order) as far as they are held, with no prefetch (a caller that
        plans elsewhere: the vLLM connector's worker). A block whose write is still queued is
        copied from the writer's snapshot of it (counted as :data:`IN_FLIGHT`), the others from
        the tiers.

        :returns: ``{tier name or IN_FLIGHT: blocks loaded}`` for the leading blocks that loaded.
        """
        loaded: dict[str, int] = {}
        pending = self._writer.pending_rows(hashes) if self._writer is not None else [None] * len(hashes)
        pos = 0
        while pos < len(hashes):
            end = pos + 1
            if pending[pos] is not None:
                # NOTE: a run of consecutive rows of one snapshot is copied from a view of it:
                # stacking them first would allocate and fill a second copy of the run
                snapshot, first = pending[pos]
                while end < len(hashes) and pending[end] is not None and pending[end][0] is snapshot \
                        and pending[end][1] == first + end - pos:
                    end += 1
                rows = snapshot[first:first + end - pos].contiguous().view(torch.uint8).reshape(end - pos, -1)
                write_rows(self.kv_pool, list(block_ids[pos:end]), rows)
                got = {IN_FLIGHT: end - pos}
            else:
                while end < len(hashes) and pending[end] is None:
                    end += 1
                got = self.reloader.load_prefix(_Chain(hashes[pos:end]), 0, end - pos, block_ids[pos:end])
            for name, num in got.items():
                loaded[name] = loaded.get(name, 0) + num
            if sum(got.values()) < end - pos:
                break
            pos = end
        return loaded

    def discard(self, hashes: Sequence[BlockHash]) -> None:
        """Delete ``hashes`` from every tier (entries that failed to load: they would fail the
        next load too, since a write skips keys a tier holds)."""
        for tier in self.tiers:
            _safe(lambda: tier.delete(list(hashes)), None, tier, "delete")

    def left(self, request: Hashable, parked: Parked | None = None) -> None:
        """``request`` left before admission: drop its prefetch (counted) and its parked entry."""
        prefetch = self.prefetches.pop(request, None)
        if prefetch is not None:
            self.prefetcher.drop(prefetch)
        if parked is not None and self.swap is not None:
            self.swap.forget(parked)

    def cached(self, key: PrefixKey, block_ids: Sequence[int], start: int, *, offload: bool = True) -> None:
        """``key``'s blocks ``start ..`` became cached in ``block_ids[start:]`` (write-through).

        :param offload: False for a request that opted out: its blocks are kept off the tiers
            (now, and at write-back, until they leave the device).
        """
        if start >= len(block_ids):
            return
        hashes = key.block_hashes[start:len(block_ids)]
        if not offload:
            self.opted_out.update(hashes)
        elif self.planner.is_write_through:
            self._offload(list(hashes), list(block_ids[start:]), [key.priority] * len(hashes))

    def evicted(self, evicted: list[EvictedBlock]) -> None:
        """Backend callback: ``evicted`` blocks' slots are about to be reused (write-back)."""
        kept = [e for e in evicted if e.block_hash not in self.opted_out]
        if self.opted_out:
            self.opted_out.difference_update(e.block_hash for e in evicted)
        if not self.planner.is_write_through and kept:
            self._offload([e.block_hash for e in kept], [e.block_id for e in kept], [e.priority for e in kept])
        self.planner.forget(e.block_hash for e in evicted)

    # -- swap preemption ---------------------------------------------------------------------
    @property
    def can_swap(self) -> bool:
        return self.swap is not None

    def park(self, owner: str, key: PrefixKey, block_table: Sequence[int], num_computed: int) -> Parked:
        """A preempted sequence's computed blocks, written to the swap tier now (see :class:`Swap`)."""
        return self.swap.park(owner, key, block_table, num_computed)

    def unpark(self, parked: Parked, block_table: Sequence[int], num_full_loaded: int) -> int | None:
        """At re-admission, after :meth:`load`: the parked partial block back into the table."""
        return self.swap.unpark(parked, block_table, num_full_loaded)

    # -- lifetime and views ------------------------------------------------------------------
    @property
    def write_policy(self) -> str:
        return self.planner.write_policy

    @property
    def offload_min_hits(self) -> int:
        return self.planner.offload_min_hits

    @property
    def hit_counts(self) -> dict[BlockHash, int]:
        """The planner's device-hit counts (see :class:`~corekv.offload.planner.OffloadPlanner`)."""
        return self.planner.hit_counts

    def flush(self, hashes_and_ids: Sequence[tuple[BlockHash, int]] = (), *,
              tiers: Sequence[Tier] | None = None, priorities: Sequence[int] | None = None) -> None:
        """Offload the given cached blocks to ``tiers`` (default: all) and wait for every queued
        write. Forced: no ``offload_min_hits`` filter, and the queue bound is kept by writing in
        batches of ``queue_blocks``. ``priorities``: the blocks' eviction priorities (``None``: 0)."""
        targets = self.tiers if tiers is None else list(tiers)
        if priorities is None:
            priorities = [0] * len(hashes_and_ids)
        items = [(h, b, p) for (h, b), p in zip(hashes_and_ids, priorities) if h not in self.opted_out]
        if items and targets and self._writer is not None:
            for i in range(0, len(items), self.queue_blocks):
                batch = items[i:i + self.queue_blocks]
                self._enqueue([h for h, _, _ in batch], [b for _, b, _ in batch], targets,
                              [p for _, _, p in batch])
                self._writer.join()
        if self._writer is not None:
            self._writer.join()

    def close(self) -> None:
        """Write the device's cached blocks to the persistent tiers, finish queued writes, stop
        the threads and close the tiers. Idempotent."""
        if self._writer is None:
            return
        try:
            persistent = [t for t in self.tiers if t.is_persistent]
            if persistent and self.backend is not None:
                backend = self.backend
                cached = [(h, b) for b in range(backend.num_blocks) if (h := backend.block_hash(b)) is not None]
                self.flush(cached, tiers=persistent, priorities=[backend.block_priority(b) for _, b in cached])
            else:
                self.flush()
        finally:
            if self.backend is not None:
                self.backend.on_evict = None
            self._stop()

    def _stop(self) -> None:
        """Stop the threads and close the tiers."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for tier in self.tiers:
            _safe(tier.close, None, tier, "close")

    @property
    def num_queued_blocks(self) -> int:
        """Blocks waiting for the background tier writer (0 once :meth:`flush` returns)."""
        return self._writer.num_queued_blocks if self._writer is not None else 0

    def measure_tiers(self) -> dict[str, TierMeasurement | None]:
        """Seed the cost model (:attr:`cost`) with each tier's latency and read time, measured
        now by a few calls on a probe entry (:mod:`.measure`: within about one of the tier's
        deadlines, never raising); ``make_offload`` calls it when a tier opens under
        ``reload_policy: cost``. Returns what each tier measured (``None``: it did not answer)."""
        found = {}
        for index, tier in enumerate(self.tiers):
            found[tier.name] = measured = measure_tier(tier)
            if measured is not None:
                self.cost.seed(index, latency_s=measured.latency_s, s_per_block=measured.s_per_block)
        return found

    def prefetch_stats(self) -> dict[str, float]:
        """Prefetch counters (see :class:`corekv.offload.prefetch.Prefetcher`); empty without prefetch."""
        return self.prefetcher.stats() if self.prefetcher is not None else {}

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: the tier's own counters plus blocks reloaded, prefetched, offloaded, swapped."""
        out = {}
        for tier in self.tiers:
            entry = dict(_safe(tier.stats, {}, tier, "stats"))
            for name, counter in (("reloaded_blocks", "reloaded"), ("prefetched_blocks", "prefetched"),
                                  ("offloaded_blocks", "offloaded"), ("offload_skips", "offload_skips"),
                                  ("swapped_out_blocks", "swapped_out"), ("swapped_in_blocks", "swapped_in")):
                entry[name] = self.counters[f"{tier.name}.{counter}"]
            # the summary names: blocks reloaded/offloaded, skipped writes (tier full or queue
            # full), bytes moved both ways
            entry["reloads"] = entry["reloaded_blocks"]
            entry["offloads"] = entry["offloaded_blocks"]
            entry["skips"] = entry.get("skips", 0) + entry["offload_skips"]
            entry["bytes"] = entry.get("bytes_read", 0) + entry.get("bytes_written", 0)
            for name in ("hits", "misses", "faults"):
                entry.setdefault(name, 0)
            out[tier.name] = entry
        return out

    # -- helpers -----------------------------------------------------------------------------
    def _loaded(self, tier_index: int, keys: Sequence[BlockHash], snapshot: Callable[[], torch.Tensor]) -> None:
        """The reloader put ``keys`` into the pool from tier ``tier_index``: count the hits,
        announce them, and (write-through) promote them to the tiers above at once."""
        self.planner.count_hits(keys)
        if self.hooks is not None:
            self.hooks.corekv_on_blocks_loaded(tier=self.tiers[tier_index].name, block_hashes=list(keys))
        if tier_index > 0 and self.planner.is_write_through and self._writer is not None:
            self._writer.submit(keys, snapshot, self.tiers[:tier_index])

    def _offload(self, hashes: list[BlockHash], block_ids: list[int], priorities: list[int]) -> None:
        keep = self.planner.qualifying(hashes)
        if keep:
            self._enqueue([hashes[i] for i in keep], [block_ids[i] for i in keep], self.tiers,
                          [priorities[i] for i in keep])

    def _enqueue(self, hashes: Sequence[BlockHash], block_ids: Sequence[int], tiers: list[Tier],
                 priorities: Sequence[int]) -> None:
        # NOTE: the snapshot is taken now, on the caller's thread (only if the queue has room):
        # the slot may be overwritten as soon as we return.
        if self._writer is not None:
            self._writer.submit(hashes, lambda: snapshot_blocks(self.kv_pool, block_ids), tiers, priorities)


class _Chain:
    """A chain of block hashes where the reloader expects a :class:`PrefixKey` (it reads only
    ``block_hashes``)."""

    __slots__ = ("block_hashes",)

    def __init__(self, hashes: Sequence[BlockHash]):
        self.block_hashes = list(hashes)
