"""``lfu_blocks``: corekv's ``hash_blocks`` backend with a capped least-*frequently*-used eviction.

Everything but the eviction order is the builtin backend's: this module subclasses
:class:`corekv.plugins.hash_blocks.HashBlockBackend` and hands it an eviction policy,
:class:`CappedLFU`, through the backend's ``eviction`` argument (the seam every builtin backend
and tier takes, :mod:`corekv.eviction`): the block with the fewest hits goes first, and among
equals the one released longest ago (so plain LRU is the tie-break).

Why LFU for a prefix cache: a system prompt shared by most requests is hit far more often than a
one-off document, but under LRU a burst of one-off requests pushes it out. With LFU it survives
the burst. The cost is that a once-hot prefix lingers; ``frequency_cap`` bounds how much history
counts, so it falls back to recency among the blocks at the cap. (corekv's own ``lfu`` policy,
``backend_options: {eviction: lfu}``, is this without a cap.)
"""
from __future__ import annotations

from corekv.eviction import EvictionPolicy
from corekv.plugin import BackendSpec, Option, hookimpl
from corekv.plugins.hash_blocks import HashBlockBackend


class CappedLFU(EvictionPolicy):
    """Fewest hits first, counting at most ``frequency_cap`` of them; then least recently used."""

    name = "lfu_capped"

    def __init__(self, frequency_cap: int):
        self.frequency_cap = frequency_cap

    def key(self, entry):
        return min(entry.num_hits, self.frequency_cap), entry.last_access


class LFUBlockBackend(HashBlockBackend):
    """``hash_blocks`` whose free queue is ordered by :class:`CappedLFU`.

    Invariants (besides :class:`HashBlockBackend`'s): a block's hits are the ``acquire`` calls on
    it since it was cached, forgotten when ``allocate`` hands it out for new content. Along a
    cached prefix the counts never increase (a hit on block ``i`` is a hit on every block before
    it), and a request's blocks are released tail first, so a prefix is still evicted from its tail.
    """

    name = "lfu_blocks"

    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_fraction: float = 0.2,
                 record_events: bool = True, frequency_cap: int = 16):
        if not isinstance(frequency_cap, int) or isinstance(frequency_cap, bool) or frequency_cap < 1:
            raise ValueError(f"frequency_cap must be an int >= 1, got {frequency_cap!r}; set "
                             "cache.backend_options.frequency_cap (e.g. 16)")
        super().__init__(num_blocks, block_size, max_pinned_fraction=max_pinned_fraction,
                         record_events=record_events, eviction=CappedLFU(frequency_cap))
        self.frequency_cap = frequency_cap

    def hit_count(self, block_id: int) -> int:
        """Hits counted for ``block_id`` (capped at ``frequency_cap``)."""
        self._check_ids("block_id", [block_id])
        stats = self._idle.stats_of(block_id)
        return 0 if stats is None else min(stats.num_hits, self.frequency_cap)


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
