"""The cache manager: joins the device pool (whose residency the backend decides) and the tiers.

Reload: after the device match, the hash chain continues down the tiers in order — at each block
the first tier that holds it serves it, so one prefix may come partly from host memory and partly
from LMDB — and the hits are copied into newly allocated device blocks. A block that fails its
header or checksum check ends the run; everything after it is computed as usual. With prefetch
(:mod:`corekv.prefetch`), the lookup and the tier reads start when a request arrives, on a
background thread, into host staging; admission (:meth:`CacheManager.load_prefix`) then copies
the staged rows into the pool in one batched copy and loads only what was not staged.

Offload: ``write_back`` (default) copies a cached block out of the pool at the moment the backend
evicts it (before its slot is reused), ``write_through`` as soon as it is cached. The copy is
taken on the step's thread (a memcpy); the tier writes run on one background thread behind a
bounded queue (:mod:`corekv.offload_writer`), and when that queue is full the blocks are skipped
and counted — generation never waits for a tier. Blocks reloaded from a lower tier reach the tiers
above it: with ``write_back`` when they are evicted, like any cached block (eviction writes every
tier that lacks a block); with ``write_through`` at once (from the staging rows when prefetched).

NOTE: promoting at reload under ``write_back`` would copy every reloaded block out of the pool
again on the admission path (inside TTFT) for a write that eviction makes anyway.

NOTE: an offloaded block goes to *every* tier that does not already hold it (each checked with
``exists``), not only the first: with ``host`` above ``lmdb`` the fast tier catches re-use within
the process while the persistent one survives restarts. ``offload_min_hits`` keeps blocks that
were never re-used off the tiers (SSD wear): a block qualifies when it was hit on the device (or
reloaded) that often while resident, and its count is dropped when it is evicted, so the counts
cover the pool's blocks, not every block ever seen. Blocks cached by a request that opted out
(``on_cached(..., offload=False)``) are kept off the tiers until they leave the device.

Swap: ``swap_out`` writes a preempted sequence's blocks to one tier synchronously (the slots are
freed right after); ``load_private`` / ``delete_private`` move a block stored under a private key
(a partial last block, which has no chain hash).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from corekv.backend import EvictedBlock
from corekv.hashing import BlockHash, PrefixKey
from corekv.offload_writer import OffloadWriter, safe_tier_call as _safe
from corekv.pool_io import load_into_pool, snapshot_blocks, write_rows
from corekv.prefetch import Prefetch, Prefetcher
from corekv.tier import Tier

logger = logging.getLogger(__name__)
#: blocks per tier call of a prefetch job: between calls it checks for admission's handoff
_CHUNK = 8


@dataclass(frozen=True)
class TierRun:
    """``num_blocks`` consecutive blocks of a prefix, found in tier ``tier_index``."""

    tier_index: int
    num_blocks: int


class CacheManager:
    """Moves whole blocks between the device pool and an ordered list of tiers.

    Invariants: a block reloaded into the pool holds exactly the bytes that were offloaded (the
    tier validated them, on the prefetch thread or at admission); the offload queue holds at most
    ``queue_blocks`` blocks, or one batch if that batch alone is larger; prefetches stage at most
    ``prefetch_blocks`` blocks at once; tier failures never raise into the engine (the tiers count
    them as misses, skips or faults).

    Bounded state: ``hit_counts`` is empty when ``offload_min_hits`` is 0; otherwise it counts
    only blocks on the device (a count starts at a block's device hit or reload and is dropped
    when the block is evicted, after the offload decision) and never holds more than the pool's
    ``num_blocks`` entries, the least recently counted dropped first. ``opted_out`` holds only
    hashes cached on the device (dropped when evicted). Neither grows with the number of requests
    served or of distinct blocks seen.

    NOTE: the ``num_blocks`` cap backs the eviction rule up for blocks that leave the device
    without an eviction callback (a swapped-in block without prefix caching is never cached, so
    never evicted). At most ``num_blocks`` blocks are resident at once, so where every counted
    block is cached the cap never drops a resident block's count.
    """

    def __init__(self, tiers: Sequence[Tier], kv_pool, *, write_policy: str = "write_back",
                 offload_min_hits: int = 0, queue_blocks: int = 256, hooks=None,
                 prefetch_blocks: int | None = None):
        """:param prefetch_blocks: blocks prefetches may stage in host memory at once (None: as
            many as the device pool holds; 0: no prefetch, admission loads synchronously)."""
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"write_policy must be 'write_back' or 'write_through', got {write_policy!r}")
        if offload_min_hits < 0:
            raise ValueError(f"offload_min_hits must be >= 0, got {offload_min_hits}")
        if queue_blocks < 1:
            raise ValueError(f"queue_blocks must be >= 1, got {queue_blocks}")
        if prefetch_blocks is None:
            prefetch_blocks = kv_pool.num_blocks
        if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0 (0: no prefetch), got {prefetch_blocks!r}")
        self.tiers = list(tiers)
        self.tier_names = [t.name for t in self.tiers]
        self.kv_pool = kv_pool
        self.write_policy = write_policy
        self.offload_min_hits = offload_min_hits
        self.queue_blocks = queue_blocks
        self.hooks = hooks  # a pluggy HookRelay (corekv_on_blocks_offloaded/loaded) or None
        #: device hits (and reloads) per resident block, for ``offload_min_hits``; in the order
        #: last counted (see the class docstring for its bound)
        self.hit_counts: dict[BlockHash, int] = {}
        self.max_hit_counts = kv_pool.num_blocks
        #: hashes cached by requests that opted out of offload; dropped when evicted
        self.opted_out: set[BlockHash] = set()
        #: per tier: "<name>.reloaded", ".prefetched", ".offloaded", ".offload_skips", ".swapped_*"
        self.counters = Counter()
        self._writer = OffloadWriter(self.counters, queue_blocks=queue_blocks, hooks=hooks) if self.tiers else None
        self.prefetcher = (Prefetcher(self._stage, max_blocks=prefetch_blocks)
                           if self.tiers and prefetch_blocks else None)

    # -- reload ------------------------------------------------------------------------------
    def lookup(self, key: PrefixKey, start: int, stop: int) -> list[TierRun]:
        """Runs of blocks ``start .. stop - 1`` of ``key`` held by the tiers, from ``start`` on."""
        runs: list[TierRun] = []
        if not self.tiers or start >= stop:
            return runs
        hashes = key.block_hashes
        pos = start
        while pos < stop:
            for index, tier in enumerate(self.tiers):
                num = _safe(lambda: tier.exists(hashes[pos:stop]), 0, tier, "exists")
                if num:
                    runs.append(TierRun(index, num))
                    pos += num
                    break
            else:
                break
        return runs

    def load(self, key: PrefixKey, start: int, runs: Sequence[TierRun], block_ids: Sequence[int]) -> dict[str, int]:
        """Copy the blocks of ``runs`` into ``block_ids`` (one per block, in order).

        :returns: ``{tier name: blocks loaded}`` for the leading blocks that loaded; the first
            block that did not (a corrupt entry, a tier gone) ends the load.
        """
        loaded: dict[str, int] = {}
        hashes = key.block_hashes
        pos, offset = start, 0
        for run in runs:
            tier = self.tiers[run.tier_index]
            ids = list(block_ids[offset:offset + run.num_blocks])
            keys = hashes[pos:pos + run.num_blocks]
            flags = self._load_into(tier, keys, ids)
            num_ok = next((i for i, ok in enumerate(flags) if not ok), len(flags))
            if num_ok:
                loaded[tier.name] = loaded.get(tier.name, 0) + num_ok
                self.counters[f"{tier.name}.reloaded"] += num_ok
                self._count_hits(keys[:num_ok])
                if self.hooks is not None:
                    self.hooks.corekv_on_blocks_loaded(tier=tier.name, block_hashes=list(keys[:num_ok]))
                if run.tier_index > 0 and self.write_policy == "write_through":  # promote now
                    self._enqueue(keys[:num_ok], ids[:num_ok], tiers=self.tiers[:run.tier_index])
            if num_ok < len(flags):
                break
            pos += run.num_blocks
            offset += run.num_blocks
        return loaded

    def prefetch(self, key: PrefixKey, start: int, stop: int) -> Prefetch | None:
        """Start fetching blocks ``start .. stop - 1`` of ``key`` from the tiers into host staging
        (a request arrived; ``start`` is its device match then). None: nothing to prefetch."""
        if self.prefetcher is None or start >= stop:
            return None
        return self.prefetcher.start(key, start, stop)

    def drop_prefetch(self, prefetch: Prefetch) -> None:
        """The request left before admission: its staged bytes are dropped (counted)."""
        self.prefetcher.drop(prefetch)

    def load_prefix(self, key: PrefixKey, start: int, stop: int, block_ids: Sequence[int],
                    prefetch: Prefetch | None = None) -> dict[str, int]:
        """Admission: load blocks ``start .. stop - 1`` of ``key`` into ``block_ids`` (one per
        block, in order), as far as the tiers hold them.

        ``start`` is the device match found now. Rows ``prefetch`` staged are copied in one
        batch; blocks it did not stage (before its start, when the device lost blocks since the
        request arrived, or after its end) are looked up and loaded synchronously.

        :returns: ``{tier name: blocks loaded}`` for the leading blocks that loaded.
        """
        staged = self.prefetcher.take(prefetch) if prefetch is not None else None
        loaded: dict[str, int] = {}
        pos, num_used = start, 0
        try:
            while pos < stop:
                offset = pos - start
                if staged is not None and staged.start <= pos < staged.start + staged.num_staged:
                    num = self._load_staged(key, staged, pos, stop, block_ids[offset:], loaded)
                    num_used += num
                    pos += num
                    continue
                limit = staged.start if staged is not None and pos < staged.start else stop
                runs = self.lookup(key, pos, limit)
                wanted = sum(run.num_blocks for run in runs)
                got = self.load(key, pos, runs, block_ids[offset:offset + wanted]) if runs else {}
                for name, num in got.items():
                    loaded[name] = loaded.get(name, 0) + num
                num = sum(got.values())
                pos += num
                if num == 0 or num < wanted or pos < limit:
                    break
        finally:
            if staged is not None:
                self.prefetcher.release(staged, num_used)
        return loaded

    @property
    def num_queued_blocks(self) -> int:
        """Blocks waiting for the background tier writer (0 once :meth:`flush` returns)."""
        return self._writer.num_queued_blocks if self._writer is not None else 0

    def prefetch_stats(self) -> dict[str, float]:
        """Prefetch counters (see :class:`corekv.prefetch.Prefetcher`); empty without prefetch."""
        return self.prefetcher.stats() if self.prefetcher is not None else {}

    def note_hits(self, key: PrefixKey, num_blocks: int) -> None:
        """Count device hits of ``key``'s first ``num_blocks`` blocks (for ``offload_min_hits``)."""
        if num_blocks:
            self._count_hits(key.block_hashes[:num_blocks])

    # -- offload -----------------------------------------------------------------------------
    def on_evict(self, evicted: list[EvictedBlock]) -> None:
        """Backend callback: ``evicted`` blocks' slots are about to be reused (write-back)."""
        if not self.tiers:
            return
        kept = [e for e in evicted if e.block_hash not in self.opted_out]
        if self.opted_out:
            self.opted_out.difference_update(e.block_hash for e in evicted)
        if self.write_policy == "write_back" and kept:
            self._offload([e.block_hash for e in kept], [e.block_id for e in kept])
        if self.hit_counts:
            for e in evicted:
                self.hit_counts.pop(e.block_hash, None)

    def on_cached(self, key: PrefixKey, block_ids: Sequence[int], start: int, *, offload: bool = True) -> None:
        """The engine cached ``key``'s blocks ``start ..`` in ``block_ids[start:]`` (write-through).

        :param offload: False for a request that opted out: its blocks are kept off the tiers
            (now, and at write-back, until they leave the device).
        """
        if not self.tiers or start >= len(block_ids):
            return
        hashes = key.block_hashes[start:len(block_ids)]
        if not offload:
            self.opted_out.update(hashes)
        elif self.write_policy == "write_through":
            self._offload(list(hashes), list(block_ids[start:]))

    def flush(self, hashes_and_ids: Sequence[tuple[BlockHash, int]] = (), *,
              tiers: Sequence[Tier] | None = None) -> None:
        """Offload the given cached blocks to ``tiers`` (default: all; e.g. the persistent ones at
        shutdown) and wait for every queued write. Forced: no ``offload_min_hits`` filter, and
        the queue bound is kept by writing in batches of ``queue_blocks``."""
        targets = self.tiers if tiers is None else list(tiers)
        items = [(h, b) for h, b in hashes_and_ids if h not in self.opted_out]
        if items and targets:
            for i in range(0, len(items), self.queue_blocks):
                batch = items[i:i + self.queue_blocks]
                self._enqueue([h for h, _ in batch], [b for _, b in batch], tiers=targets)
                self._writer.join()
        if self._writer is not None:
            self._writer.join()

    # -- swap ---------------------------------------------------------------------------------
    def swap_out(self, tier_index: int, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Write blocks to tier ``tier_index`` now (swap preemption: the slots are freed next).

        :returns: how many of them that tier holds afterwards (stored now or already there).
        """
        if not hashes:
            return 0
        tier = self.tiers[tier_index]
        present = _safe(lambda: tier.exists(list(hashes)), 0, tier, "exists")
        todo = list(range(present, len(hashes)))
        if not todo:
            return len(hashes)
        payload = self._snapshot([block_ids[i] for i in todo]).numpy()
        stored = _safe(lambda: tier.put([(hashes[i], payload[j]) for j, i in enumerate(todo)]), 0, tier, "put")
        self.counters[f"{tier.name}.swapped_out"] += stored
        return present + stored

    def load_private(self, tier_index: int, key: BlockHash, block_id: int) -> bool:
        """Load one block stored under a private (swap) key into ``block_id``; False on a miss."""
        tier = self.tiers[tier_index]
        ok = self._load_into(tier, [key], [block_id])[0]
        if ok:
            self.counters[f"{tier.name}.swapped_in"] += 1
        return ok

    def delete_private(self, tier_index: int, key: BlockHash) -> None:
        tier = self.tiers[tier_index]
        _safe(lambda: tier.delete([key]), None, tier, "delete")

    def close(self) -> None:
        """Stop prefetching, finish queued writes, stop the threads and close the tiers."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for tier in self.tiers:
            _safe(tier.close, None, tier, "close")

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: the tier's own counters plus ``reloaded`` / ``offloaded`` blocks."""
        out = {}
        for tier in self.tiers:
            entry = dict(_safe(tier.stats, {}, tier, "stats"))
            entry["reloaded_blocks"] = self.counters[f"{tier.name}.reloaded"]
            entry["prefetched_blocks"] = self.counters[f"{tier.name}.prefetched"]
            entry["offloaded_blocks"] = self.counters[f"{tier.name}.offloaded"]
            entry["offload_skips"] = self.counters[f"{tier.name}.offload_skips"]
            entry["swapped_out_blocks"] = self.counters[f"{tier.name}.swapped_out"]
            entry["swapped_in_blocks"] = self.counters[f"{tier.name}.swapped_in"]
            # the summary names: blocks reloaded/offloaded, skipped writes (tier full or queue
            # full), bytes moved both ways
            entry["reloads"] = entry["reloaded_blocks"]
            entry["offloads"] = entry["offloaded_blocks"]
            entry["skips"] = entry.get("skips", 0) + entry["offload_skips"]
            entry["bytes"] = entry.get("bytes_read", 0) + entry.get("bytes_written", 0)
            entry.setdefault("hits", 0)
            entry.setdefault("misses", 0)
            entry.setdefault("faults", 0)
            out[tier.name] = entry
        return out

    # -- helpers -----------------------------------------------------------------------------
    def _offload(self, hashes: list[BlockHash], block_ids: list[int], force: bool = False) -> None:
        if self.offload_min_hits and not force:
            keep = [i for i, h in enumerate(hashes) if self.hit_counts.get(h, 0) >= self.offload_min_hits]
            hashes, block_ids = [hashes[i] for i in keep], [block_ids[i] for i in keep]
        if hashes:
            self._enqueue(hashes, block_ids, tiers=self.tiers)

    def _count_hits(self, hashes: Sequence[BlockHash]) -> None:
        """One more hit for each of ``hashes`` (kept only for ``offload_min_hits``, within the bound)."""
        if not self.offload_min_hits:
            return
        counts = self.hit_counts
        for h in hashes:
            counts[h] = counts.pop(h, 0) + 1  # re-inserted: the dict stays in last-counted order
        while len(counts) > self.max_hit_counts:
            del counts[next(iter(counts))]

    def _enqueue(self, hashes: Sequence[BlockHash], block_ids: Sequence[int], tiers: list[Tier]) -> None:
        # NOTE: the snapshot is taken now, on the caller's thread (only if the queue has room):
        # the slot may be overwritten as soon as we return.
        self._writer.submit(hashes, lambda: self._snapshot(block_ids), tiers)

    def _snapshot(self, block_ids: Sequence[int]) -> torch.Tensor:
        return snapshot_blocks(self.kv_pool, block_ids)

    def _stage(self, prefetch: Prefetch, max_blocks: int, reserve) -> None:
        """The prefetch job (on the prefetch thread): look up the prefetch's blocks down the
        tiers and fetch at most ``max_blocks`` leading hits, validated, into staging rows,
        ``_CHUNK`` blocks per tier call, until admission asks it to stop."""
        key, start = prefetch.key, prefetch.start
        runs = self.lookup(key, start, prefetch.stop)
        total = min(sum(run.num_blocks for run in runs), max_blocks)
        if total == 0:
            return
        pool = self.kv_pool
        reserve(total)
        # NOTE: pinned staging makes the host-to-device copy at admission asynchronous; rows'
        # pages are touched only if they are used (empty() does not fault them in).
        prefetch.staging = torch.empty((total, pool.bytes_per_block), dtype=torch.uint8,
                                       pin_memory=pool.storage.device.type != "cpu")
        staging_rows = prefetch.staging.numpy()
        hashes, offset = key.block_hashes, 0
        for run in runs:
            tier, end = self.tiers[run.tier_index], min(offset + run.num_blocks, total)
            while offset < end:
                if prefetch.stop_requested:
                    return
                num = min(_CHUNK, end - offset)
                keys = hashes[start + offset:start + offset + num]
                flags = _safe(lambda: tier.get_into(keys, list(staging_rows[offset:offset + num])),
                              [False] * num, tier, "get_into")
                num_ok = next((i for i, ok in enumerate(flags) if not ok), num)
                if num_ok:
                    prefetch.add(run.tier_index, num_ok)
                offset += num_ok
                if num_ok < num:
                    return
            if offset == total:
                return

    def _load_staged(self, key: PrefixKey, staged: Prefetch, pos: int, stop: int,
                     block_ids: Sequence[int], loaded: dict[str, int]) -> int:
        """Copy ``staged``'s blocks ``pos ..`` (up to ``stop``) into ``block_ids`` (one batched
        host-to-device copy per run on an accelerator); count, announce (and promote) them per
        tier run. Returns the number of blocks."""
        first = pos - staged.start
        last = min(stop, staged.start + staged.num_staged) - staged.start
        row = 0
        for run in staged.runs:
            lo, hi = max(row, first), min(row + run.num_blocks, last)
            row += run.num_blocks
            if lo >= hi:
                continue
            ids = list(block_ids[lo - first:hi - first])
            rows = staged.staging[lo:hi]
            write_rows(self.kv_pool, ids, rows)
            tier = self.tiers[run.tier_index]
            keys = key.block_hashes[staged.start + lo:staged.start + hi]
            num = hi - lo
            loaded[tier.name] = loaded.get(tier.name, 0) + num
            self.counters[f"{tier.name}.reloaded"] += num
            self.counters[f"{tier.name}.prefetched"] += num
            self._count_hits(keys)
            if self.hooks is not None:
                self.hooks.corekv_on_blocks_loaded(tier=tier.name, block_hashes=list(keys))
            if run.tier_index > 0 and self.write_policy == "write_through":  # promote now
                self._writer.submit(keys, lambda: rows, self.tiers[:run.tier_index])
        return last - first

    def _load_into(self, tier: Tier, keys: list[BlockHash], block_ids: list[int]) -> list[bool]:
        return _safe(lambda: load_into_pool(self.kv_pool, tier, keys, block_ids), [False] * len(keys),
                     tier, "get_into")
