"""Prefetch: a waiting request's tier hits are fetched into host staging before its admission.

When a request arrives, :meth:`Prefetcher.start` queues a job on one background thread: look its
prefix up in the tiers beyond the device match and copy the hits' validated bytes (header and
tag checked, as on every load) into one staging buffer. At admission the reloader takes the
staged rows (:meth:`Prefetcher.take`) and copies them into the allocated pool blocks in one
batched copy, so the tier I/O of request B runs while the engine's step for the others does. A
job that has not started by admission is cancelled and the reloader loads synchronously instead;
a job that is running is told to stop after its current tier call and waited for, and the
reloader loads the blocks it did not reach: a block is never fetched twice.

NOTE: a job admission would wait for is stopped rather than finished because the engine thread
has nothing else to do meanwhile and can load the rest straight into the pool blocks itself; it
also means pool blocks are never handed to a running job (BENCHMARKS.md, "Prefetch: stopping a
running job at admission").

NOTE: staged bytes are keyed by chained block hashes, which name a block's whole prefix, so they
stay right whatever happens to the device cache or the tiers meanwhile: the reloader only
decides at admission (from the device match it finds then) which staged rows it still needs.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from corekv.hashing import PrefixKey

logger = logging.getLogger(__name__)

__all__ = ["Prefetch", "Prefetcher", "TierRun"]


@dataclass(frozen=True)
class TierRun:
    """``num_blocks`` consecutive blocks of a prefix held by (or staged from) tier ``tier_index``."""

    tier_index: int
    num_blocks: int


@dataclass(eq=False)
class Prefetch:
    """One request's prefetch of blocks ``start .. stop - 1`` of ``key``.

    After the job ran, blocks ``start .. start + num_staged - 1`` were fetched and validated into
    ``staging[i]`` (for block ``start + i``); ``runs`` says, in order, which tier each came from.
    """

    key: PrefixKey
    start: int
    stop: int
    future: Future | None = None
    runs: list[TierRun] = field(default_factory=list)
    staging: torch.Tensor | None = None
    #: set by admission: the job ends after its current tier call (a plain flag: the job only
    #: reads it, between tier calls)
    stop_requested: bool = False
    is_released: bool = False
    #: staging rows counted against the prefetcher's bound (given back by ``release``, even when
    #: allocating them failed)
    num_reserved: int = 0
    #: ``time.perf_counter()`` when the request arrived and the job was queued
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def num_staged(self) -> int:
        """Blocks fetched into staging."""
        return sum(run.num_blocks for run in self.runs)

    def add(self, tier_index: int, num_blocks: int) -> None:
        """The job staged ``num_blocks`` more blocks (merged into the last run when alike)."""
        last = self.runs[-1] if self.runs else None
        if last is not None and last.tier_index == tier_index:
            self.runs[-1] = TierRun(tier_index, last.num_blocks + num_blocks)
        else:
            self.runs.append(TierRun(tier_index, num_blocks))


#: ``stage(prefetch, max_blocks, reserve)``: the reloader's fetch; it calls ``reserve(rows)`` once,
#: before allocating ``prefetch.staging``, and fills ``prefetch.runs`` with ``prefetch.add``
StageFn = Callable[[Prefetch, int, Callable[[int], None]], None]


class Prefetcher:
    """Runs prefetch jobs on one background thread, within a bound on staged blocks.

    Invariants: at most ``max_blocks`` staging rows exist at once (the job fetches only what
    fits; the rest is loaded synchronously at admission); every :class:`Prefetch` is released
    exactly once, by :meth:`release` after :meth:`take`, or by :meth:`drop`; a job cancelled
    before it ran never touched a tier; once :meth:`take` returns, the job has ended.
    """

    def __init__(self, stage: StageFn, *, max_blocks: int):
        if not isinstance(max_blocks, int) or isinstance(max_blocks, bool) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an int >= 1, got {max_blocks!r}; pass the number "
                             "of blocks prefetches may stage in host memory at once")
        self._stage = stage
        self.max_blocks = max_blocks
        self.num_staged_blocks = 0
        #: started, ready (done by admission), fallbacks (cancelled: loaded
        #: synchronously), stopped (running at admission: stopped after its tier call),
        #: dropped (aborted before admission), skipped (no staging room), staged_blocks,
        #: used_blocks, dropped_blocks; wait_s (seconds admission waited)
        self.counters: Counter = Counter()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="corekv-prefetch")

    def start(self, key: PrefixKey, start: int, stop: int) -> Prefetch | None:
        """Queue the fetch of blocks ``start .. stop - 1`` of ``key``; None if there is nothing to do."""
        if start >= stop or self._executor is None:
            return None
        prefetch = Prefetch(key, start, stop)
        prefetch.future = self._executor.submit(self._run, prefetch)
        self.counters["started"] += 1
        return prefetch

    def take(self, prefetch: Prefetch) -> Prefetch | None:
        """At admission: the prefetch, ended (a running job is stopped after its current tier
        call and waited for), or None when the job had not started (it is cancelled; the caller
        loads synchronously and must not call :meth:`release`)."""
        future = prefetch.future
        if future.cancel():
            self.counters["fallbacks"] += 1
            prefetch.is_released = True
            return None
        prefetch.stop_requested = True
        if future.done():
            self.counters["ready"] += 1
        else:
            self.counters["stopped"] += 1
            t0 = time.perf_counter()
            future.result()
            self.counters["wait_s"] += time.perf_counter() - t0
        return prefetch

    def release(self, prefetch: Prefetch, num_used: int) -> None:
        """Free ``prefetch``'s staging; ``num_used`` of its rows reached the pool."""
        with self._lock:
            if prefetch.is_released:
                return
            prefetch.is_released = True
            self.num_staged_blocks -= prefetch.num_reserved
            self.counters["used_blocks"] += num_used
            self.counters["dropped_blocks"] += prefetch.num_staged - num_used
        prefetch.staging = None

    def drop(self, prefetch: Prefetch) -> None:
        """The request left before admission (aborted): cancel or discard its prefetch."""
        self.counters["dropped"] += 1
        if prefetch.future.cancel():
            prefetch.is_released = True
            return
        # NOTE: a running job cannot be stopped midway; its staging is freed when it ends.
        prefetch.future.add_done_callback(lambda _: self.release(prefetch, 0))

    def stats(self) -> dict[str, float]:
        out = {name: self.counters[name] for name in (
            "started", "ready", "stopped", "fallbacks", "dropped", "skipped", "staged_blocks",
            "used_blocks", "dropped_blocks")}
        out["wait_s"] = round(self.counters["wait_s"], 6)
        out["num_staged_blocks"] = self.num_staged_blocks
        return out

    def close(self) -> None:
        """Cancel queued jobs and wait for the running one."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    # -- the worker ------------------------------------------------------------------------
    def _run(self, prefetch: Prefetch) -> None:
        with self._lock:
            room = self.max_blocks - self.num_staged_blocks
            if room <= 0:
                self.counters["skipped"] += 1
                return

        def reserve(num_rows: int) -> None:
            # NOTE: one worker thread, so the room read above can only have grown meanwhile.
            with self._lock:
                self.num_staged_blocks += num_rows
                prefetch.num_reserved += num_rows

        try:
            self._stage(prefetch, room, reserve)
        except Exception:  # pragma: no cover - a bug; admission then loads what is missing
            logger.exception("corekv prefetch: unexpected error; the request loads at admission")
        with self._lock:
            self.counters["staged_blocks"] += prefetch.num_staged
