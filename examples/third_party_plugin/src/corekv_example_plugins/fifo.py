"""Eviction policy ``fifo``: the oldest cached entry goes first, however often it is hit.

A third-party eviction policy is one method, ``key(entry)`` (smallest first), registered through
``corekv_register_eviction_policies``. Every structure that evicts through a policy takes it:
``radix`` and ``hash_blocks`` (``cache.backend_options.eviction``), the ``host``, ``lmdb`` and
``shm`` tiers (``cache.tiers[i].eviction``)::

    cache:
      backend_options: {eviction: fifo}
      tiers:
        - {type: host, size: 2GiB, eviction: fifo}

FIFO suits a cache whose entries age out together (a batch job's documents): it never reorders,
so each use costs nothing, and a burst of hits cannot keep a stale entry alive.
"""
from __future__ import annotations

from corekv.eviction import EvictionPolicy
from corekv.plugin import EvictionPolicySpec, hookimpl


class FIFO(EvictionPolicy):
    """First in, first out: ordered by when an entry was stored (``created``)."""

    name = "fifo"

    def key(self, entry):
        return entry.created


@hookimpl
def corekv_register_eviction_policies() -> list[EvictionPolicySpec]:
    return [EvictionPolicySpec(name="fifo", factory=FIFO,
                               description="first in, first out: the oldest stored entry goes first")]
