"""Swap preemption: a preempted sequence's KV parked in one tier and brought back at re-admission.

Full blocks are parked under their chain hashes, so any request may reload them like offloaded
blocks; the partial last block, which has no chain hash, goes under a private key that only the
parked sequence's :class:`Parked` record holds. That entry is deleted once it is brought back or
the sequence leaves, so private keys never accumulate in the tier.

The swap tier is one whose class says ``supports_swap`` (``host``, and ``shm``, which every
process on the node shares: private keys carry a random nonce drawn per process, so processes
never meet on one, whatever their request ids and object addresses).
"""
from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from corekv.hashing import PrefixKey
from corekv.offload.pool_io import snapshot_blocks
from corekv.offload.tier_calls import safe_tier_call as _safe
from corekv.tier import Tier

__all__ = ["Parked", "Swap"]


@dataclass(frozen=True)
class Parked:
    """What :meth:`Swap.park` left in the tier for one sequence: its first ``num_full_blocks``
    full blocks (under their hashes) and, when ``private_key`` is set, its partial last block;
    ``num_computed_tokens`` is what the sequence had computed; ``num_blocks`` were written now or
    already there."""

    num_full_blocks: int
    num_computed_tokens: int
    private_key: bytes | None
    num_blocks: int


class Swap:
    """Parks and restores sequences' blocks in ``tier``, synchronously (the slots are freed or
    reused right after). Counters: ``<tier>.swapped_out`` and ``<tier>.swapped_in``."""

    def __init__(self, tier: Tier, kv_pool, counters: Counter, load_into):
        self.tier = tier
        self.kv_pool = kv_pool
        self.counters = counters
        self._load_into = load_into  # load_into(tier, keys, block_ids) -> hit flags

    def park(self, owner: str, key: PrefixKey, block_table: Sequence[int], num_computed: int) -> Parked:
        """Write the sequence's computed blocks to the tier; ``owner`` names the sequence
        uniquely among those in flight (the private key is derived from it)."""
        block_size = key.block_size
        num_full = num_computed // block_size
        num_blocks = self._put(list(key.block_hashes[:num_full]), list(block_table[:num_full]))
        private_key = None
        if num_computed % block_size:
            private_key = _private_key(key, owner, num_full, num_computed)
            if self._put([private_key], [block_table[num_full]]):
                num_blocks += 1
            else:
                private_key = None
        return Parked(num_full, num_computed, private_key, num_blocks)

    def unpark(self, parked: Parked, block_table: Sequence[int], num_full_loaded: int) -> int | None:
        """Bring back the partial block into ``block_table[num_full_loaded]`` when the full blocks
        before it were all reloaded; returns the sequence's computed tokens then (None: the
        partial block is recomputed). The private entry is deleted either way."""
        if parked.private_key is None:
            return None
        restored = None
        if num_full_loaded == parked.num_full_blocks:
            if self._load_into(self.tier, [parked.private_key], [block_table[num_full_loaded]])[0]:
                self.counters[f"{self.tier.name}.swapped_in"] += 1
                restored = parked.num_computed_tokens
        self.forget(parked)
        return restored

    def forget(self, parked: Parked) -> None:
        """The parked sequence left: delete its private entry."""
        if parked.private_key is not None:
            _safe(lambda: self.tier.delete([parked.private_key]), None, self.tier, "delete")

    def _put(self, hashes: list[bytes], block_ids: list[int]) -> int:
        """Write blocks the tier lacks; returns how many it holds afterwards."""
        if not hashes:
            return 0
        tier = self.tier
        present = _safe(lambda: tier.contains_many(hashes), [False] * len(hashes), tier, "contains_many")
        todo = [i for i, is_present in enumerate(present) if not is_present]
        if not todo:
            return len(hashes)
        payload = snapshot_blocks(self.kv_pool, [block_ids[i] for i in todo]).numpy()
        stored = _safe(lambda: tier.put([(hashes[i], payload[j]) for j, i in enumerate(todo)]), 0, tier, "put")
        self.counters[f"{tier.name}.swapped_out"] += stored
        return len(hashes) - len(todo) + stored


def _private_key(key: PrefixKey, owner: str, block_index: int, num_computed: int) -> bytes:
    """A swap key for a partial block: never equal to a chain hash, unique per parked sequence
    (``owner`` among this process's, the nonce among the processes sharing the tier)."""
    text = f"corekv-swap|{owner}|{block_index}|{num_computed}"
    return hashlib.blake2b(key.namespace + _process_nonce + text.encode(), digest_size=16).digest()


def _draw_process_nonce() -> None:
    global _process_nonce
    _process_nonce = os.urandom(16)


_process_nonce = b""
_draw_process_nonce()
# NOTE: a forked child shares the parent's memory, nonce included, and request ids and object
# addresses repeat across processes: without a fresh nonce two of them could park one key.
os.register_at_fork(after_in_child=_draw_process_nonce)
