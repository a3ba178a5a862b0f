"""``host``: KV blocks in one preallocated arena of CPU memory (pinned when CUDA is present)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from corekv.errors import ConfigError
from corekv.eviction import EvictionPolicy, make_policy
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier


class HostTier(Tier):
    """A cache of entries in ``size // entry_bytes`` fixed slots of one uint8 arena.

    Invariants: ``key_to_slot`` and ``free_slots`` partition the slots; every key of
    ``key_to_slot`` is a candidate of the eviction queue (``get`` hits and re-``put`` are uses),
    which a full arena pops for the slot to reuse (LRU by default, :mod:`corekv.eviction`);
    memory is allocated once at construction and never grows.
    """

    supports_listing = True
    # NOTE: swap parks blocks synchronously on the step's thread and must get the same bytes back;
    # an in-process arena copy is both (an evicted parked block is a miss: recomputed, never wrong)
    supports_swap = True
    keeps_priorities = True

    def __init__(self, *, size: int, block_bytes: int, fingerprint: bytes, dtype: str = "uint8",
                 shape: Sequence[int] | None = None, name: str | None = None,
                 pin_memory: bool | None = None, eviction: str | EvictionPolicy | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "host")
        entry_bytes = self.codec.entry_bytes
        if not isinstance(size, int) or size < entry_bytes:
            raise ConfigError(f"size must be at least one block entry ({entry_bytes} bytes), got "
                              f"{size!r}; raise cache.tiers[].size for the host tier (e.g. 2GiB)", path="size")
        self.num_slots = size // entry_bytes
        import torch  # NOTE: here, not at the top: listing plugins or reading a config imports no torch

        if pin_memory is None:
            # NOTE: pinned pages make host->device copies async and about twice as fast, but
            # pinning without CUDA fails, so it follows the accelerator's presence.
            pin_memory = torch.cuda.is_available()
        self.is_pinned = pin_memory
        self.arena = torch.empty((self.num_slots, entry_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        # NOTE: numpy views of the same memory make the per-slot copies cheap (no torch dispatch).
        self._rows = self.arena.numpy()
        self.key_to_slot: dict[BlockHash, int] = {}
        self.eviction = make_policy(eviction)
        self._queue = self.eviction.make_queue()
        self.free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self.slot_lengths = [0] * self.num_slots

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.codec.entry_bytes

    @property
    def used_bytes(self) -> int:
        return len(self.key_to_slot) * self.codec.entry_bytes

    @property
    def num_entries(self) -> int:
        return len(self.key_to_slot)

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            return iter(list(self.key_to_slot))

    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        entries: list[bytes | None] = []
        touch = self._queue.touch
        for key in keys:
            slot = self.key_to_slot.get(key)
            if slot is None:
                entries.append(None)
                continue
            touch(key)
            # NOTE: a copy, not a view: the slot may be reused by the next put while the caller
            # still holds the payload.
            entries.append(self._rows[slot, :self.slot_lengths[slot]].tobytes())
        return entries

    def _visit_entries(self, keys: list[BlockHash], visit) -> None:
        # NOTE: views straight into the arena are safe here: the caller holds the tier's lock,
        # so no put can reuse a slot before visit() has copied them out.
        found = []
        touch = self._queue.touch
        for index, key in enumerate(keys):
            slot = self.key_to_slot.get(key)
            if slot is not None:
                touch(key)
                found.append((index, self._rows[slot, :self.slot_lengths[slot]]))
        visit(found)

    def _write_entries(self, items, priorities=None) -> int:
        queue = self._queue
        for index, (key, parts) in enumerate(items):
            # NOTE: the queue keeps the highest priority a key was written with (store_many
            # only raises it): a block's priority is already the highest of the requests that
            # used it, and a later write from a device that saw fewer of them must not demote it
            if priorities is not None and priorities[index]:
                queue.store_many((key,), priorities[index])
            slot = self.key_to_slot.get(key)
            if slot is not None:
                queue.touch(key)
                continue
            slot = self._take_slot()
            row = self._rows[slot]
            offset = 0
            for part in parts:
                view = np.frombuffer(part, dtype=np.uint8)[:row.size - offset]
                row[offset:offset + view.size] = view
                offset += view.size
            # NOTE: the stored length is kept so that a short (malformed) entry reads back short
            # and fails as truncated, instead of as zero padding.
            self.slot_lengths[slot] = offset
            self.key_to_slot[key] = slot
            queue.add(key)
            self._stats["puts"] += 1
            self._stats["bytes_written"] += offset
        return len(items)

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        return [key in self.key_to_slot for key in keys]

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        for key in keys:
            slot = self.key_to_slot.pop(key, None)
            if slot is not None:
                self.free_slots.append(slot)
                self._queue.discard(key)

    def _take_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        slot = self.key_to_slot.pop(self._queue.pop())
        self._stats["evictions"] += 1
        return slot

    def _close(self) -> None:
        self.key_to_slot.clear()
        self._queue.clear()
        self.free_slots = []
        self._rows = None
        self.arena = None


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="host",
        factory=HostTier,
        options={
            "size": Option("size", help="bytes of CPU memory for the arena, e.g. 2GiB", minimum=1),
            "eviction": Option("eviction", default="lru", help=(
                "which entry a full arena drops first: lru, lfu, priority (the lowest priority "
                "of the requests that used a block first, ties lru), a plugin's policy")),
        },
        description="KV blocks in one preallocated (pinned when CUDA is present) CPU arena, LRU by default",
    )]
