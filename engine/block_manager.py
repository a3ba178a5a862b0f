"""The engine's side of block ownership: sequences' block tables over the backend's pool.

The prefix-cache backend owns residency (which blocks are free, cached, evictable, pinned); this
module decides which blocks a sequence holds: the matched prefix, fresh blocks for the rest,
a new block when decoding crosses a block boundary, and a private copy of a block shared with a
forked sibling before writing into it (copy-on-write). With storage tiers (a
:class:`corekv.cache_manager.CacheManager`), a request's arrival starts the prefetch of its tier
hits (:meth:`BlockManager.prefetch`), admission continues the device match down the tiers and
loads the hits (the prefetched rows, then anything not prefetched); swap preemption parks a
preempted sequence's blocks in the host tier.
"""
from __future__ import annotations

import hashlib
from collections import Counter

from corekv.backend import PrefixCacheBackend
from corekv.prefetch import Prefetch
from corekv.engine.sequence import Sequence, SwapState

__all__ = ["BlockManager"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens of KV."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Gives sequences their blocks from a :class:`PrefixCacheBackend`.

    Invariants:

    * the engine holds exactly one backend reference per distinct block in any running block
      table; ``shared_refs[b]`` counts the *extra* tables (forked siblings) holding ``b``, so a
      block goes back to the backend only when its last holder frees it;
    * a block with ``shared_refs[b] > 0`` is never written: ``append_slot`` copies it into a
      fresh block first (copy-on-write), and the writer drops its share of the original.

    NOTE: siblings share through ``shared_refs`` and not through backend references because the
    backend only counts references on blocks it can hand out (matched or allocated); a prompt's
    last, partially filled block is never cached, so ``backend.acquire`` cannot share it. Keeping
    every fork share here treats full and partial blocks alike, with or without prefix caching.
    """

    def __init__(self, backend: PrefixCacheBackend, kv_pool, *, enable_prefix_caching: bool = True,
                 cache_manager=None, swap_tier: int | None = None):
        self.backend = backend
        self.kv_pool = kv_pool
        self.block_size = backend.block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: a CacheManager over the storage tiers, or None (device pool only)
        self.cache_manager = cache_manager
        #: index of the tier that swap preemption parks blocks in (None: recompute preemption)
        self.swap_tier = swap_tier
        self.shared_refs: Counter[int] = Counter()
        #: waiting sequences' prefetches, consumed at admission or dropped when they finish waiting
        self.prefetches: dict[Sequence, Prefetch] = {}
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # -- admission ---------------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` would start with (read-only; at most all but the last token)."""
        if not self.enable_prefix_caching:
            return []
        return self.backend.match(seq.key, max_blocks=(seq.num_tokens - 1) // self.block_size)

    def prefetch(self, seq: Sequence) -> None:
        """``seq`` arrived: start fetching its tier hits beyond the device match into staging."""
        manager = self.cache_manager
        if manager is None or not self.enable_prefix_caching or seq.swap is not None or seq in self.prefetches:
            return
        prefetch = manager.prefetch(seq.key, len(self.match(seq)), (seq.num_tokens - 1) // self.block_size)
        if prefetch is not None:
            self.prefetches[seq] = prefetch

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting ``seq`` its matched prefix plus fresh blocks for all its tokens.

        With tiers, the prefix continues down the tiers after the device match: the hits are
        loaded (one batch per tier run) into the first fresh blocks and cached, so they count as
        computed. A sequence that swap preemption parked gets its partial last block back too.

        :returns: False (and no change) if the pool cannot supply the fresh blocks now.
        """
        assert not seq.block_table, f"allocate({seq}): the sequence already holds blocks; this indicates a bug in the scheduler"
        hit = self.match(seq)
        self.backend.acquire(hit)  # NOTE: first, so allocate() cannot evict the blocks we hit
        fresh = self.backend.allocate(blocks_for(seq.num_tokens, self.block_size) - len(hit))
        if fresh is None:
            self.backend.free(hit)
            return False
        seq.block_table = hit + fresh
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_cached_blocks = len(hit)
        by_tier = {"device": len(hit) * self.block_size}
        manager = self.cache_manager
        if manager is not None and manager.tiers and (self.enable_prefix_caching or seq.swap is not None):
            manager.note_hits(seq.key, len(hit))
            loaded = self._reload(seq, hit, fresh)
            for name, num in loaded.items():
                by_tier[name] = by_tier.get(name, 0) + num * self.block_size
        if seq.num_cached_tokens is None:  # first admission: what the output reports
            seq.cached_tokens_by_tier = by_tier
        return True

    def _reload(self, seq: Sequence, hit: list[int], fresh: list[int]) -> dict[str, int]:
        """Load ``seq``'s blocks after the device ``hit`` from the tiers into ``fresh``."""
        manager = self.cache_manager
        max_blocks = (seq.num_tokens - 1) // self.block_size
        # NOTE: the device match was taken again just now: blocks the device gained since the
        # prefetch started are not loaded twice, and blocks it lost are loaded synchronously.
        loaded = manager.load_prefix(seq.key, len(hit), max_blocks, fresh, self.prefetches.pop(seq, None))
        num_loaded = sum(loaded.values())
        if num_loaded:
            num_full = len(hit) + num_loaded
            if self.enable_prefix_caching:
                # NOTE: cached now, so the reloaded blocks are hittable by the next request and
                # are offered for write-back like any other cached block.
                self.backend.cache(seq.key, seq.block_table[:num_full])
                seq.num_cached_blocks = num_full
            seq.num_computed_tokens = num_full * self.block_size
        swap, seq.swap = seq.swap, None
        if swap is not None and swap.private_key is not None:
            num_full = len(hit) + num_loaded
            if num_full == swap.num_full_blocks:
                block_id = seq.block_table[num_full]
                if manager.load_private(self.swap_tier, swap.private_key, block_id):
                    seq.num_computed_tokens = swap.num_computed_tokens
                    self.num_swapped_in_blocks += 1
            manager.delete_private(self.swap_tier, swap.private_key)
        return loaded

    def swap_out(self, seq: Sequence) -> None:
        """Before a preempted ``seq`` frees its blocks: park their KV in the swap tier.

        Full blocks go under their chain hashes (any request can reload them); the partial last
        block goes under a private key only this sequence's re-admission knows.
        """
        manager = self.cache_manager
        if manager is None or self.swap_tier is None or not seq.block_table:
            return
        num_computed = seq.num_computed_tokens
        num_full = num_computed // self.block_size
        hashes = seq.key.block_hashes[:num_full]
        self.num_swapped_out_blocks += manager.swap_out(self.swap_tier, list(hashes), seq.block_table[:num_full])
        private_key = None
        if num_computed % self.block_size:
            private_key = _private_key(seq, num_full, num_computed)
            if manager.swap_out(self.swap_tier, [private_key], [seq.block_table[num_full]]):
                self.num_swapped_out_blocks += 1
            else:
                private_key = None
        seq.swap = SwapState(num_full, num_computed, private_key)

    def release_waiting(self, seq: Sequence) -> None:
        """``seq`` finished while waiting (aborted): drop what it holds outside the pool, its
        prefetch and, if it was swapped out, its private partial block in the tier."""
        prefetch = self.prefetches.pop(seq, None)
        if prefetch is not None:
            self.cache_manager.drop_prefetch(prefetch)
        swap, seq.swap = seq.swap, None
        if swap is not None and swap.private_key is not None and self.cache_manager is not None:
            self.cache_manager.delete_private(self.swap_tier, swap.private_key)

    # -- decoding ----------------------------------------------------------------------------
    def append_slot(self, seq: Sequence) -> bool:
        """Make sure the next token's slot is in a block ``seq`` may write.

        :returns: False (and no change) if that needs a block and the pool has none.
        """
        index = seq.num_computed_tokens // self.block_size
        if index == len(seq.block_table):
            fresh = self.backend.allocate(1)
            if fresh is None:
                return False
            seq.block_table.append(fresh[0])
            return True
        block_id = seq.block_table[index]
        if not self.shared_refs.get(block_id):
            return True
        fresh = self.backend.allocate(1)
        if fresh is None:
            return False
        self.kv_pool.copy_blocks([block_id], fresh)
        self._drop_share(block_id)
        seq.block_table[index] = fresh[0]
        self.num_cow_copies += 1
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly completed full blocks to the backend (they become hittable)."""
        num_full = seq.num_computed_tokens // self.block_size
        if self.enable_prefix_caching and num_full > seq.num_cached_blocks:
            self.backend.cache(seq.key, seq.block_table[:num_full])
            if self.cache_manager is not None:
                self.cache_manager.on_cached(seq.key, seq.block_table[:num_full], seq.num_cached_blocks,
                                             offload=seq.offload)
            seq.num_cached_blocks = num_full

    # -- sharing and release -----------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a fork of ``parent``) now holds the same blocks: count the extra holder."""
        assert child.block_table == parent.block_table, "fork: tables differ; this indicates a bug in Sequence.fork"
        self.shared_refs.update(child.block_table)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks: shared ones lose a holder, the rest go back to the backend
        in table order (the backend then evicts a prefix's tail before its head)."""
        released = [b for b in seq.block_table if not self._drop_share(b)]
        self.backend.free(released)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def num_blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def _drop_share(self, block_id: int) -> bool:
        """Drop one extra holder of ``block_id``; False when there was none (the caller owns it)."""
        count = self.shared_refs.get(block_id, 0)
        if count == 0:
            return False
        if count == 1:
            del self.shared_refs[block_id]
        else:
            self.shared_refs[block_id] = count - 1
        return True


def _private_key(seq: Sequence, block_index: int, num_computed: int) -> bytes:
    """A swap key for ``seq``'s partial block: never equal to a chain hash, unique per sequence."""
    text = f"corekv-swap|{seq.request_id}|{seq.index}|{block_index}|{num_computed}|{id(seq)}"
    return hashlib.blake2b(seq.key.namespace + text.encode(), digest_size=16).digest()
