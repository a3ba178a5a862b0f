"""``hash_blocks``: the vLLM-style prefix cache, a hash -> block map over a free queue.

Only full blocks are cached, each under the chained hash of its whole prefix
(:mod:`corekv.hashing`), so one dict lookup per block finds the longest cached prefix. A block whose
last reference goes keeps its content and hash and waits in the free queue, where it can still be
hit; only when ``allocate`` takes it for new content is its hash dropped (and offered to
``on_evict`` for write-back first). Which cached-idle block ``allocate`` takes first is the
eviction policy's answer (:mod:`corekv.eviction`; LRU by default).
"""
from __future__ import annotations

from collections.abc import Sequence

from corekv.backend import BlockEvent, EvictedBlock, PrefixCacheBackend, check_count, stored_event
from corekv.eviction import EvictionPolicy, make_policy
from corekv.hashing import BlockHash, PrefixKey
from corekv.plugin import BackendSpec, Option, hookimpl
from corekv.plugins._pin_book import PinBook, _check_key


class HashBlockBackend(PrefixCacheBackend):
    """Chained-hash block cache with reference counts and a free queue in eviction order.

    Invariants:

    * ``_ref[b] >= 0``; with ``_ref[b] == 0`` a block is in exactly one of ``_empty`` (no hash)
      and ``_idle`` (cached-idle, the candidates of the eviction queue); together they are the
      free queue, ``_empty`` first;
    * ``_block_hash[b] == h`` iff ``_hash_to_block[h] == b`` (a hash maps to at most one block; a
      block holding a duplicate of a cached prefix has no hash and is private to its owner);
    * the free queue is in eviction order: uncached blocks first (reused before any cached one),
      then cached-idle blocks in the order of the ``eviction`` policy: with LRU from least to most
      recently released; a request's blocks are released tail first, so with LRU (and with LFU
      and priority, whose counts never grow along a prefix) a prefix's last block is evicted
      before its first;
    * pinned blocks hold an extra reference (:class:`~corekv.plugins._pin_book.PinBook`), so they
      never reach the free queue.
    """

    name = "hash_blocks"

    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_fraction: float = 0.2,
                 record_events: bool = True, eviction: str | EvictionPolicy | None = None):
        super().__init__(num_blocks, block_size, max_pinned_fraction=max_pinned_fraction)
        if not isinstance(record_events, bool):
            raise TypeError(f"record_events must be True or False, got {record_events!r}")
        self.record_events = record_events
        self._ref = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        #: per cached block, its eviction priority for the tiers (:meth:`block_priority`); 0 for
        #: the others
        self._priority = [0] * num_blocks
        # NOTE: LRU's queue is an OrderedDict keyed by block id, not an intrusive linked list: it
        # gives the same O(1) pop-from-head, append and removal from the middle (a hit touched out
        # of the queue), but every step runs in C, whereas a Python-level list costs several
        # attribute writes and a node object per block. Uncached free blocks (the queue's head in
        # vLLM) sit in a plain stack: they are never touched out, so they need no O(1) removal.
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self.eviction = make_policy(eviction)
        self._idle = self.eviction.make_queue()
        self._events: list[BlockEvent] = []
        self._pins = PinBook(self.max_pinned_blocks)
        self.num_evicted_blocks = 0

    # -- lookup ------------------------------------------------------------------------------
    def match(self, key: PrefixKey, max_blocks: int | None = None) -> list[int]:
        if key.__class__ is not PrefixKey or key.block_size != self.block_size:
            _check_key(key, self)
        hashes = key.block_hashes
        if max_blocks is not None:
            if max_blocks.__class__ is not int or max_blocks < 0:
                check_count("max_blocks", max_blocks)
            hashes = hashes[:max_blocks]
        # NOTE: one C-level pass (map + index) instead of a Python loop per block.
        block_ids = list(map(self._hash_to_block.get, hashes))
        if None in block_ids:
            del block_ids[block_ids.index(None):]
        return block_ids

    # -- ownership ---------------------------------------------------------------------------
    def acquire(self, block_ids: Sequence[int]) -> None:
        # NOTE: checks inlined (min/max run in C); the per-request verbs are the hot path.
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            self._check_ids("block_ids", block_ids)
        ref, block_hash = self._ref, self._block_hash
        take, touch = self._idle.take, self._idle.touch
        for i, b in enumerate(block_ids):
            r = ref[b]
            if r == 0:
                if block_hash[b] is None:
                    self.free(block_ids[:i])
                    raise ValueError(f"block {b} in block_ids is free (neither cached nor in use); "
                                     "acquire only blocks returned by match()")
                take(b)
            elif block_hash[b] is not None:
                touch(b)   # a hit on a block another request holds still counts as a use
            ref[b] = r + 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        check_count("num_blocks", num_blocks)
        empty, idle, ref = self._empty, self._idle, self._ref
        num_reused = num_blocks - len(empty)
        if num_reused > len(idle):
            return None
        if num_reused <= 0:
            block_ids = empty[len(empty) - num_blocks:]
            del empty[len(empty) - num_blocks:]
            for b in block_ids:
                ref[b] = 1
            return block_ids
        block_ids = empty[:]
        empty.clear()
        block_hash, hash_to_block, priority = self._block_hash, self._hash_to_block, self._priority
        evicted: list[EvictedBlock] = []
        for b in idle.pop_many(num_reused):
            h = block_hash[b]
            del hash_to_block[h]
            block_hash[b] = None
            evicted.append(EvictedBlock(h, b, priority[b]))
            priority[b] = 0
            block_ids.append(b)
        for b in block_ids:
            ref[b] = 1
        self._report_evicted(block_ids, evicted)
        return block_ids

    def cache(self, key: PrefixKey, block_ids: Sequence[int]) -> None:
        if key.__class__ is not PrefixKey or key.block_size != self.block_size:
            _check_key(key, self)
        hashes = key.block_hashes
        if len(block_ids) > len(hashes):
            raise ValueError(f"block_ids has {len(block_ids)} blocks but key has only {len(hashes)} "
                             "full blocks; pass the block ids of full blocks only")
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            self._check_ids("block_ids", block_ids)
        ref, block_hash, hash_to_block = self._ref, self._block_hash, self._hash_to_block
        stored = []   # indexes into the key's blocks
        for i, (b, h) in enumerate(zip(block_ids, hashes)):
            current = block_hash[b]
            if current is not None:
                if current != h:
                    raise ValueError(f"block {b} already caches another prefix; a cached block "
                                     "cannot be cached again under a different key")
                continue
            if ref[b] == 0:
                raise ValueError(f"block {b} is not held by the caller; cache() takes blocks from "
                                 "allocate() or acquire() that are still referenced")
            if h in hash_to_block:  # the same prefix is cached in another block: stay private
                continue
            hash_to_block[h] = b
            block_hash[b] = h
            stored.append(i)
        if self._idle.tracks_stores:
            # NOTE: every block that caches this key's prefix, new or not, for a queue that keeps
            # per-block stats (LFU's hits, a priority); LRU's keeps none, so its loop above pays
            # nothing for them
            self._idle.store_many([b for b, h in zip(block_ids, hashes) if block_hash[b] == h],
                                  key.priority)
        if key.priority:   # NOTE: only then: requests of the default priority pay nothing
            self._raise_priority(block_ids, hashes, stored, key.priority)
        if stored and self.record_events:
            self._record_stored(key, stored)

    def free(self, block_ids: Sequence[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            self._check_ids("block_ids", block_ids)
        ref, empty, block_hash = self._ref, self._empty, self._block_hash
        add = self._idle.add
        released = block_ids[::-1]   # tail first
        for k, b in enumerate(released):
            r = ref[b] - 1
            if r < 0:   # not in use, or listed more often than it is referenced
                self._undo_free(released[:k])
                raise ValueError(f"block {b} is listed in block_ids more often than it is "
                                 "referenced (a block not in use has no reference); free each "
                                 "block once per allocate()/acquire()")
            ref[b] = r
            if r == 0:
                if block_hash[b] is None:
                    empty.append(b)
                else:
                    add(b)

    # -- pinning -----------------------------------------------------------------------------
    def pin(self, key: PrefixKey) -> int:
        return self._pins.pin(self, key)

    def unpin(self, key: PrefixKey) -> int:
        return self._pins.unpin(self, key)

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._idle)

    @property
    def num_empty_blocks(self) -> int:
        return len(self._empty)

    @property
    def num_pinned_blocks(self) -> int:
        return self._pins.num_pinned_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_ids("block_id", [block_id])
        return self._block_hash[block_id]

    def block_priority(self, block_id: int) -> int:
        self._check_ids("block_id", [block_id])
        return self._priority[block_id]

    def ref_count(self, block_id: int) -> int:
        """References held on ``block_id`` (requests and pins)."""
        self._check_ids("block_id", [block_id])
        return self._ref[block_id]

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        if self.num_free_blocks != self.num_blocks:
            raise RuntimeError(f"reset() needs every block released, but "
                               f"{self.num_blocks - self.num_free_blocks} are in use (pinned ones "
                               "included); free them and unpin first")
        if self.record_events:
            self._events.append(BlockEvent("removed", tuple(self._hash_to_block), is_cleared=True))
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks
        self._priority = [0] * self.num_blocks
        self._empty = list(range(self.num_blocks - 1, -1, -1))
        self._idle.clear()
        self._pins.clear()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_cached_blocks": self.num_cached_blocks,
                "num_evicted_blocks": self.num_evicted_blocks}

    # -- helpers -----------------------------------------------------------------------------
    def _report_evicted(self, block_ids: list[int], evicted: list[EvictedBlock]) -> None:
        if self.on_evict is not None:
            try:
                self.on_evict(evicted)
            except BaseException:
                # NOTE: undo the allocation so a failing write-back leaves the cache as it was.
                for b in block_ids:
                    self._ref[b] = 0
                for e in evicted:
                    self._block_hash[e.block_id] = e.block_hash
                    self._hash_to_block[e.block_hash] = e.block_id
                    self._priority[e.block_id] = e.priority
                self._idle.unpop_many([e.block_id for e in evicted])
                self._empty.extend(block_ids[:len(block_ids) - len(evicted)])
                raise
        self.num_evicted_blocks += len(evicted)
        if self.record_events:
            self._events.append(BlockEvent("removed", tuple(e.block_hash for e in evicted)))

    def _raise_priority(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], stored: list[int],
                        priority: int) -> None:
        """The blocks that cache ``hashes`` take ``priority``: newly ``stored`` ones (indexes)
        as theirs, the others if it is higher (a block's priority is the highest of the
        requests that cached or hit it, the rule of the eviction queue's ``store_many``)."""
        prio, block_hash = self._priority, self._block_hash
        for i in stored:
            prio[block_ids[i]] = priority
        for b, h in zip(block_ids, hashes):
            if block_hash[b] == h and priority > prio[b]:
                prio[b] = priority

    def _record_stored(self, key: PrefixKey, stored: list[int]) -> None:
        """One ``"stored"`` event per contiguous run of ``stored`` (block indexes of ``key``):
        blocks already cached in the middle split the run, and the next run's parent is one of
        them."""
        start = prev = stored[0]
        for i in stored[1:]:
            if i != prev + 1:
                self._events.append(stored_event(key, start, prev + 1))
                start = i
            prev = i
        self._events.append(stored_event(key, start, prev + 1))

    def _undo_free(self, released: Sequence[int]) -> None:
        for b in reversed(released):
            if self._ref[b] == 0:
                if self._block_hash[b] is None:
                    self._empty.remove(b)
                else:
                    self._idle.remove(b)
            self._ref[b] += 1

    def _check_ids(self, name: str, block_ids: Sequence[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            bad = next(b for b in block_ids if not 0 <= b < self.num_blocks)
            raise ValueError(f"{name} contains block id {bad}, expected ids in "
                             f"[0, {self.num_blocks}); pass ids this backend handed out")


@hookimpl
def corekv_register_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="hash_blocks",
        factory=HashBlockBackend,
        options={
            "record_events": Option(
                "bool", default=True,
                help="keep stored/removed BlockEvents for take_events() (KV-event publishers)"),
            "eviction": Option("eviction", default="lru", help=(
                "which cached-idle block the free queue hands out first: lru, lfu, priority or a "
                "plugin's policy")),
        },
        description="vLLM-style chained-hash blocks; the free queue is in eviction order (LRU)",
    )]
