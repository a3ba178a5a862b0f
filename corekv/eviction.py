"""Eviction policies: which cached entry goes first, asked by every structure that evicts.

A policy answers one question, :meth:`EvictionPolicy.key`: candidates are evicted smallest key
first. The entry it is asked about is what the structure keeps per cached item, read through four
attributes (:class:`EntryStats` has them, and so does the radix tree's node):

- ``last_access``: logical time of the last use (larger is more recent);
- ``num_hits``: uses since it was stored;
- ``priority``: the highest priority of a request that stored or hit it (``PrefixKey.priority``,
  0 by default); a tier sees no requests and keeps the highest priority its entry was written
  with (the backend's, carried by ``EvictedBlock`` and ``Tier.put``'s ``priorities``);
- ``created``: logical time it was stored.

Who asks:

- the radix tree sorts its evictable leaves by ``key(node)`` when it evicts (leaves only, so the
  policy never breaks the tree's invariants);
- structures with a queue of candidates (``hash_blocks``' free queue, the ``host`` tier) ask the
  policy for one (:meth:`EvictionPolicy.make_queue`): by default a binary heap with lazy deletion
  (:class:`HeapQueue`, O(log n) per change); LRU's is an ordered dict (:class:`LRUQueue`, O(1)),
  the queue these structures had before eviction was a seam, so the default behaves exactly as
  before;
- persistent tiers (``lmdb``, ``shm``) keep the fields in their store (the ``access`` and
  ``stats`` records) and sort by ``key`` when they evict.

Builtin policies (``lru``, ``lfu``, ``priority``) are registered by :mod:`corekv.plugins.eviction`
through ``corekv_register_eviction_policies``, as a third-party policy is; a structure built with
no policy uses :class:`LRU`.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from operator import attrgetter
from typing import Any

__all__ = ["EntryStats", "EvictionPolicy", "EvictionQueue", "HeapQueue", "LFU", "LRU", "LRUQueue",
           "Priority", "make_policy", "resolve_policy_options"]


class EntryStats:
    """What a queue or a store remembers about one cached item (the attributes a policy reads)."""

    __slots__ = ("last_access", "num_hits", "priority", "created", "version", "is_candidate")

    def __init__(self, last_access: int = 0, num_hits: int = 0, priority: int = 0, created: int = 0):
        self.last_access = last_access
        self.num_hits = num_hits
        self.priority = priority
        self.created = created
        self.version = 0
        self.is_candidate = False

    def __repr__(self) -> str:
        return (f"EntryStats(last_access={self.last_access}, num_hits={self.num_hits}, "
                f"priority={self.priority}, created={self.created})")


class EvictionPolicy(ABC):
    """Orders eviction candidates: the one with the smallest :meth:`key` goes first.

    A policy object serves one structure (the plugin's factory makes a fresh one for each), so a
    policy may keep state of its own. Ties are broken by the structure (creation order in the
    radix tree, order of becoming a candidate in queues), never by comparing items.
    """

    #: the name it is registered under (``eviction:`` in the config)
    name: str = ""

    @abstractmethod
    def key(self, entry: Any) -> Any:
        """A sortable key for ``entry`` (an :class:`EntryStats` or a radix node); smallest first."""

    def make_queue(self) -> EvictionQueue:
        """A queue of candidates in this policy's order (a :class:`HeapQueue` unless overridden)."""
        return HeapQueue(self)

    def ranked(self, nodes: Iterable[Any]) -> list[tuple]:
        """``(key(node), node.serial, node)`` for each radix node, for the tree's eviction heap
        (``serial``: creation order, the tie-break).

        NOTE: override only for speed, with the same order: the tree builds this list over every
        evictable leaf each time it evicts, and for a key that is one attribute a comprehension
        reading it runs about twice as fast as a call per node (LRU's does).
        """
        key = self.key
        return [(key(n), n.serial, n) for n in nodes]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EvictionQueue(ABC):
    """Stored items and, among them, the eviction candidates, popped in the policy's order.

    Verbs, as a structure's events map onto them: ``store_many`` (items were cached by a request
    of some priority; re-storing raises the priority), ``add`` (an item becomes a candidate, as
    a use), ``take`` (a candidate stops being one because it is used), ``remove`` (it stops being
    one without a use), ``touch`` (a use of a stored item; a candidate keeps its place in the
    queue only if the policy's key did not change), ``pop_many`` (evict: the first ``n``
    candidates, forgotten), ``unpop_many`` (undo the last ``pop_many``), ``discard`` (forget an
    item), ``clear``.

    Invariant: ``len(queue)`` is the number of candidates; every candidate was stored or added.
    """

    #: whether ``store_many`` keeps anything (a structure may skip collecting what it would pass)
    tracks_stores = True

    @abstractmethod
    def store_many(self, items: Iterable[Hashable], priority: int = 0) -> None: ...

    @abstractmethod
    def add(self, item: Hashable) -> None: ...

    @abstractmethod
    def take(self, item: Hashable) -> None: ...

    @abstractmethod
    def remove(self, item: Hashable) -> None: ...

    @abstractmethod
    def touch(self, item: Hashable) -> None: ...

    @abstractmethod
    def pop_many(self, n: int) -> list: ...

    @abstractmethod
    def unpop_many(self, items: list) -> None: ...

    @abstractmethod
    def discard(self, item: Hashable) -> None: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, item: object) -> bool: ...

    def pop(self) -> Hashable:
        """The first candidate, forgotten."""
        return self.pop_many(1)[0]


