"""``lru``, ``lfu``, ``priority``: corekv's eviction policies, registered like a third party's.

The policies themselves live in :mod:`corekv.eviction` beside the interface (the structures fall
back to LRU without a plugin manager); this module only makes them selectable by name::

    cache:
      backend_options: {eviction: lfu}
      tiers:
        - {type: host, size: 2GiB, eviction: lfu}
"""
from __future__ import annotations

from corekv.eviction import LFU, LRU, Priority
from corekv.plugin import EvictionPolicySpec, hookimpl


@hookimpl
def corekv_register_eviction_policies() -> list[EvictionPolicySpec]:
    return [
        EvictionPolicySpec(name="lru", factory=LRU, description=(
            "least recently used first (the default): recency is what agent loops and chats reuse")),
        EvictionPolicySpec(name="lfu", factory=LFU, description=(
            "least frequently used first, ties LRU: keeps a few hot prefixes among many one-off ones")),
        EvictionPolicySpec(name="priority", factory=Priority, description=(
            "lowest request priority first, ties LRU: keeps what high-priority requests used")),
    ]
