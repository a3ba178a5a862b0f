"""The engine's side of block ownership: sequences' block tables over the backend's pool.

The prefix-cache backend owns residency (which blocks are free, cached, evictable, pinned); this
module decides which blocks a sequence holds: the matched prefix, fresh blocks for the rest,
a new block when decoding crosses a block boundary, and a private copy of a block shared with a
forked sibling before writing into it (copy-on-write). With storage tiers it tells the offload
facade (:class:`corekv.offload.Offload`) what happens to a sequence's blocks: it arrived, it is
admitted (the tiers' hits after the device match are loaded), blocks became cached, it was
preempted with swap (parked) or left while waiting; the facade does the rest.
"""
from __future__ import annotations

from collections import Counter

from corekv.backend import PrefixCacheBackend, admit
from corekv.offload import NullOffload, Offload
from corekv.engine.sequence import Sequence

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
                 offload: Offload | NullOffload | None = None):
        self.backend = backend
        self.kv_pool = kv_pool
        self.block_size = backend.block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: the offload facade over the storage tiers; without tiers one that does nothing
        self.offload = NullOffload() if offload is None else offload
        self.shared_refs: Counter[int] = Counter()
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # -- admission ---------------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` would start with (read-only; at most all but the last token)."""
        if not self.enable_prefix_caching:
            return []
        return self.backend.match(seq.key, max_blocks=self._max_reused_blocks(seq))

    def prefetch(self, seq: Sequence) -> None:
        """``seq`` arrived: the tiers' hits beyond its device match start loading into staging."""
        if self.enable_prefix_caching and seq.swap is None:
            self.offload.arrived(seq, seq.key, len(self.match(seq)), self._max_reused_blocks(seq))

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting ``seq`` its matched prefix plus fresh blocks for all its tokens.

        With tiers, the prefix continues down the tiers after the device match: the hits are
        loaded into the first fresh blocks and cached, so they count as computed. A sequence that
        swap preemption parked gets its partial last block back too.

        :returns: False (and no change) if the pool cannot supply the fresh blocks now.
        """
        assert not seq.block_table, f"allocate({seq}): the sequence already holds blocks; this indicates a bug in the scheduler"
        admission = admit(self.backend, seq.key, seq.num_tokens,
                          max_hit_blocks=self._max_reused_blocks(seq) if self.enable_prefix_caching else 0)
        if admission is None:
            return False
        hit, fresh = admission.hit, admission.fresh
        seq.block_table = admission.table
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_cached_blocks = len(hit)
        by_tier = {"device": len(hit) * self.block_size}
        if self.enable_prefix_caching or seq.swap is not None:
            for name, num in self._reload(seq, hit, fresh).items():
                by_tier[name] = by_tier.get(name, 0) + num * self.block_size
        if seq.num_cached_tokens is None:  # first admission: what the output reports
            seq.cached_tokens_by_tier = by_tier
        return True

    def _reload(self, seq: Sequence, hit: list[int], fresh: list[int]) -> dict[str, int]:
        """Load ``seq``'s blocks after the device ``hit`` from the tiers into ``fresh``."""
        # NOTE: the device match was taken again just now: blocks the device gained since the
        # prefetch started are not loaded twice, and blocks it lost are loaded synchronously.
        loaded = self.offload.load(seq, seq.key, len(hit), self._max_reused_blocks(seq), fresh)
        num_full = len(hit) + sum(loaded.values())
        if num_full > len(hit):
            if self.enable_prefix_caching:
                # NOTE: cached now, so the reloaded blocks are hittable by the next request and
                # are offered for write-back like any other cached block.
                self.backend.cache(seq.key, seq.block_table[:num_full])
                seq.num_cached_blocks = num_full
            seq.num_computed_tokens = num_full * self.block_size
        parked, seq.swap = seq.swap, None
        if parked is not None:
            num_computed = self.offload.unpark(parked, seq.block_table, num_full)
            if num_computed is not None:
                seq.num_computed_tokens = num_computed
                self.num_swapped_in_blocks += 1
        return loaded

    def swap_out(self, seq: Sequence) -> None:
        """Before a preempted ``seq`` frees its blocks: park their KV in the swap tier."""
        if not self.offload.can_swap or not seq.block_table:
            return
        seq.swap = self.offload.park(f"{seq.request_id}|{seq.index}|{id(seq)}", seq.key,
                                     seq.block_table, seq.num_computed_tokens)
        self.num_swapped_out_blocks += seq.swap.num_blocks

    def release_waiting(self, seq: Sequence) -> None:
        """``seq`` finished while waiting (aborted): drop what it holds outside the pool, its
        prefetch and, if it was swapped out, its parked partial block."""
        parked, seq.swap = seq.swap, None
        self.offload.left(seq, parked)

    # -- decoding ----------------------------------------------------------------------------
    def append_slot(self, seq: Sequence) -> bool:
        """Make sure the next token's slot is in a block ``seq`` may write.

        :returns: False (and no change) if that needs a block and the pool has none.
        """
        return self.append_slots(seq, 1)

    def append_slots(self, seq: Sequence, num_tokens: int, *, num_reserved_blocks: int = 0) -> bool:
        """Make sure the slots of the next ``num_tokens`` tokens (a decode and the drafts it
        verifies) are in blocks ``seq`` may write: a private copy of a shared block, fresh blocks
        past the table's end.

        :param num_reserved_blocks: with it, the blocks come only from empty ones (no cached block
            is evicted for them), and this many must stay free afterwards.
        :returns: False (and no change) if the pool cannot supply the blocks (and the reserve).
        """
        index = seq.num_computed_tokens // self.block_size
        # NOTE: only the block of the first slot can be shared: a table holds at most the blocks
        # of the computed tokens and the next one, and a fork shares exactly its parent's table
        is_shared = index < len(seq.block_table) and bool(self.shared_refs.get(seq.block_table[index]))
        num_new = max(0, blocks_for(seq.num_computed_tokens + num_tokens, self.block_size) - len(seq.block_table))
        num_needed = num_new + is_shared
        if num_needed == 0:
            return True
        if num_reserved_blocks and (self.backend.num_empty_blocks < num_needed
                                    or self.backend.num_free_blocks < num_needed + num_reserved_blocks):
            return False
        fresh = self.backend.allocate(num_needed)
        if fresh is None:
            return False
        if is_shared:
            block_id = seq.block_table[index]
            self.kv_pool.copy_blocks([block_id], fresh[:1])
            self._drop_share(block_id)
            seq.block_table[index] = fresh.pop(0)
            self.num_cow_copies += 1
        seq.block_table.extend(fresh)
        return True

    def release_lookahead(self, seq: Sequence) -> None:
        """Return the blocks past ``seq``'s computed tokens (reached only by rejected drafts), so
        it holds what it would without speculation."""
        keep = blocks_for(seq.num_computed_tokens, self.block_size)
        if len(seq.block_table) > keep:
            released = [b for b in seq.block_table[keep:] if not self._drop_share(b)]
            del seq.block_table[keep:]
            self.backend.free(released)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly completed full blocks to the backend (they become hittable)."""
        num_full = seq.num_computed_tokens // self.block_size
        if self.enable_prefix_caching and num_full > seq.num_cached_blocks:
            self.backend.cache(seq.key, seq.block_table[:num_full])
            self.offload.cached(seq.key, seq.block_table[:num_full], seq.num_cached_blocks,
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

    def _max_reused_blocks(self, seq: Sequence) -> int:
        """Full blocks ``seq`` may take from a cache: all but its last token's (that one is computed)."""
        return (seq.num_tokens - 1) // self.block_size

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
