"""The cache manager: joins the device pool (whose residency the backend decides) and the tiers.

Reload: after the device match, the hash chain continues down the tiers in order — at each block
the first tier that holds it serves it, so one prefix may come partly from host memory and partly
from LMDB — and the hits are copied straight into newly allocated device blocks. A block that
fails its header or checksum check ends the run; everything after it is computed as usual.

Offload: ``write_back`` (default) copies a cached block out of the pool at the moment the backend
evicts it (before its slot is reused), ``write_through`` as soon as it is cached. The copy is
taken on the step's thread (a memcpy); the tier writes run on one background thread behind a
bounded queue, and when that queue is full the blocks are skipped and counted — generation never
waits for a tier. Blocks reloaded from a lower tier are promoted to the tiers above it.

NOTE: an offloaded block goes to *every* tier that does not already hold it (each checked with
``exists``), not only the first: with ``host`` above ``lmdb`` the fast tier catches re-use within
the process while the persistent one survives restarts. ``offload_min_hits`` keeps blocks that
were never re-used off the tiers (SSD wear). Blocks cached by a request that opted out
(``on_cached(..., offload=False)``) are kept off the tiers until they leave the device.

Swap: ``swap_out`` writes a preempted sequence's blocks to one tier synchronously (the slots are
freed right after); ``load_private`` / ``delete_private`` move a block stored under a private key
(a partial last block, which has no chain hash).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from corekv.backend import EvictedBlock
from corekv.hashing import BlockHash, PrefixKey
from corekv.tier import Tier

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class TierRun:
    """``num_blocks`` consecutive blocks of a prefix, found in tier ``tier_index``."""

    tier_index: int
    num_blocks: int


class CacheManager:
    """Moves whole blocks between the device pool and an ordered list of tiers.

    Invariants: a block reloaded into the pool holds exactly the bytes that were offloaded (the
    tier validated them); the offload queue holds at most ``queue_blocks`` blocks, or one batch if
    that batch alone is larger; tier
    failures never raise into the engine (the tiers count them as misses, skips or faults).
    """

    def __init__(self, tiers: Sequence[Tier], kv_pool, *, write_policy: str = "write_back",
                 offload_min_hits: int = 0, queue_blocks: int = 256, hooks=None):
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"write_policy must be 'write_back' or 'write_through', got {write_policy!r}")
        if offload_min_hits < 0:
            raise ValueError(f"offload_min_hits must be >= 0, got {offload_min_hits}")
        if queue_blocks < 1:
            raise ValueError(f"queue_blocks must be >= 1, got {queue_blocks}")
        self.tiers = list(tiers)
        self.tier_names = [t.name for t in self.tiers]
        self.kv_pool = kv_pool
        self.write_policy = write_policy
        self.offload_min_hits = offload_min_hits
        self.queue_blocks = queue_blocks
        self.hooks = hooks  # a pluggy HookRelay (corekv_on_blocks_offloaded/loaded) or None
        self.hit_counts: Counter[BlockHash] = Counter()
        #: hashes cached by requests that opted out of offload; dropped when evicted
        self.opted_out: set[BlockHash] = set()
        self.counters = Counter()  # per tier: "<name>.reloaded", "<name>.offloaded"; "offload_skips"
        self._queue: queue.Queue = queue.Queue()
        self._queued_blocks = 0
        self._queue_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        if self.tiers:
            self._worker = threading.Thread(target=self._run_offloads, name="corekv-offload", daemon=True)
            self._worker.start()

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
                self.hit_counts.update(keys[:num_ok])
                if self.hooks is not None:
                    self.hooks.corekv_on_blocks_loaded(tier=tier.name, block_hashes=list(keys[:num_ok]))
                if run.tier_index > 0:  # promote to the faster tiers above
                    self._enqueue(keys[:num_ok], ids[:num_ok], tiers=self.tiers[:run.tier_index])
            if num_ok < len(flags):
                break
            pos += run.num_blocks
            offset += run.num_blocks
        return loaded

    def note_hits(self, key: PrefixKey, num_blocks: int) -> None:
        """Count device hits of ``key``'s first ``num_blocks`` blocks (for ``offload_min_hits``)."""
        if self.offload_min_hits and num_blocks:
            self.hit_counts.update(key.block_hashes[:num_blocks])

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
                self._queue.join()
        if self._worker is not None:
            self._queue.join()

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
        snapshot = self.kv_pool.read_blocks([block_ids[i] for i in todo]).to("cpu")
        payload = snapshot.contiguous().view(torch.uint8).reshape(len(todo), -1).numpy()
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
        """Finish queued writes, stop the worker and close the tiers."""
        if self._worker is not None:
            self._queue.put(_STOP)
            self._worker.join()
            self._worker = None
        for tier in self.tiers:
            _safe(tier.close, None, tier, "close")

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: the tier's own counters plus ``reloaded`` / ``offloaded`` blocks."""
        out = {}
        for tier in self.tiers:
            entry = dict(_safe(tier.stats, {}, tier, "stats"))
            entry["reloaded_blocks"] = self.counters[f"{tier.name}.reloaded"]
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
            keep = [i for i, h in enumerate(hashes) if self.hit_counts[h] >= self.offload_min_hits]
            hashes, block_ids = [hashes[i] for i in keep], [block_ids[i] for i in keep]
        if hashes:
            self._enqueue(hashes, block_ids, tiers=self.tiers)

    def _enqueue(self, hashes: Sequence[BlockHash], block_ids: Sequence[int], tiers: list[Tier]) -> None:
        with self._queue_lock:
            # NOTE: an empty queue takes any one batch, even past the bound: one eviction batch
            # is at most the pool, and dropping it whole would keep long prefixes (a 4K prompt
            # is 257 blocks of 16) out of the tiers for good.
            if self._queued_blocks and self._queued_blocks + len(hashes) > self.queue_blocks:
                for tier in tiers:
                    self.counters[f"{tier.name}.offload_skips"] += len(hashes)
                return
            self._queued_blocks += len(hashes)
        # NOTE: the copy happens now, on the caller's thread: the slot may be overwritten as soon
        # as we return. Everything slower (encoding, checksums, I/O) happens on the worker.
        snapshot = self.kv_pool.read_blocks(list(block_ids)).to("cpu")
        self._queue.put((list(hashes), snapshot, tiers))

    def _run_offloads(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                hashes, snapshot, tiers = item
                payload = snapshot.contiguous().view(torch.uint8).reshape(len(hashes), -1).numpy()
                for tier in tiers:
                    missing = [i for i, h in enumerate(hashes)
                               if not _safe(lambda: tier.exists([h]), 0, tier, "exists")]
                    if not missing:
                        continue
                    stored = _safe(lambda: tier.put([(hashes[i], payload[i]) for i in missing]), 0, tier, "put")
                    self.counters[f"{tier.name}.offloaded"] += stored
                    if stored and self.hooks is not None:
                        self.hooks.corekv_on_blocks_offloaded(tier=tier.name, block_hashes=[hashes[i] for i in missing])
                with self._queue_lock:
                    self._queued_blocks -= len(hashes)
            except Exception:  # pragma: no cover - a bug, but the worker must outlive it
                logger.exception("corekv offload worker: unexpected error; blocks skipped")
            finally:
                self._queue.task_done()

    def _load_into(self, tier: Tier, keys: list[BlockHash], block_ids: list[int]) -> list[bool]:
        pool = self.kv_pool
        if pool.storage.device.type == "cpu":
            # NOTE: the pool is block-major, so each block is one contiguous run of bytes: the
            # tier copies straight into it, with no staging buffer.
            views = [pool.storage[b].view(torch.uint8).numpy() for b in block_ids]
            return _safe(lambda: tier.get_into(keys, views), [False] * len(keys), tier, "get_into")
        staging = torch.empty((len(keys), pool.bytes_per_block), dtype=torch.uint8, pin_memory=True)
        flags = _safe(lambda: tier.get_into(keys, list(staging.numpy())), [False] * len(keys), tier, "get_into")
        num_ok = next((i for i, ok in enumerate(flags) if not ok), len(flags))
        if num_ok:
            pool.write_blocks(block_ids[:num_ok], staging[:num_ok])
        return flags


def _safe(call, default, tier: Tier, what: str):
    """Run a tier call; a tier that raises anyway (a plugin's bug) is logged and read as a miss."""
    try:
        return call()
    except Exception as e:
        logger.warning("tier %s: %s failed (%s: %s); treated as a miss", tier.name, what, type(e).__name__, e)
        return default
