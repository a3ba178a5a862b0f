"""The offload writer: one background thread that stores snapshots of blocks in tiers.

The facade takes a snapshot of the blocks to offload on the caller's thread (the pool slot
may be reused as soon as the caller returns) and hands it here; encoding, checksums and tier I/O
run on the writer thread, so generation never waits for a tier. When the queue is full the
blocks are skipped and counted instead. The thread runs at the lowest CPU priority (nice 19): it
uses the time the compute threads leave, never theirs (see :func:`_yield_to_compute`).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from corekv.hashing import BlockHash
from corekv.offload.tier_calls import safe_tier_call
from corekv.tier import Tier

logger = logging.getLogger(__name__)

__all__ = ["OffloadWriter"]

#: the writer thread's nice value: the lowest CPU priority
WRITER_NICE = 19

_STOP = object()
#: ``on_done(hashes, outcome)``: the writes of ``hashes`` ended, ``outcome`` one of
#: :data:`corekv.offload.planner.OUTCOMES`; called on the writer's thread (or the submitter's
#: for a skip), exactly once per submitted block
OnDone = Callable[[list[BlockHash], str], None]


class OffloadWriter:
    """Writes ``(hashes, snapshot, tiers, priorities)`` batches to every listed tier that lacks
    them (``priorities``: the blocks' eviction priorities, handed to ``Tier.put``; a tier that
    ``keeps_priorities`` and holds a block already gets a block of nonzero priority again, for
    the priority alone).

    Invariants: the queue holds at most ``queue_blocks`` blocks, or one batch if that batch
    alone is larger; ``num_queued_blocks`` counts the blocks submitted and not yet finished
    (written, or failed), so it is 0 whenever the queue is drained; a batch is written to each
    tier only for the blocks that tier does not already hold; tier failures are counted by the
    tiers, and neither they nor a failing hook stop the thread; every submitted block is reported to ``on_done`` exactly once, skipped or not.
    Counters (in the shared ``counters``): ``<tier>.offloaded`` and ``<tier>.offload_skips``.
    """

    def __init__(self, counters: Counter, *, queue_blocks: int, hooks=None, on_done: OnDone | None = None):
        if queue_blocks < 1:
            raise ValueError(f"queue_blocks must be >= 1, got {queue_blocks}")
        self.counters = counters
        self.queue_blocks = queue_blocks
        self.hooks = hooks
        self.on_done = on_done
        self._queue: queue.Queue = queue.Queue()
        self._queued_blocks = 0
        #: blocks queued and not yet finished -> (their batch's snapshot, row): what a load may
        #: read before the tiers have it (a request that follows its own write at once)
        self._pending: dict[BlockHash, tuple[torch.Tensor, int]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="corekv-offload", daemon=True)
        self._thread.start()

    def submit(self, hashes: Sequence[BlockHash], snapshot: Callable[[], torch.Tensor],
               tiers: Sequence[Tier], priorities: Sequence[int] | None = None) -> bool:
        """Queue ``hashes`` for ``tiers``; ``snapshot()`` (called now, only if there is room)
        returns their bytes as a CPU tensor, one row per block; ``priorities``: one per block
        (``None``: all 0). False: skipped (queue full)."""
        with self._lock:
            # NOTE: an empty queue takes any one batch, even past the bound: one eviction batch
            # is at most the pool, and dropping it whole would keep long prefixes (a 4K prompt
            # is 257 blocks of 16) out of the tiers for good.
            is_full = bool(self._queued_blocks) and self._queued_blocks + len(hashes) > self.queue_blocks
            if is_full:
                for tier in tiers:
                    self.counters[f"{tier.name}.offload_skips"] += len(hashes)
            else:
                self._queued_blocks += len(hashes)
        if is_full:
            self._report(hashes, "skipped")
            return False
        try:
            item = (list(hashes), snapshot(), list(tiers),
                    [0] * len(hashes) if priorities is None else list(priorities))
        except BaseException:
            self._done(len(hashes))  # never queued: give its room back
            self._report(hashes, "failed")
            raise
        with self._lock:
            for row, h in enumerate(item[0]):
                self._pending[h] = (item[1], row)
        self._queue.put(item)
        return True

    def pending_rows(self, hashes: Sequence[BlockHash]) -> list[tuple[torch.Tensor, int] | None]:
        """Per hash, ``(its batch's snapshot, its row there)`` while its write has not finished
        (the snapshot is never written to); ``None`` for the others."""
        with self._lock:
            return [self._pending.get(h) for h in hashes]

    @property
    def num_queued_blocks(self) -> int:
        """Blocks submitted and not yet written (or given up on)."""
        with self._lock:
            return self._queued_blocks

    def join(self) -> None:
        """Wait until every queued batch is written."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        _yield_to_compute()
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            hashes, snapshot, tiers, priorities = item
            unreported = set(range(len(hashes)))
            try:
                payload = snapshot.contiguous().view(torch.uint8).reshape(len(hashes), -1).numpy()
                for tier in tiers:
                    def put(rows: list[int]) -> int:
                        return safe_tier_call(lambda: tier.put([(hashes[i], payload[i]) for i in rows],
                                                               [priorities[i] for i in rows]), 0, tier, "put")

                    present = safe_tier_call(lambda: tier.contains_many(hashes), [False] * len(hashes),
                                             tier, "contains_many")
                    missing = [i for i, is_present in enumerate(present) if not is_present]
                    stored = 0
                    if missing:
                        stored = put(missing)
                        self.counters[f"{tier.name}.offloaded"] += stored
                        if stored and self.hooks is not None:
                            self.hooks.corekv_on_blocks_offloaded(tier=tier.name,
                                                                  block_hashes=[hashes[i] for i in missing])
                    # NOTE: a block the tier holds is put again only when it carries a priority:
                    # its bytes are not written twice, but the tier raises the entry's priority
                    # to the highest it was written with, so a prefix written by a low-priority
                    # request and later reloaded and used by a high-priority one is kept as such
                    raised = [i for i, is_present in enumerate(present) if is_present and priorities[i]]
                    if raised and tier.keeps_priorities:
                        put(raised)
                    # NOTE: reported as soon as one tier holds them (the first, fastest, usually):
                    # a lookup waiting on them can load from there while lower tiers are written.
                    held = [i for i, is_present in enumerate(present) if is_present]
                    if stored == len(missing):
                        held += missing
                    newly = [i for i in held if i in unreported]
                    if newly:
                        unreported.difference_update(newly)
                        self._report([hashes[i] for i in newly], "stored")
            except Exception:  # pragma: no cover - a bug, but the writer must outlive it
                logger.exception("corekv offload writer: unexpected error; blocks skipped")
            finally:
                # NOTE: in finally, so a batch that failed still gives its room back (a leaked
                # count would shrink the queue for good and skip every later offload) and every
                # queued block gets its report (a lookup may be waiting on it).
                self._report([hashes[i] for i in sorted(unreported)], "failed")
                with self._lock:
                    for h in hashes:
                        if self._pending.get(h, (None,))[0] is snapshot:
                            del self._pending[h]
                self._done(len(hashes))
                self._queue.task_done()

    def _report(self, hashes: Sequence[BlockHash], outcome: str) -> None:
        if hashes and self.on_done is not None:
            try:
                self.on_done(list(hashes), outcome)
            except Exception:  # pragma: no cover - a listener's bug must not stop the writer
                logger.exception("corekv offload writer: completion listener failed")

    def _done(self, num_blocks: int) -> None:
        with self._lock:
            self._queued_blocks -= num_blocks


def _yield_to_compute() -> None:
    """Lower the calling thread to nice :data:`WRITER_NICE`.

    NOTE: a write's checksums and copies cost CPU, and the thread often shares its cores with
    the forward: vLLM binds its worker process, and so every thread it starts, to the compute
    cores. A write still in flight when the next request arrives would slow that request's
    forward (BENCHMARKS.md, "The warm single prompt"). At nice 19 the writer runs in the gaps
    between steps; a queue that still fills skips blocks (counted), never the forward. Linux
    applies ``PRIO_PROCESS`` to one thread when given its thread id.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError) as e:  # NOTE: not Unix, or a sandbox refusing it: run as is
        logger.debug("offload writer: nice %d refused (%s); running at the process's priority", WRITER_NICE, e)
