"""``radix``: the SGLang-style prefix cache, a compressed radix tree over pages of tokens.

Each namespace (``PrefixKey.namespace``: model, block size, salt, extra keys) has its own root, so
tenants never share a node. An edge holds whole pages of ``block_size`` tokens (1 = token
granularity) and the device block id of each page. A lookup walks down comparing whole edges with
one C-level slice comparison each; only a partially matching edge is binary-searched, page by page.
Structural operations (splitting, lock refs, eviction) live in :mod:`corekv.plugins._radix_tree`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from corekv.backend import BlockEvent, EvictCallback, PrefixCacheBackend, check_count
from corekv.eviction import EvictionPolicy, make_policy
from corekv.hashing import BlockHash, PrefixKey
from corekv.plugin import BackendSpec, Option, hookimpl
from corekv.plugins._pin_book import PinBook, _check_key
from corekv.plugins._radix_tree import Node, RadixTreeOps


class RadixBackend(RadixTreeOps, PrefixCacheBackend):
    """Radix-tree index of the device pool; block references map onto node lock refs.

    Invariants:

    * ``_state[b]`` says what block ``b`` is: ``0`` free (then ``b`` is in ``_free``), an int
      ``r > 0`` private (allocated, not cached, ``r`` references), or the live node whose
      ``value`` holds it (cached). A dead (evicted) node there reads as free;
    * every block of a node carries the same reference count ``node.ref`` (requests and pins):
      acquire/free split a node at the ends of the run they touch. ``cache`` moves the caller's
      private references onto the new node, so a request's blocks are freed the same way whether
      they were cached in between or not;
    * ``node.lock_ref`` is the sum of ``ref`` over the node's subtree, kept from node to root, so
      ``lock_ref == 0`` means nothing at or below the node is in use, and
      ``lock_ref(parent) >= lock_ref(child)``;
    * every cached block counts in exactly one of ``_num_evictable_blocks`` (its node's
      ``lock_ref == 0``) and ``_num_protected_blocks``;
    * ``_evictable_leaves`` holds exactly the non-root leaves with ``lock_ref == 0``; eviction
      removes whole ones in the order of ``eviction`` (an :class:`~corekv.eviction.EvictionPolicy`
      keyed on the node's ``last_access``, ``num_hits``, ``priority``, ``created``; LRU by
      default), and a parent joins when its last child goes, so only leaves are ever evicted and
      a locked node never is, whatever the policy;
    * edges are whole pages; the child key is an edge's first token (page 1) or first page.
    """

    name = "radix"

    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_fraction: float = 0.2,
                 track_hashes: bool = True, record_events: bool = True,
                 eviction: str | EvictionPolicy | None = None):
        for opt, value in (("track_hashes", track_hashes), ("record_events", record_events)):
            if not isinstance(value, bool):
                raise TypeError(f"{opt} must be True or False, got {value!r}")
        if record_events and not track_hashes:
            raise ValueError("record_events=True needs track_hashes=True (events carry block "
                             "hashes); pass record_events=False or track_hashes=True")
        self.track_hashes = track_hashes
        super().__init__(num_blocks, block_size, max_pinned_fraction=max_pinned_fraction)
        self.record_events = record_events
        self.eviction = make_policy(eviction)
        self.page = block_size
        # NOTE: the child-key function is chosen once here, not branched on per lookup.
        self._child_key = (lambda t, i: t[i]) if block_size == 1 else (
            lambda t, i, p=block_size: tuple(t[i:i + p]))
        self._pins = PinBook(self.max_pinned_blocks)
        self.num_evicted_blocks = 0
        self._events: list[BlockEvent] = []
        self._init_state()

    def _init_state(self) -> None:
        self._roots: dict[bytes, Node] = {}
        self._state: list = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._evictable_leaves: set[Node] = set()
        self._num_evictable_blocks = self._num_protected_blocks = self._num_private_blocks = 0
        self._clock = self._serial = 0

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
        if key.__class__ is not PrefixKey or key.block_size != self.block_size:
            _check_key(key, self)
        tokens, page = key.token_ids, self.page
        num_pages = len(tokens) // page
        if max_blocks is not None:
            if max_blocks.__class__ is not int or max_blocks < 0:
                check_count("max_blocks", max_blocks)
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
        state, nodes = self._state, []
        for node, b in segments:
            if node is None:
                state[b] += 1
            else:
                node.ref += 1
                node.num_hits += 1
                nodes.append(node)
        self._clock += 1
        self._add_locks(nodes, 1, self._clock)

    def allocate(self, num_blocks: int) -> list[int] | None:
        check_count("num_blocks", num_blocks)
        free = self._free
        if num_blocks > len(free):
            if num_blocks > len(free) + self._num_evictable_blocks:
                return None
            self._evict(num_blocks - len(free))
        if num_blocks == 0:
            return []
        block_ids = free[-num_blocks:]
        del free[-num_blocks:]
        state = self._state
        for b in block_ids:   # NOTE: a plain loop beats dict/map tricks for scattered stores
            state[b] = 1
        self._num_private_blocks += num_blocks
        return block_ids

    def cache(self, key: PrefixKey, block_ids: Sequence[int]) -> None:
        if key.__class__ is not PrefixKey or key.block_size != self.block_size:
            _check_key(key, self)
        if len(block_ids) > key.num_full_blocks:
            raise ValueError(f"block_ids has {len(block_ids)} blocks but key has only "
                             f"{key.num_full_blocks} full blocks; pass the ids of full blocks only")
        if not block_ids:
            return
        tokens, page, child_key = key.token_ids, self.page, self._child_key
        limit = len(block_ids) * page
        node = self._roots.get(key.namespace)
        if node is None:
            node = self._roots[key.namespace] = Node(key.namespace, [], None, None, -1)
        self._clock += 1
        now, i, priority = self._clock, 0, key.priority
        while i < limit:
            child = node.children.get(child_key(tokens, i))
            if child is None:
                break
            child.last_access = now
            edge = child.key
            end = i + len(edge)
            if end <= limit and tokens[i:end] == edge:
                if priority > child.priority:
                    child.priority = priority
                node, i = child, end
                continue
            num_pages = self._common_pages(edge, tokens, i, limit)
            node, i = self._split(child, num_pages)[0], i + num_pages * page
            if priority > node.priority:
                node.priority = priority
            break
        if i < limit:
            ids = block_ids[i // page:]
            self._add_leaves(node, key, tokens[i:limit], ids if isinstance(ids, list) else list(ids),
                             i // page, now)

    def free(self, block_ids: Sequence[int]) -> None:
        segments = self._segments("block_ids", block_ids)
        state, free, nodes = self._state, self._free, []
        for node, b in segments:
            if (state[b] if node is None else node.ref) <= 0:
                raise ValueError(f"block {b} in block_ids is not in use (reference count 0); "
                                 "free each block once per allocate()/acquire()")
        if len(set(segments)) != len(segments):   # a block listed twice: needs two references
            for (node, b), times in Counter(segments).items():
                if (state[b] if node is None else node.ref) < times:
                    raise ValueError(f"block {b} is listed in block_ids more often than it is "
                                     "referenced; free each block once per allocate()/acquire()")
        for node, b in reversed(segments):   # tail first
            if node is None:
                state[b] -= 1
                if state[b] == 0:
                    free.append(b)
                    self._num_private_blocks -= 1
            else:
                node.ref -= 1
                nodes.append(node)
        nodes.reverse()
        self._add_locks(nodes, -1, None)

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
    def num_empty_blocks(self) -> int:
        return len(self._free)

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

    def block_priority(self, block_id: int) -> int:
        node = self._cached_node(block_id)
        return 0 if node is None else node.priority

    def ref_count(self, block_id: int) -> int:
        """References held on ``block_id`` (requests and pins)."""
        node = self._cached_node(block_id)
        x = self._state[block_id]
        return node.ref if node is not None else (x if x.__class__ is int else 0)

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        if self._num_private_blocks or self._num_protected_blocks:
            raise RuntimeError(f"reset() needs every block released, but "
                               f"{self._num_private_blocks + self._num_protected_blocks} are in "
                               "use (pinned ones included); free them and unpin first")
        removed = [h for n in {x for x in self._state if x.__class__ is Node and x.parent}
                   for h in (n.hashes or ())]
        self._init_state()
        if self.record_events:
            self._events.append(BlockEvent("removed", tuple(removed), is_cleared=True))
        self._pins.clear()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_cached_blocks": self.num_cached_blocks,
                "num_evicted_blocks": self.num_evicted_blocks,
                "evictable_size": self.evictable_size, "protected_size": self.protected_size}

    # -- helpers -----------------------------------------------------------------------------
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

    def _cached_node(self, block_id: int) -> Node | None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be an int in [0, {self.num_blocks}), got {block_id!r}")
        x = self._state[block_id]
        return x if x.__class__ is Node and x.parent is not None else None


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
            "eviction": Option("eviction", default="lru", help=(
                "which unlocked leaf goes first: lru, lfu, priority or a plugin's policy")),
        },
        description="SGLang-style radix tree over pages, policy-ordered (LRU) eviction of unlocked leaves",
    )]
