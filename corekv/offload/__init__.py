"""Everything between the device KV pool and the storage tiers, behind one facade (:class:`Offload`).

Where an evicted block goes, and how it comes back — the life of one block:

1. **Computed and cached.** The engine fills a block's ``block_size`` tokens of KV and the prefix-cache
   backend caches it under its chained hash (``BlockManager.cache_full_blocks`` calls
   :meth:`Offload.cached`). With ``write_through`` it is copied out now, as in step 2.
2. **Evicted, offloaded.** When the backend reuses the block's slot it calls
   :meth:`Offload.evicted` first (wired at construction). With ``write_back`` (the default) the
   block's bytes are copied out of the pool on the step's thread (:mod:`~corekv.offload.pool_io`)
   and queued; the writer thread (:mod:`~corekv.offload.writer`) encodes each block as an entry
   bound to its hash (:mod:`corekv.block_format`) and puts it to every tier that lacks it, one
   membership call per batch. A full queue skips the block (counted): generation never waits.
3. **Matched.** A request arrives (:meth:`Offload.arrived`): its prompt's chain continues past the
   device match down the tiers in order (:mod:`~corekv.offload.reload`), and a background job
   reads the hits' validated bytes into host staging (:mod:`~corekv.offload.prefetch`).
4. **Reloaded.** At admission (:meth:`Offload.load`) the staged rows are copied into the fresh
   pool blocks in one batch and whatever was not staged is read synchronously; an entry that
   fails its checks is a miss, deleted, and that block and the rest are recomputed. The engine
   then caches the reloaded blocks like computed ones, so step 1 applies again. How many of the
   hits are worth loading rather than recomputing (and ``cache.max_load_tokens``) is the reload
   cost model's call (:mod:`~corekv.offload.cost`), from the tier reads and steps it timed,
   seeded under ``reload_policy: cost`` by a few reads of a probe entry when each tier opens
   (:mod:`~corekv.offload.measure`, :meth:`Offload.measure_tiers`).

Swap preemption parks a preempted sequence's blocks in the host tier (:mod:`~corekv.offload.swap`,
:meth:`Offload.park` / :meth:`Offload.unpark`); :func:`make_offload` builds it all from
``cache.tiers`` (:mod:`~corekv.offload.build`), or, without tiers, a :class:`NullOffload` whose
verbs do nothing (so callers never ask whether there are tiers). The engine's ``BlockManager``
and the vLLM connector call the facade only.
"""
from __future__ import annotations

from corekv.offload.build import fingerprint_bytes, make_offload, make_tiers
from corekv.offload.facade import Offload
from corekv.offload.null import NullOffload
from corekv.offload.prefetch import TierRun
from corekv.offload.reload import lookup_runs
from corekv.offload.swap import Parked

__all__ = ["NullOffload", "Offload", "Parked", "TierRun", "fingerprint_bytes", "lookup_runs", "make_offload", "make_tiers"]