class LRUQueue(OrderedDict, EvictionQueue):
    """Candidates as the keys of an ordered dict, least recently used first: O(1) for every verb.

    NOTE: the queue *is* the ordered dict, and the verbs a hot path calls per block are its own C
    methods (``add`` is ``setdefault``, ``take`` and ``remove`` are ``__delitem__``, and ``len``
    and ``in`` are the dict's), so LRU costs what the plain ordered dict cost before eviction
    became a seam. LRU keeps nothing about items that are not candidates: ``store_many`` does
    nothing. ``pop`` is the queue's (the first candidate), not the dict's.
    """

    tracks_stores = False
    add = OrderedDict.setdefault
    take = remove = OrderedDict.__delitem__
    __len__ = OrderedDict.__len__
    __contains__ = OrderedDict.__contains__

    def store_many(self, items, priority=0):
        pass

    def touch(self, item):
        if item in self:
            self.move_to_end(item)

    def pop(self):
        return self.popitem(last=False)[0]

    def pop_many(self, n):
        popitem = self.popitem
        return [popitem(last=False)[0] for _ in range(n)]

    def unpop_many(self, items):
        for item in reversed(items):
            self[item] = None
            self.move_to_end(item, last=False)

    def discard(self, item):
        OrderedDict.pop(self, item, None)

    clear = OrderedDict.clear


class HeapQueue(EvictionQueue):
    """Candidates in a binary heap keyed by ``policy.key(stats)``, with lazy deletion.

    Invariants: ``_records`` holds the :class:`EntryStats` of every stored item; a heap entry
    ``(key, seq, item, stats, version)`` is live iff ``_records[item] is stats``, ``stats`` is a
    candidate and ``stats.version == version``; every candidate has exactly one live entry; stale
    entries are dropped when popped, and the heap is rebuilt when they outnumber live ones.
    """

    def __init__(self, policy: EvictionPolicy):
        self._key = policy.key
        self._records: dict[Hashable, EntryStats] = {}
        self._heap: list = []
        self._clock = 0
        self._seq = itertools.count()
        self._num_candidates = 0
        self._popped: dict[Hashable, EntryStats] = {}

    def store_many(self, items, priority=0):
        # NOTE: items stored by one call are one age (a request's blocks, cached together): a
        # policy keyed on ``created`` then breaks the tie by release order, tail first, so a
        # hash-block prefix still loses its last block before its first.
        records = self._records
        self._clock += 1
        now = self._clock
        for item in items:
            stats = records.get(item)
            if stats is None:
                records[item] = EntryStats(now, 0, priority, now)
            elif priority > stats.priority:
                stats.priority = priority
                if stats.is_candidate:
                    self._push(item, stats)

    def add(self, item):
        stats = self._records.get(item)
        self._clock += 1
        if stats is None:
            stats = self._records[item] = EntryStats(self._clock, 0, 0, self._clock)
        elif stats.is_candidate:
            raise ValueError(f"{item!r} is already an eviction candidate; this indicates a bug in "
                             "the structure that owns the queue")
        stats.last_access = self._clock
        stats.is_candidate = True
        self._num_candidates += 1
        self._push(item, stats)

    def take(self, item):
        stats = self._records[item]
        self.remove(item)
        self._clock += 1
        stats.last_access = self._clock
        stats.num_hits += 1

    def remove(self, item):
        stats = self._records[item]
        if not stats.is_candidate:
            raise KeyError(item)
        stats.is_candidate = False
        stats.version += 1
        self._num_candidates -= 1

    def touch(self, item):
        stats = self._records.get(item)
        if stats is None:
            return
        self._clock += 1
        stats.last_access = self._clock
        stats.num_hits += 1
        if stats.is_candidate:
            self._push(item, stats)

    def pop_many(self, n):
        if n > self._num_candidates:
            raise IndexError(f"pop_many({n}) with {self._num_candidates} candidates")
        heap, records, popped = self._heap, self._records, self._popped
        popped.clear()
        victims = []
        while len(victims) < n:
            _, _, item, stats, version = heapq.heappop(heap)
            if records.get(item) is stats and stats.is_candidate and stats.version == version:
                del records[item]
                stats.is_candidate = False
                popped[item] = stats
                victims.append(item)
        self._num_candidates -= n
        return victims

    def unpop_many(self, items):
        for item in items:
            stats = self._popped.pop(item)
            self._records[item] = stats
            stats.is_candidate = True
            self._num_candidates += 1
            self._push(item, stats)

    def discard(self, item):
        stats = self._records.pop(item, None)
        if stats is not None and stats.is_candidate:
            stats.is_candidate = False
            self._num_candidates -= 1

    def clear(self):
        self._records.clear()
        self._heap.clear()
        self._popped.clear()
        self._num_candidates = 0

    def __len__(self):
        return self._num_candidates

    def __contains__(self, item):
        stats = self._records.get(item)
        return stats is not None and stats.is_candidate

    def stats_of(self, item: Hashable) -> EntryStats | None:
        """What the queue remembers about ``item`` (``None``: not stored)."""
        return self._records.get(item)

    def _push(self, item, stats: EntryStats) -> None:
        stats.version += 1
        heap = self._heap
        heapq.heappush(heap, (self._key(stats), next(self._seq), item, stats, stats.version))
        if len(heap) > 2 * self._num_candidates + 64:
            # NOTE: every touch of a candidate leaves a stale entry behind; rebuilding once they
            # outnumber the live ones keeps the heap O(candidates) at O(1) amortised per push.
            heap[:] = [e for e in heap if self._records.get(e[2]) is e[3] and e[3].is_candidate
                       and e[3].version == e[4]]
            heapq.heapify(heap)


