"""``lfu_blocks``: corekv's ``hash_blocks`` backend with least-*frequently*-used eviction.

Everything but the eviction order is the builtin backend's: this module subclasses
:class:`corekv.plugins.hash_blocks.HashBlockBackend` and swaps its free queue of cached-idle blocks
(an ``OrderedDict`` in LRU order) for a :class:`FrequencyQueue` that pops the block with the fewest
hits first, and among equals the one released longest ago (so plain LRU is the tie-break).

Why LFU for a prefix cache: a system prompt shared by most requests is hit far more often than a
one-off document, but under LRU a burst of one-off requests pushes it out. With LFU it survives
the burst. The cost is that a once-hot prefix lingers; ``frequency_cap`` bounds how much history
counts, so it falls back to recency among the blocks at the cap.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from corekv.plugin import BackendSpec, Option, hookimpl
from corekv.plugins.hash_blocks import HashBlockBackend


class FrequencyQueue:
    """The cached-idle blocks, in eviction order: fewest hits first, then least recently released.

    It implements the part of the ``OrderedDict`` interface :class:`HashBlockBackend` uses on its
    free queue (``q[b] = None`` appends, ``del q[b]``, ``popitem(last=False)``, ``move_to_end``,
    ``len``, ``clear``), so the backend's own code runs unchanged on top of it.

    Invariants: every queued block is in exactly one bucket, the one of its hit count (capped) at
    the time it was queued; no bucket is empty; each bucket is in release order (oldest first).
    """

    def __init__(self, hits: list[int], frequency_cap: int):
        self._hits = hits
        self._cap = frequency_cap
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._block_to_bucket: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._block_to_bucket)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._block_to_bucket

    def __iter__(self) -> Iterator[int]:
        """Block ids in eviction order."""
        for count in sorted(self._buckets):
            yield from self._buckets[count]

    def __setitem__(self, block_id: int, _value: None) -> None:
        if block_id in self._block_to_bucket:
            del self[block_id]
        count = min(self._hits[block_id], self._cap)
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
        bucket[block_id] = None
        self._block_to_bucket[block_id] = count

    def __delitem__(self, block_id: int) -> None:
        count = self._block_to_bucket.pop(block_id)  # KeyError, like a dict, if absent
        bucket = self._buckets[count]
        del bucket[block_id]
        if not bucket:
            del self._buckets[count]

    def popitem(self, last: bool = True) -> tuple[int, None]:
        """``last=False``: the next block to evict; ``last=True``: the one to evict last."""
        if not self._buckets:
            raise KeyError("popitem(): the frequency queue is empty")
        # NOTE: min() over the bucket keys is O(frequency_cap) at worst, which the cap keeps small;
        # a sorted structure would cost more on every insert than it saves here.
        count = min(self._buckets) if not last else max(self._buckets)
        block_id = next(iter(self._buckets[count])) if not last else next(reversed(self._buckets[count]))
        del self[block_id]
        return block_id, None

    def move_to_end(self, block_id: int, last: bool = True) -> None:
        """Within its bucket: ``last=False`` makes the block the next one evicted among equals."""
        self._buckets[self._block_to_bucket[block_id]].move_to_end(block_id, last=last)

    def clear(self) -> None:
        self._buckets.clear()
        self._block_to_bucket.clear()


class LFUBlockBackend(HashBlockBackend):
    """``hash_blocks`` with an LFU free queue.

    Invariants (besides :class:`HashBlockBackend`'s): ``_hits[b]`` counts the ``acquire`` calls on
    block ``b`` since ``allocate`` last handed it out, capped at ``frequency_cap``. Along a cached
    prefix the counts never increase (a hit on block ``i`` is a hit on every block before it), and
    a request's blocks are released tail first, so a prefix is still evicted from its tail.
    """

    name = "lfu_blocks"

    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_fraction: float = 0.2,
                 record_events: bool = True, frequency_cap: int = 16):
        if not isinstance(frequency_cap, int) or isinstance(frequency_cap, bool) or frequency_cap < 1:
            raise ValueError(f"frequency_cap must be an int >= 1, got {frequency_cap!r}; set "
                             "cache.backend_options.frequency_cap (e.g. 16)")
        super().__init__(num_blocks, block_size, max_pinned_fraction=max_pinned_fraction,
                         record_events=record_events)
        self.frequency_cap = frequency_cap
        self._hits = [0] * num_blocks
        # NOTE: the parent's code reads and writes ``self._lru`` directly; replacing the object
        # is the whole change, and nothing of the parent is copied.
        self._lru = FrequencyQueue(self._hits, frequency_cap)

    def acquire(self, block_ids: Sequence[int]) -> None:
        super().acquire(block_ids)  # validates and undoes itself on error
        hits, cap = self._hits, self.frequency_cap
        for b in block_ids:
            if hits[b] < cap:
                hits[b] += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        block_ids = super().allocate(num_blocks)
        for b in block_ids or ():
            self._hits[b] = 0  # new content: its history starts over
        return block_ids

    def hit_count(self, block_id: int) -> int:
        """Hits counted for ``block_id`` (capped at ``frequency_cap``)."""
        self._check_ids("block_id", [block_id])
        return self._hits[block_id]

    def reset(self) -> None:
        super().reset()
        self._hits[:] = [0] * self.num_blocks  # in place: the queue holds this very list


@hookimpl
def corekv_register_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="lfu_blocks",
        factory=LFUBlockBackend,
        options={
            "record_events": Option("bool", default=True,
                                    help="keep stored/removed BlockEvents for take_events()"),
            "frequency_cap": Option("int", default=16, minimum=1,
                                    help="hits counted per block at most; beyond it, LRU decides"),
        },
        description="hash_blocks with least-frequently-used eviction (LRU among equals)",
    )]
