"""``radix``: the SGLang-style prefix cache, a compressed radix tree over pages of tokens.

Each namespace (``PrefixKey.namespace``: model, block size, salt, extra keys) has its own root, so
tenants never share a node. An edge holds whole pages of ``block_size`` tokens (1 = token
granularity) and the device block id of each page. A lookup walks down comparing whole edges with
one C-level slice comparison each; only a partially matching edge is binary-searched, page by page.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from corekv.backend import BlockEvent, EvictCallback, EvictedBlock, PrefixCacheBackend
from corekv.hashing import BlockHash, PrefixKey
from corekv.plugin import BackendSpec, Option, hookimpl
from corekv.plugins._pinning import PinBook, _check_key


class _Node:
    __slots__ = ("key", "value", "hashes", "children", "parent", "ref", "lock_ref",
                 "last_access", "serial")

    def __init__(self, key, value, hashes, parent, serial):
        self.key = key          # tokens of the edge into this node (a root: its namespace)
        self.value = value      # one device block id per page of ``key``
        self.hashes = hashes    # one chained hash per page, or None when hashes are not tracked
        self.children: dict = {}
        self.parent = parent    # None for a root and for an evicted (dead) node
        self.ref = 0            # references held on *each* block of this node
        self.lock_ref = 0       # sum of ``ref`` over this node's subtree
        self.last_access = 0
        self.serial = serial    # creation order: a deterministic tie-break for the LRU heap


class RadixBackend(PrefixCacheBackend):
    """Radix-tree index of the device pool; block references map onto node lock refs.

    Invariants:

    * every block is exactly one of: free (in ``_free``), private (in ``_private`` with its
      reference count: allocated, not cached), or cached (on exactly one live node's ``value``;
      ``_owner[b]`` is that node — ``_owner`` may keep stale entries for blocks that are not cached,
      they point to dead nodes);
    * all blocks of a node carry the same reference count ``node.ref`` — acquire/free split a node
      at the ends of the run they touch — and ``node.lock_ref`` is the sum of ``ref`` over the
      node's subtree, kept from node to root, so ``lock_ref == 0`` means nothing below is in use;
    * ``lock_ref(parent) >= lock_ref(child)``; every cached block counts in exactly one of
      ``_num_evictable_blocks`` (its node's ``lock_ref == 0``) and ``_num_protected_blocks``;
    * ``_evictable_leaves`` holds exactly the non-root leaves with ``lock_ref == 0``; eviction
      removes whole least-recently-used ones, and a parent joins when its last child goes;
    * edges are whole pages; the child key is an edge's first token (page 1) or first page.
    """

    name = "radix"

    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_fraction: float = 0.2,
                 track_hashes: bool = True, record_events: bool = True):
        for opt, value in (("track_hashes", track_hashes), ("record_events", record_events)):
            if not isinstance(value, bool):
                raise TypeError(f"{opt} must be True or False, got {value!r}")
        if record_events and not track_hashes:
            raise ValueError("record_events=True needs track_hashes=True (events carry block "
                             "hashes); pass record_events=False or track_hashes=True")
        self.track_hashes = track_hashes
        super().__init__(num_blocks, block_size, max_pinned_fraction=max_pinned_fraction)
        self.record_events = record_events
        self.page = block_size
        # NOTE: the child-key function is chosen once here, not branched on per lookup.
        self._child_key = (lambda t, i: t[i]) if block_size == 1 else (
            lambda t, i, p=block_size: tuple(t[i:i + p]))
        self._pins = PinBook(self.max_pinned_blocks)
        self.num_evicted_blocks = 0
        self._init_state()

    def _init_state(self) -> None:
        self._roots: dict[bytes, _Node] = {}
        self._owner: dict[int, _Node] = {}
        self._private: dict[int, int] = {}
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._evictable_leaves: set[_Node] = set()
        self._num_evictable_blocks = 0
        self._num_protected_blocks = 0
        self._clock = 0
        self._serial = 0
        self._events: list[BlockEvent] = []

    @property
    def on_evict(self) -> EvictCallback | None:
        return self._on_evict

    @on_evict.setter
    def on_evict(self, callback: EvictCallback | None) -> None:
        if callback is not None and not self.track_hashes:
            raise ValueError("on_evict needs block hashes, but this radix backend was built with "
                             "track_hashes=False; build it with track_hashes=True")
        self._on_evict = callback

    # -- lookup ------------------------------------------------------------------------------
    def match(self, key: PrefixKey, max_blocks: int | None = None) -> list[int]:
        _check_key(key, self)
        tokens, page = key.token_ids, self.page
        num_pages = len(tokens) // page
        if max_blocks is not None:
            _check_count("max_blocks", max_blocks)
            num_pages = min(num_pages, max_blocks)
        limit = num_pages * page
        node = self._roots.get(key.namespace)
        block_ids: list[int] = []
        i = 0
        child_key = self._child_key
        while node is not None and i < limit:
            node = node.children.get(child_key(tokens, i))
            if node is None:
                break
            edge = node.key
            end = i + len(edge)
            if end <= limit and tokens[i:end] == edge:
                block_ids += node.value
                i = end
            else:
                block_ids += node.value[:self._common_pages(edge, tokens, i, limit)]
                break
        return block_ids

    # -- ownership ---------------------------------------------------------------------------
    def acquire(self, block_ids: Sequence[int]) -> None:
        segments = self._segments("block_ids", block_ids)
        now = self._tick()
        private = self._private
        for node, b in segments:
            if node is None:
                private[b] += 1
            else:
                node.ref += 1
                self._add_lock(node, 1, now)

    def allocate(self, num_blocks: int) -> list[int] | None:
        _check_count("num_blocks", num_blocks)
        free = self._free
        if num_blocks > len(free):
            if num_blocks > len(free) + self._num_evictable_blocks:
                return None
            self._evict(num_blocks - len(free))
        if num_blocks == 0:
            return []
        block_ids = free[-num_blocks:]
        del free[-num_blocks:]
        self._private.update(dict.fromkeys(block_ids, 1))
        return block_ids

    def cache(self, key: PrefixKey, block_ids: Sequence[int]) -> None:
        _check_key(key, self)
        if len(block_ids) > key.num_full_blocks:
            raise ValueError(f"block_ids has {len(block_ids)} blocks but key has only "
                             f"{key.num_full_blocks} full blocks; pass the ids of full blocks only")
        tokens, page, child_key = key.token_ids, self.page, self._child_key
        limit = len(block_ids) * page
        node = self._roots.get(key.namespace)
        if node is None:
            node = self._roots[key.namespace] = _Node(key.namespace, [], None, None, -1)
        now = self._tick()
        i = 0
        while i < limit:
            child = node.children.get(child_key(tokens, i))
            if child is None:
                break
            child.last_access = now
            edge = child.key
            end = i + len(edge)
            if end <= limit and tokens[i:end] == edge:
                node, i = child, end
                continue
            num_pages = self._common_pages(edge, tokens, i, limit)
            node, i = self._split(child, num_pages), i + num_pages * page
            break
        if i < limit:
            self._add_leaves(node, key, tokens[i:limit], list(block_ids[i // page:]), i // page, now)

    def free(self, block_ids: Sequence[int]) -> None:
        segments = self._segments("block_ids", block_ids)
        private, free = self._private, self._free
        for node, b in segments:
            if (private[b] if node is None else node.ref) == 0:
                raise ValueError(f"block {b} in block_ids is not in use (reference count 0); "
                                 "free each block once per allocate()/acquire()")
        now = self._clock
        for node, b in reversed(segments):
            if node is None:
                left = private[b] - 1
                if left:
                    private[b] = left
                else:
                    del private[b]
                    free.append(b)
            else:
                node.ref -= 1
                self._add_lock(node, -1, now)

    # -- pinning -----------------------------------------------------------------------------
    def pin(self, key: PrefixKey) -> int:
        return self._pins.pin(self, key)

    def unpin(self, key: PrefixKey) -> int:
        return self._pins.unpin(self, key)

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._num_evictable_blocks

    @property
    def num_pinned_blocks(self) -> int:
        return self._pins.num_pinned_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._num_evictable_blocks + self._num_protected_blocks

    @property
    def evictable_size(self) -> int:
        """Tokens cached in nodes no request or pin holds (SGLang's ``evictable_size``)."""
        return self._num_evictable_blocks * self.page

    @property
    def protected_size(self) -> int:
        """Tokens cached in nodes held, directly or through a descendant, by a reference."""
        return self._num_protected_blocks * self.page

    def block_hash(self, block_id: int) -> BlockHash | None:
        node = self._cached_node(block_id)
        if node is None or node.hashes is None:
            return None
        return node.hashes[node.value.index(block_id)]

    def ref_count(self, block_id: int) -> int:
        """References held on ``block_id`` (requests and pins)."""
        node = self._cached_node(block_id)
        return self._private.get(block_id, 0) if node is None else node.ref

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        if self._private or self._num_protected_blocks:
            raise RuntimeError(f"reset() needs every block released, but "
                               f"{len(self._private) + self._num_protected_blocks} are in use "
                               "(pinned ones included); free them and unpin first")
        removed = [h for n in set(self._owner.values()) if n.parent is not None and n.hashes
                   for h in n.hashes]
        events = self._events
        self._init_state()
        self._events = events
        if removed and self.record_events:
            self._events.append(BlockEvent("removed", tuple(removed)))
        self._pins.clear()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_cached_blocks": self.num_cached_blocks,
                "num_evicted_blocks": self.num_evicted_blocks,
                "evictable_size": self.evictable_size, "protected_size": self.protected_size}

    # -- helpers -----------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _common_pages(self, edge: list[int], tokens: list[int], i: int, limit: int) -> int:
        """Whole pages that ``edge`` shares with ``tokens[i:limit]`` (the first is known equal)."""
        page = self.page
        lo, hi = 1, min(len(edge), limit - i) // page
        # NOTE: binary search with C-level slice equality: O(log n) comparisons instead of a
        # Python loop per token on the one edge where a lookup diverges.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens[i:i + mid * page] == edge[:mid * page]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _cached_node(self, block_id: int) -> _Node | None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be an int in [0, {self.num_blocks}), got {block_id!r}")
        node = self._owner.get(block_id)
        return node if node is not None and node.parent is not None else None

    def _segments(self, name: str, block_ids: Sequence[int]) -> list[tuple[_Node | None, int]]:
        """Cut ``block_ids`` into private blocks ``(None, b)`` and whole cached nodes
        ``(node, first block)``, splitting nodes at the ends of the runs (refs stay uniform)."""
        ids = list(block_ids)
        n = len(ids)
        if n and (min(ids) < 0 or max(ids) >= self.num_blocks):
            bad = next(b for b in ids if not 0 <= b < self.num_blocks)
            raise ValueError(f"{name} contains block id {bad}, expected ids in "
                             f"[0, {self.num_blocks}); pass ids this backend handed out")
        private, owner = self._private, self._owner
        segments: list[tuple[_Node | None, int]] = []
        i = 0
        while i < n:
            b = ids[i]
            if b in private:
                segments.append((None, b))
                i += 1
                continue
            node = owner.get(b)
            if node is None or node.parent is None:
                raise ValueError(f"block {b} in {name} is free (neither cached nor in use); pass "
                                 "blocks from match(), allocate() or cache()")
            value = node.value
            offset = 0 if value[0] == b else value.index(b)
            run = min(len(value) - offset, n - i)
            if ids[i:i + run] != value[offset:offset + run]:
                lo, hi = 1, run - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if ids[i:i + mid] == value[offset:offset + mid]:
                        lo = mid
                    else:
                        hi = mid - 1
                run = lo
            if offset:
                self._split(node, offset)       # ``node`` keeps the part from ``b`` on
            if run < len(node.value):
                node = self._split(node, run)   # the returned prefix is exactly the run
            segments.append((node, b))
            i += run
        return segments

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node``'s edge after ``num_pages``; return the new upper node (``node`` keeps
        the lower part and its children)."""
        page, child_key, parent = self.page, self._child_key, node.parent
        self._serial += 1
        upper = _Node(node.key[:num_pages * page], node.value[:num_pages],
                      None if node.hashes is None else node.hashes[:num_pages], parent, self._serial)
        node.key, node.value = node.key[num_pages * page:], node.value[num_pages:]
        if node.hashes is not None:
            node.hashes = node.hashes[num_pages:]
        parent.children[child_key(upper.key, 0)] = upper
        upper.children[child_key(node.key, 0)] = node
        node.parent = upper
        upper.ref, upper.last_access = node.ref, node.last_access
        upper.lock_ref = node.lock_ref + node.ref
        if node.ref:  # the new node's references count in every ancestor's lock_ref
            ancestor = parent
            while ancestor.parent is not None:
                ancestor.lock_ref += node.ref
                ancestor = ancestor.parent
        # NOTE: dict.fromkeys + update re-points the upper part's blocks in one C-level pass.
        self._owner.update(dict.fromkeys(upper.value, upper))
        return upper

    def _add_lock(self, node: _Node, delta: int, now: int | None) -> None:
        """Add ``delta`` to ``lock_ref`` from ``node`` to its root, moving nodes between the
        evictable and protected counts as they cross zero."""
        leaves = self._evictable_leaves
        moved = 0
        while node.parent is not None:
            old = node.lock_ref
            node.lock_ref = new = old + delta
            if now is not None:
                node.last_access = now
            if old == 0:
                moved += len(node.value)
                if not node.children:
                    leaves.discard(node)
            elif new == 0:
                moved -= len(node.value)
                if not node.children:
                    leaves.add(node)
            node = node.parent
        self._num_evictable_blocks -= moved
        self._num_protected_blocks += moved

    def _add_leaves(self, parent: _Node, key: PrefixKey, tokens: list[int], block_ids: list[int],
                    first_page: int, now: int) -> None:
        private = self._private
        refs = list(map(private.get, block_ids))
        if None in refs:
            b = block_ids[refs.index(None)]
            raise ValueError(f"block {b} in block_ids is neither a hit of this key nor held "
                             "privately (it is free or caches another prefix); pass the "
                             "request's own blocks from match()/allocate()")
        hashes = None
        if self.track_hashes:
            hashes = key.block_hashes[first_page:first_page + len(block_ids)]
        for b in block_ids:
            del private[b]
        page, child_key, owner = self.page, self._child_key, self._owner
        num_ids = len(block_ids)
        is_uniform = refs.count(refs[0]) == num_ids
        start = 0
        while start < num_ids:
            # NOTE: a run of blocks held a different number of times (acquire() on allocated
            # blocks) gets a node of its own, keeping every node's references uniform.
            end = num_ids
            if not is_uniform:
                end = start + 1
                while end < num_ids and refs[end] == refs[start]:
                    end += 1
            self._serial += 1
            node = _Node(tokens[start * page:end * page], block_ids[start:end],
                         None if hashes is None else hashes[start:end], parent, self._serial)
            parent.children[child_key(node.key, 0)] = node
            self._evictable_leaves.discard(parent)
            self._evictable_leaves.add(node)
            self._num_evictable_blocks += end - start
            owner.update(dict.fromkeys(node.value, node))
            node.ref = refs[start]
            self._add_lock(node, node.ref, now)
            parent, start = node, end
        if hashes and self.record_events:
            self._events.append(BlockEvent("stored", tuple(hashes)))

    def _evict(self, num_blocks: int) -> None:
        """Evict least-recently-used unlocked leaves until ``num_blocks`` blocks are free."""
        heap = [(n.last_access, n.serial, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        victims: list[_Node] = []
        parent_to_gone: dict[_Node, int] = {}
        num_freed = 0
        # NOTE: choose every victim first, then offer them to on_evict, then unlink: a failing
        # write-back leaves the tree untouched.
        while num_freed < num_blocks:
            assert heap, "evictable block count out of sync with the tree; this indicates a bug in RadixBackend"
            node = heapq.heappop(heap)[2]
            victims.append(node)
            num_freed += len(node.value)
            parent = node.parent
            if parent.parent is not None and parent.lock_ref == 0:
                gone = parent_to_gone[parent] = parent_to_gone.get(parent, 0) + 1
                if gone == len(parent.children):
                    heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        if self._on_evict is not None:
            self._on_evict([EvictedBlock(h, b) for n in victims for h, b in zip(n.hashes, n.value)])
        child_key, free, leaves = self._child_key, self._free, self._evictable_leaves
        for node in victims:
            parent = node.parent
            del parent.children[child_key(node.key, 0)]
            leaves.discard(node)
            free.extend(node.value)
            node.parent = None
            if parent.parent is not None:
                if not parent.children and parent.lock_ref == 0:
                    leaves.add(parent)
            elif not parent.children:
                del self._roots[parent.key]
        self._num_evictable_blocks -= num_freed
        self.num_evicted_blocks += num_freed
        if self.record_events:
            self._events.append(BlockEvent(
                "removed", tuple(h for n in victims for h in n.hashes)))


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@hookimpl
def corekv_register_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="radix",
        factory=RadixBackend,
        options={
            "track_hashes": Option("bool", default=True, help=(
                "keep each cached block's chained hash (needed for write-back to tiers and for "
                "events); off for index-only simulations, which then never hash")),
            "record_events": Option("bool", default=True, help=(
                "keep stored/removed BlockEvents for take_events(); needs track_hashes")),
        },
        description="SGLang-style radix tree over pages, LRU eviction of unlocked leaves",
    )]