# -------------------------------------------------------------------------------------------
# Builtin policies (registered by corekv.plugins.eviction)
# -------------------------------------------------------------------------------------------
class LRU(EvictionPolicy):
    """Least recently used first: the order every structure had before policies were a seam."""

    name = "lru"
    key = staticmethod(attrgetter("last_access"))

    def make_queue(self) -> EvictionQueue:
        return LRUQueue()

    def ranked(self, nodes):
        return [(n.last_access, n.serial, n) for n in nodes]


class LFU(EvictionPolicy):
    """Least frequently used first (fewest hits since stored), ties least recently used first."""

    name = "lfu"
    key = staticmethod(attrgetter("num_hits", "last_access"))


class Priority(EvictionPolicy):
    """Lowest priority first, ties least recently used first. An entry's priority is the highest
    of the requests that stored or hit it (``PrefixKey.priority``); in a tier below the device,
    the highest its block was written with (the backend's priority of the block when it was
    offloaded). Where no request carries one, every entry is 0 and this is LRU."""

    name = "priority"
    key = staticmethod(attrgetter("priority", "last_access"))


def make_policy(policy: str | EvictionPolicy | None, plugin_manager: Any = None) -> EvictionPolicy:
    """The policy a structure's ``eviction`` argument names: an :class:`EvictionPolicy` as is,
    ``None`` the default :class:`LRU`, a name a fresh policy of that registered name.

    :param plugin_manager: where names are looked up; by default one built with the entry points
        (so a policy listed only in a config's ``plugins:`` needs the engine's manager).
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy is None:
        return LRU()
    if not isinstance(policy, str):
        raise TypeError(f"eviction must be a policy name or an EvictionPolicy, got {policy!r}")
    if plugin_manager is None:
        from corekv.plugin import make_plugin_manager
        plugin_manager = make_plugin_manager()
    specs = plugin_manager.eviction_policies()
    if policy not in specs:
        if not specs:  # NOTE: corekv's own policies come from its entry points, like a plugin's
            raise ValueError(f"eviction {policy!r}: no eviction policy is registered, not even "
                             "corekv's own (lru, lfu, priority); the installed corekv's entry points "
                             "are older than its code: reinstall it (pip install -e . in a checkout)")
        raise ValueError(f"eviction {policy!r} is not a registered eviction policy; expected one of "
                         f"{', '.join(sorted(specs))} (install or list the plugin that provides it)")
    made = specs[policy].factory()
    if not isinstance(made, EvictionPolicy):
        from corekv.errors import PluginError
        raise PluginError(f"eviction policy {policy!r} (plugin {specs[policy].plugin!r}) factory "
                          f"returned {type(made).__name__}, expected a corekv.eviction.EvictionPolicy")
    return made


def resolve_policy_options(schema: Mapping[str, Any], options: Mapping[str, Any],
                           plugin_manager: Any) -> dict[str, Any]:
    """``options`` with the value of every option of kind ``eviction`` turned from a name into a
    fresh policy from ``plugin_manager`` (a backend or tier factory then needs no manager)."""
    resolved = dict(options)
    for name, option in schema.items():
        if option.kind == "eviction" and isinstance(resolved.get(name), str):
            resolved[name] = make_policy(resolved[name], plugin_manager)
    return resolved
