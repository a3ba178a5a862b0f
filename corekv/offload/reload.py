"""Reload: a prefix's blocks beyond the device match, found down the tiers and copied into the pool.

The hash chain continues down the tiers in order: at each block the first tier that holds it
serves it, so one prefix may come partly from host memory and partly from LMDB. A block that
fails its header or tag check ends the run; everything after it is computed as usual. With
prefetch (:mod:`corekv.offload.prefetch`), the lookup and the tier reads start when a request
arrives, on a background thread, into host staging; admission (:meth:`Reloader.load_prefix`)
then copies the staged rows into the pool in one batched copy and loads only what was not staged.
Every tier read is timed for the cost model (:mod:`~corekv.offload.cost`), which decides how many
of a lookup's blocks are worth loading; the rest are recomputed.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from corekv.hashing import BlockHash, PrefixKey
from corekv.offload.cost import ReloadCost
from corekv.offload.pool_io import StagingBuffers, load_into_pool, snapshot_blocks, write_rows
from corekv.offload.prefetch import Prefetch, Prefetcher, TierRun
from corekv.offload.tier_calls import safe_tier_call as _safe
from corekv.tier import Tier

__all__ = ["Reloader", "OnLoaded", "lookup_runs"]

#: blocks per tier call of a prefetch job: between calls it checks for admission's handoff
_CHUNK = 8

#: ``on_loaded(tier_index, keys, snapshot)``: blocks ``keys`` reached the pool from that tier;
#: ``snapshot()`` returns their bytes as CPU rows (for a write-through promotion)
OnLoaded = Callable[[int, Sequence[BlockHash], Callable[[], torch.Tensor]], None]


def lookup_runs(tiers: Sequence[Tier], hashes: Sequence[BlockHash], start: int, stop: int,
                ask: Callable[[int, int], bool] | None = None) -> list[TierRun]:
    """Runs of the chain ``hashes[start:stop]`` held by ``tiers``, from ``start`` on: the leading
    run of the first tier that holds block ``start``, then on from its end, down the tiers in
    order, until no tier holds the next block. A tier that fails answers "absent" (counted).
    ``ask(tier index, blocks)``: False leaves that tier out of this lookup (the cost model's
    :meth:`~corekv.offload.cost.ReloadCost.worth_asking`)."""
    runs: list[TierRun] = []
    pos = start
    while pos < stop:
        for index, tier in enumerate(tiers):
            if ask is not None and not ask(index, stop - pos):
                continue
            num = _safe(lambda: tier.exists(hashes[pos:stop]), 0, tier, "exists")
            if num:
                runs.append(TierRun(index, num))
                pos += num
                break
        else:
            break
    return runs


class Reloader:
    """Copies blocks from an ordered list of tiers into a KV pool.

    Invariants: a block reloaded into the pool holds exactly the bytes that were offloaded (the
    tier validated them, on the prefetch thread or at admission); a block is fetched from the
    tiers at most once per admission (staged rows are used, the rest loaded); tier failures never
    raise (they are misses). Counters (in the shared ``counters``): ``<tier>.reloaded`` and
    ``<tier>.prefetched``.
    """

    def __init__(self, tiers: Sequence[Tier], kv_pool, counters: Counter, on_loaded: OnLoaded,
                 cost: ReloadCost | None = None):
        self.tiers = list(tiers)
        #: measures every tier read and decides how many blocks a lookup loads
        self.cost = cost or ReloadCost([t.name for t in self.tiers], kv_pool.block_size)
        self.kv_pool = kv_pool
        self.counters = counters
        self.on_loaded = on_loaded
        self.staging = StagingBuffers(kv_pool)

    def lookup(self, key: PrefixKey, start: int, stop: int, *, count: bool = True) -> list[TierRun]:
        """Runs of blocks ``start .. stop - 1`` of ``key`` held by the tiers worth asking (the
        cost model's; ``count``: admission's lookup, not a prefetch's), from ``start`` on."""
        return lookup_runs(self.tiers, key.block_hashes, start, stop,
                           ask=lambda index, num: self.cost.worth_asking(index, num, count=count))

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
            started = time.perf_counter()
            flags = self.load_into(tier, keys, ids)
            self.cost.observe_load(run.tier_index, len(keys), time.perf_counter() - started)
            num_ok = next((i for i, ok in enumerate(flags) if not ok), len(flags))
            if num_ok:
                loaded[tier.name] = loaded.get(tier.name, 0) + num_ok
                self.counters[f"{tier.name}.reloaded"] += num_ok
                self.on_loaded(run.tier_index, keys[:num_ok],
                               lambda ids=ids[:num_ok]: snapshot_blocks(self.kv_pool, ids))
            if num_ok < len(flags):
                break
            pos += run.num_blocks
            offset += run.num_blocks
        return loaded

    def load_prefix(self, key: PrefixKey, start: int, stop: int, block_ids: Sequence[int],
                    prefetcher: Prefetcher | None = None, prefetch: Prefetch | None = None) -> dict[str, int]:
        """Admission: load blocks ``start .. stop - 1`` of ``key`` into ``block_ids`` (one per
        block, in order), as far as the tiers hold them.

        ``start`` is the device match found now. Rows ``prefetch`` staged are copied in one
        batch; blocks it did not stage (before its start, when the device lost blocks since the
        request arrived, or after its end) are looked up and loaded synchronously.

        :returns: ``{tier name: blocks loaded}`` for the leading blocks that loaded.
        """
        staged = prefetcher.take(prefetch) if prefetch is not None else None
        stop = self.cost.limit(start, stop)  # cache.max_load_tokens
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
                limit = min(staged.start, stop) if staged is not None and pos < staged.start else stop
                runs = _cut(self.lookup(key, pos, limit), self.cost.num_blocks_to_load)
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
                rows = staged.staging
                prefetcher.release(staged, num_used)
                self.staging.give_back(rows)
        return loaded

    def stage(self, prefetch: Prefetch, max_blocks: int, reserve) -> None:
        """The prefetch job (on the prefetch thread): look up the prefetch's blocks down the
        tiers and fetch at most ``max_blocks`` leading hits, validated, into staging rows,
        ``_CHUNK`` blocks per tier call, until admission asks it to stop."""
        key, start = prefetch.key, prefetch.start
        runs = _cut(self.lookup(key, start, self.cost.limit(start, prefetch.stop), count=False),
                    lambda found: self.cost.num_blocks_to_load(found, count=False))
        total = min(sum(run.num_blocks for run in runs), max_blocks)
        if total == 0:
            return
        reserve(total)
        # NOTE: pinned staging (on an accelerator) makes the host-to-device copy at admission
        # asynchronous; on a CPU pool the rows are recycled between jobs (StagingBuffers says why).
        prefetch.staging = self.staging.take(total)
        staging_rows = prefetch.staging.numpy()
        hashes, offset = key.block_hashes, 0
        for run in runs:
            tier, end = self.tiers[run.tier_index], min(offset + run.num_blocks, total)
            while offset < end:
                if prefetch.stop_requested:
                    return
                num = min(_CHUNK, end - offset)
                keys = hashes[start + offset:start + offset + num]
                started = time.perf_counter()
                flags = _safe(lambda: tier.get_into(keys, list(staging_rows[offset:offset + num])),
                              [False] * num, tier, "get_into")
                self.cost.observe_load(run.tier_index, num, time.perf_counter() - started)
                num_ok = next((i for i, ok in enumerate(flags) if not ok), num)
                if num_ok:
                    prefetch.add(run.tier_index, num_ok)
                offset += num_ok
                if num_ok < num:
                    return
            if offset == total:
                return

    def load_into(self, tier: Tier, keys: list[BlockHash], block_ids: list[int]) -> list[bool]:
        """``tier``'s entries for ``keys`` copied into pool blocks ``block_ids``; hit flags."""
        return _safe(lambda: load_into_pool(self.kv_pool, tier, keys, block_ids, self.staging),
                     [False] * len(keys), tier, "get_into")

    def _load_staged(self, key: PrefixKey, staged: Prefetch, pos: int, stop: int,
                     block_ids: Sequence[int], loaded: dict[str, int]) -> int:
        """Copy ``staged``'s blocks ``pos ..`` (up to ``stop``) into ``block_ids`` (one batched
        host-to-device copy per run on an accelerator); count and announce them per tier run.
        Returns the number of blocks."""
        first = pos - staged.start
        last = min(stop, staged.start + staged.num_staged) - staged.start
        row = 0
        for run in staged.runs:
            lo, hi = max(row, first), min(row + run.num_blocks, last)
            row += run.num_blocks
            if lo >= hi:
                continue
            rows = staged.staging[lo:hi]
            write_rows(self.kv_pool, list(block_ids[lo - first:hi - first]), rows)
            tier = self.tiers[run.tier_index]
            keys = key.block_hashes[staged.start + lo:staged.start + hi]
            loaded[tier.name] = loaded.get(tier.name, 0) + hi - lo
            self.counters[f"{tier.name}.reloaded"] += hi - lo
            self.counters[f"{tier.name}.prefetched"] += hi - lo
            self.on_loaded(run.tier_index, keys, lambda rows=rows: self.staging.snapshot(rows))
        return last - first


def _cut(runs: list[TierRun], num_blocks_to_load: Callable[[list[TierRun]], int]) -> list[TierRun]:
    """``runs`` up to the number of blocks the cost model loads (a run boundary or a cap)."""
    left = num_blocks_to_load(runs)
    kept = []
    for run in runs:
        if left <= 0:
            break
        kept.append(TierRun(run.tier_index, min(run.num_blocks, left)))
        left -= run.num_blocks
    return kept
