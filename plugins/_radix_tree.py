"""The radix tree's structural operations, kept apart from the backend verbs in ``radix.py``.

Nodes hold whole pages; ``RadixTreeOps`` cuts block runs into nodes, splits edges, keeps lock refs
from node to root with the evictable/protected accounting, adds leaves and evicts unlocked leaves
in the order of the backend's eviction policy (:mod:`corekv.eviction`; LRU by default). It
is a mixin: the state it works on is created by :class:`corekv.plugins.radix.RadixBackend`.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable

from corekv.backend import BlockEvent, EvictedBlock, stored_event
from corekv.hashing import PrefixKey


class Node:
    __slots__ = ("key", "value", "hashes", "children", "parent", "ref", "lock_ref",
                 "last_access", "serial", "num_hits", "priority")

    def __init__(self, key, value, hashes, parent, serial, priority=0):
        self.key = key          # tokens of the edge into this node (for a root: its namespace)
        self.value = value      # one device block id per page of ``key``
        self.hashes = hashes    # one chained hash per page, or None when hashes are not tracked
        self.children: dict = {}
        self.parent = parent    # None for a root and for an evicted (dead) node
        self.ref = 0            # references held on *each* block of this node
        self.lock_ref = 0       # sum of ``ref`` over this node's subtree
        self.last_access = 0
        self.serial = serial    # creation order: a deterministic tie-break for the eviction heap
        self.num_hits = 0       # acquires of this node's blocks (what LFU counts)
        self.priority = priority  # highest PrefixKey.priority that cached or walked through it

    @property
    def created(self) -> int:
        """Creation order, as eviction policies read it (:class:`corekv.eviction.EntryStats`)."""
        return self.serial


class RadixTreeOps:
    """Structural helpers; see :class:`~corekv.plugins.radix.RadixBackend` for the invariants."""

    def _segments(self, name: str, block_ids) -> list[tuple[Node | None, int]]:
        """Cut ``block_ids`` into private blocks ``(None, b)`` and whole cached nodes
        ``(node, first block)``, splitting nodes at the ends of the runs (refs stay uniform)."""
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        n = len(ids)
        state = self._state
        segments: list[tuple[Node | None, int]] = []
        seen: set[Node] = set()
        i = 0
        while i < n:
            b = ids[i]
            x = state[b] if b.__class__ is int and 0 <= b < self.num_blocks else None
            if x is None or x.__class__ is int and x == 0 or x.__class__ is Node and x.parent is None:
                raise ValueError(f"block {b!r} in {name} is not in use: it is free, or not a block "
                                 f"id of this pool ([0, {self.num_blocks})); pass blocks from "
                                 "match(), allocate() or cache()")
            if x.__class__ is int:
                segments.append((None, b))
                i += 1
                continue
            if x in seen:
                raise ValueError(f"block {b} is listed in {name} more than once; pass each block "
                                 "once per call (call again to take or drop another reference)")
            node, value = x, x.value
            offset = 0 if value[0] == b else value.index(b)
            run = min(len(value) - offset, n - i)
            # NOTE: one C-level slice comparison per node; binary search only where runs diverge.
            if (ids[i:i + run] != value) if (offset == 0 and run == len(value)) else (
                    ids[i:i + run] != value[offset:offset + run]):
                lo, hi = 1, run - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if ids[i:i + mid] == value[offset:offset + mid]:
                        lo = mid
                    else:
                        hi = mid - 1
                run = lo
            if offset:
                node = self._split(node, offset)[1]
            if run < len(node.value):
                node = self._split(node, run)[0]
            segments.append((node, b))
            seen.add(node)
            i += run
        return segments

    def _split(self, node: Node, num_pages: int) -> tuple[Node, Node]:
        """Cut ``node``'s edge after ``num_pages``; return ``(upper, lower)``. The shorter part
        becomes the new node, so only its blocks need their owner re-pointed."""
        page, child_key, state = self.page, self._child_key, self._state
        cut = num_pages * page
        self._serial += 1
        if num_pages <= len(node.value) - num_pages:   # new upper node, ``node`` keeps the rest
            upper = lower = node
            upper = Node(node.key[:cut], node.value[:num_pages],
                         None if node.hashes is None else node.hashes[:num_pages], node.parent,
                         self._serial, node.priority)
            lower.key, lower.value = node.key[cut:], node.value[num_pages:]
            if lower.hashes is not None:
                lower.hashes = lower.hashes[num_pages:]
            upper.parent.children[child_key(upper.key, 0)] = upper
            lower.parent = upper
            upper.children[child_key(lower.key, 0)] = lower
            moved = upper
        else:                                           # new lower node takes the children
            upper = node
            lower = Node(node.key[cut:], node.value[num_pages:],
                         None if node.hashes is None else node.hashes[num_pages:], upper,
                         self._serial, node.priority)
            lower.children = upper.children
            for child in lower.children.values():
                child.parent = lower
            upper.key, upper.value = node.key[:cut], node.value[:num_pages]
            if upper.hashes is not None:
                upper.hashes = upper.hashes[:num_pages]
            upper.children = {child_key(lower.key, 0): lower}
            moved = lower
            if not lower.children and upper.lock_ref == 0:
                self._evictable_leaves.discard(upper)
                self._evictable_leaves.add(lower)
        # both parts keep the references of the old node; the upper one also carries the lower's
        lower.ref = upper.ref = node.ref
        lower.last_access = upper.last_access = node.last_access
        lower.num_hits = upper.num_hits = node.num_hits
        lower_lock = (upper.lock_ref if moved is lower else lower.lock_ref)
        lower.lock_ref = lower_lock
        upper.lock_ref = lower_lock + node.ref
        if node.ref:  # the new node's references count in every ancestor's lock_ref
            ancestor = upper.parent
            while ancestor.parent is not None:
                ancestor.lock_ref += node.ref
                ancestor = ancestor.parent
        for b in moved.value:
            state[b] = moved
        return upper, lower

    def _add_locks(self, nodes: Iterable[Node], delta: int, now: int | None) -> None:
        """Add ``delta`` to ``lock_ref`` of each node and all its ancestors, moving nodes between
        the evictable and protected counts as they cross zero. ``nodes`` in root-to-leaf order
        share their walk: each ancestor is visited once per call, not once per node below it."""
        pending = nodes if isinstance(nodes, list) else list(nodes)
        # NOTE: a single node (the common case) needs no shared-walk bookkeeping.
        waiting = set(pending) if len(pending) > 1 else ()
        carry: dict[Node, int] = {}
        leaves = self._evictable_leaves
        moved = 0
        for node in reversed(pending):
            if waiting:
                waiting.discard(node)
            d = delta + carry.pop(node, 0) if carry else delta
            while node.parent is not None:
                old = node.lock_ref
                node.lock_ref = new = old + d
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
                if node in waiting:   # an ancestor still to come: it takes our delta along
                    carry[node] = carry.get(node, 0) + d
                    break
        self._num_evictable_blocks -= moved
        self._num_protected_blocks += moved

    def _add_leaves(self, parent: Node, key: PrefixKey, tokens: list[int], block_ids: list[int],
                    first_page: int, now: int) -> None:
        """Hang the caller's private ``block_ids`` (pages ``first_page...`` of ``key``) below
        ``parent``; the caller's references move onto the new node(s)."""
        state = self._state
        refs = list(map(state.__getitem__, block_ids))
        is_uniform = refs.count(refs[0]) == len(refs)
        if not is_uniform or refs[0].__class__ is not int or refs[0] == 0:
            for b, r in zip(block_ids, refs):
                if r.__class__ is not int or r == 0:
                    raise ValueError(f"block {b} in block_ids is neither a hit of this key nor "
                                     "held privately (it is free or caches another prefix); pass "
                                     "the request's own blocks from match()/allocate()")
        hashes = None
        if self.track_hashes:
            hashes = key.block_hashes[first_page:first_page + len(block_ids)]
        page, child_key, leaves = self.page, self._child_key, self._evictable_leaves
        num_ids, start = len(block_ids), 0
        new_nodes = []
        while start < num_ids:
            # NOTE: a run of blocks held a different number of times (acquire() on allocated
            # blocks) gets a node of its own, keeping every node's references uniform.
            end = num_ids if is_uniform else start + 1
            while end < num_ids and refs[end] == refs[start]:
                end += 1
            self._serial += 1
            node = Node(tokens[start * page:end * page], block_ids[start:end],
                        None if hashes is None else hashes[start:end], parent, self._serial,
                        key.priority)
            parent.children[child_key(node.key, 0)] = node
            leaves.discard(parent)
            node.ref = refs[start]
            for b in node.value:
                state[b] = node
            new_nodes.append(node)
            parent, start = node, end
        leaves.add(parent)
        self._num_evictable_blocks += num_ids
        self._num_private_blocks -= num_ids
        # the new nodes' references now lock them and their ancestors, one shared walk
        for node in new_nodes:
            if node.ref > 1:
                self._add_locks([node], node.ref - 1, now)
        self._add_locks(new_nodes, 1, now)
        if hashes and self.record_events:
            self._events.append(stored_event(key, first_page, first_page + num_ids))

    def _evict(self, num_blocks: int) -> None:
        """Evict unlocked leaves, smallest ``eviction.key(node)`` first (ties: oldest node), until
        ``num_blocks`` blocks are free; a parent becomes a candidate when its last child goes."""
        order = self.eviction.key
        heap = self.eviction.ranked(self._evictable_leaves)
        heapq.heapify(heap)
        victims: list[Node] = []
        parent_to_gone: dict[Node, int] = {}
        num_freed = 0
        # NOTE: choose every victim first, then offer them to on_evict, then unlink: a failing
        # write-back leaves the tree untouched.
        while num_freed < num_blocks:
            assert heap, "evictable count out of sync with the tree; this indicates a bug in radix"
            node = heapq.heappop(heap)[2]
            victims.append(node)
            num_freed += len(node.value)
            parent = node.parent
            if parent.parent is not None and parent.lock_ref == 0:
                gone = parent_to_gone[parent] = parent_to_gone.get(parent, 0) + 1
                if gone == len(parent.children):
                    heapq.heappush(heap, (order(parent), parent.serial, parent))
        if self._on_evict is not None:
            self._on_evict([EvictedBlock(h, b, n.priority)
                            for n in victims for h, b in zip(n.hashes, n.value)])
        child_key, free, leaves = self._child_key, self._free, self._evictable_leaves
        for node in victims:
            parent = node.parent
            del parent.children[child_key(node.key, 0)]
            leaves.discard(node)
            free.extend(node.value)
            node.parent = None   # dead: its blocks' stale owner entries now read as free
            if parent.parent is not None:
                if not parent.children and parent.lock_ref == 0:
                    leaves.add(parent)
            elif not parent.children:
                del self._roots[parent.key]
        self._num_evictable_blocks -= num_freed
        self.num_evicted_blocks += num_freed
        if self.record_events:
            self._events.append(BlockEvent("removed", tuple(h for n in victims for h in n.hashes)))
