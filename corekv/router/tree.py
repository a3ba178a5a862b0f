"""What the router believes one worker has cached: a prefix tree of whole KV blocks of token ids.

A worker caches whole blocks only (``block_size`` token ids, chained by hash), so this radix tree's
edges are whole blocks: a partial block can never hit on the worker, and a KV event names blocks.
It is *approximate*: fed by routed prompts it guesses what the worker keeps (bounded by LRU
eviction, not by the worker's real pool); fed by KV events it knows what the worker reported, late
by the events' delay. Either way each tenant has its own namespace: the request's ``cache_salt``
for routed prompts, the tenant key a chain's first block carries for events (see
:mod:`corekv.router.workers`), so tenants with equal prompts never share a path, as on the worker.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class _Node:
    __slots__ = ("key", "parent", "children", "hashes", "namespace")

    def __init__(self, key: tuple[int, ...] | None, parent: _Node | None, namespace: Hashable):
        self.key = key                    # one block of token ids; None for a root
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.hashes: set[Hashable] = set()  # the block hashes (events) that name this path
        self.namespace = namespace


class BlockTree:
    """A forest of block tries, one root per namespace (the request's ``cache_salt``, or ``None``).

    Invariants:

    * every non-root node holds exactly one block (a tuple of ``block_size`` token ids) as its key,
      and ``parent.children[node.key] is node``; ``num_blocks`` counts the non-root nodes;
    * ``hash_to_node[h]`` is the node whose path block hash ``h`` names, and ``h in node.hashes``;
      a node that came from events and lost its last hash is removed with its subtree (a worker
      cannot hit a block whose parent it no longer holds, and neither does the matching here);
    * ``_lru`` holds every non-root node, least recently used first, and every node comes after all
      of its descendants (paths are touched leaf to root), so the first entry is always a leaf:
      eviction pops it in O(1) and never orphans a node.
    """

    def __init__(self, block_size: int, *, max_blocks: int | None = None):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size: got {block_size!r}; expected an integer >= 1")
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 1):
            raise ValueError(f"max_blocks: got {max_blocks!r}; expected an integer >= 1 or None")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.num_blocks = 0
        self.hash_to_node: dict[Hashable, _Node] = {}
        self._roots: dict[Hashable, _Node] = {}
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    # -- queries --------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """How many leading tokens of ``token_ids`` lie on a path of this tree (whole blocks)."""
        node = self._roots.get(namespace)
        matched = 0
        for block in self._blocks(token_ids):
            node = node.children.get(block) if node is not None else None
            if node is None:
                break
            matched += self.block_size
        return matched

    def stats(self) -> dict[str, int]:
        """Blocks (nodes), block hashes known from events, and namespaces (roots)."""
        return {"blocks": self.num_blocks, "hashes": len(self.hash_to_node),
                "namespaces": len(self._roots)}

    # -- prompt mode ----------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Record that the worker now holds the full blocks of ``token_ids``; mark them used, then
        evict least recently used leaves past ``max_blocks``. Returns the number of new blocks."""
        blocks = list(self._blocks(token_ids))
        if not blocks:
            return 0
        node = self._root(namespace)
        path, num_new = [], 0
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node(block, node, namespace)
                self.num_blocks += 1
                num_new += 1
            path.append(child)
            node = child
        self._touch(path)
        if self.max_blocks is not None:
            while self.num_blocks > self.max_blocks:
                self._remove_subtree(next(iter(self._lru)))
        return num_new

    # -- event mode -----------------------------------------------------------------------------
    def store(self, block_hashes: Sequence[Hashable], parent_hash: Hashable | None,
              token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Apply a ``BlockStored`` event: the blocks ``token_ids`` (``block_size`` ids per hash)
        chained under ``parent_hash``, or at the root of ``namespace`` when ``parent_hash`` is
        ``None`` (a run that continues a chain is in its parent's namespace). Returns the blocks
        placed: 0 when the parent is unknown (it was removed, or its event was missed) or the sizes
        disagree."""
        if not block_hashes or len(token_ids) != len(block_hashes) * self.block_size:
            return 0
        if parent_hash is None:
            node = self._root(namespace)
        else:
            node = self.hash_to_node.get(parent_hash)
            if node is None:
                return 0
        path = []
        for block_hash, block in zip(block_hashes, self._blocks(token_ids)):
            known = self.hash_to_node.get(block_hash)
            if known is not None:  # NOTE: a repeated event; trust the path it was first stored on
                node = known
                path.append(node)
                continue
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node(block, node, node.namespace)
                self.num_blocks += 1
            child.hashes.add(block_hash)
            self.hash_to_node[block_hash] = child
            path.append(child)
            node = child
        self._touch(path)
        return len(path)

    def remove(self, block_hashes: Iterable[Hashable]) -> int:
        """Apply a ``BlockRemoved`` event; returns how many blocks (nodes) left the tree."""
        before = self.num_blocks
        for block_hash in block_hashes:
            node = self.hash_to_node.pop(block_hash, None)
            if node is None:
                continue
            node.hashes.discard(block_hash)
            if not node.hashes:
                self._remove_subtree(node)
        return before - self.num_blocks

    def clear(self) -> None:
        """Forget everything (``AllBlocksCleared``, or the worker restarted)."""
        self.num_blocks = 0
        self.hash_to_node.clear()
        self._roots.clear()
        self._lru.clear()

    # -- helpers ----------------------------------------------------------------------------------
    def _blocks(self, token_ids: Sequence[int]) -> Iterable[tuple[int, ...]]:
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            yield tuple(token_ids[start:start + size])

    def _root(self, namespace: Hashable) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(None, None, namespace)
        return root

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):  # NOTE: leaf first, so each node ends up after its descendants
            self._lru[node] = None
            self._lru.move_to_end(node)

    def _remove_subtree(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.key]
        if parent.parent is None and not parent.children:
            del self._roots[parent.namespace]
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            for block_hash in current.hashes:
                del self.hash_to_node[block_hash]
            del self._lru[current]
            self.num_blocks -= 1
