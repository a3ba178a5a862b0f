"""Whole blocks between the KV pool and host buffers: snapshots out, tier reads in, staging rows.

A pool is anything with ``num_blocks``, ``bytes_per_block``, ``block_shape``, ``device``,
``read_blocks(ids)`` and ``write_blocks(ids, data)`` (corekv's :class:`~corekv.engine.kv_pool.KVPool`,
or the connector's view of vLLM's paged KV). A pool whose ``storage`` is one block-major CPU
tensor is copied row by row instead.

NOTE: on a block-major CPU pool these are row-by-row numpy copies over a uint8 view of the block-major
storage: each block is one contiguous run of bytes, and torch's gathers and scatters
(``index_select``, ``index_copy_``) run far below memcpy for rows this wide (BENCHMARKS.md,
"Tier bandwidth").
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from corekv.hashing import BlockHash
from corekv.tier import Tier

__all__ = ["pool_rows", "snapshot_blocks", "load_into_pool", "write_rows", "StagingBuffers", "STAGED_BYTES"]


def pool_rows(pool) -> np.ndarray | None:
    """A block-major CPU pool's storage as uint8 rows, one per block (a view: writes land in the
    pool); ``None`` for any other pool."""
    storage = getattr(pool, "storage", None)
    if storage is None or storage.device.type != "cpu":
        return None
    return storage.view(pool.num_blocks, -1).view(torch.uint8).numpy()


def snapshot_blocks(pool, block_ids: Sequence[int]) -> torch.Tensor:
    """A CPU copy of blocks ``block_ids``: uint8 ``[len(block_ids), bytes_per_block]``."""
    rows = pool_rows(pool)
    if rows is None:
        return pool.read_blocks(list(block_ids)).to("cpu").view(torch.uint8).reshape(len(block_ids), -1)
    out = np.empty((len(block_ids), pool.bytes_per_block), dtype=np.uint8)
    for i, block_id in enumerate(block_ids):
        out[i] = rows[block_id]
    return torch.from_numpy(out)


def write_rows(pool, block_ids: Sequence[int], rows: torch.Tensor) -> None:
    """Copy host ``rows`` (uint8 ``[len(block_ids), bytes_per_block]``) into pool blocks
    ``block_ids``: row copies on a CPU pool (see the module note), one batched host-to-device
    ``write_blocks`` otherwise."""
    dst = pool_rows(pool)
    if dst is None:
        pool.write_blocks(list(block_ids), rows)
        return
    if rows.shape != (len(block_ids), pool.bytes_per_block) or rows.dtype != torch.uint8:
        raise ValueError(f"rows must be uint8 [{len(block_ids)}, {pool.bytes_per_block}], got "
                         f"{rows.dtype} {tuple(rows.shape)}; pass one staging row per block id")
    src = rows.numpy()
    for i, block_id in enumerate(block_ids):
        dst[block_id] = src[i]


#: bytes a load stages at a time into a CPU pool that is not block-major (vLLM's per-layer
#: tensors): each chunk's entries are scattered into the pool while the buffer is still in the
#: CPU's cache, and the one small buffer faults in once, not a whole prefix's worth per process
STAGED_BYTES = 8 << 20


def load_into_pool(pool, tier: Tier, keys: list[BlockHash], block_ids: list[int],
                   staging: StagingBuffers | None = None) -> list[bool]:
    """``tier.get_into`` of ``keys`` into pool blocks ``block_ids``; the leading hits land in the
    pool, and the flags after the first miss are False. On a block-major CPU pool the tier copies
    straight into the blocks (no staging buffer); otherwise through staging rows (pinned for an
    accelerator; lent by ``staging`` where given, so a CPU pool's rows are reused, not faulted in
    anew every load) and ``write_blocks``: one batch on an accelerator (one host-to-device copy),
    chunks of at most :data:`STAGED_BYTES` (at least one block) on a CPU."""
    rows = pool_rows(pool)
    if rows is not None:
        return tier.get_into(keys, [rows[b] for b in block_ids])
    per = len(keys) if pool.device.type != "cpu" else max(1, STAGED_BYTES // pool.bytes_per_block)
    flags: list[bool] = []
    while len(flags) < len(keys):
        start = len(flags)
        num = min(per, len(keys) - start)
        lent = staging.take(num) if staging is not None else torch.empty(
            (num, pool.bytes_per_block), dtype=torch.uint8, pin_memory=pool.device.type != "cpu")
        try:
            got = tier.get_into(keys[start:start + num], list(lent[:num].numpy()))
            num_ok = next((i for i, ok in enumerate(got) if not ok), num)
            if num_ok:
                pool.write_blocks(block_ids[start:start + num_ok], lent[:num_ok])
        finally:
            if staging is not None:
                staging.give_back(lent)
        flags += got[:num_ok]
        if num_ok < num:
            break
    return flags + [False] * (len(keys) - len(flags))


class StagingBuffers:
    """Host rows that prefetched blocks are staged in before admission copies them into ``pool``.

    :meth:`take` lends a uint8 ``[rows, bytes_per_block]`` tensor of at least the rows asked for
    (pinned for an accelerator); :meth:`give_back` returns it once nothing reads it any more. On
    a CPU pool the largest buffer given back is kept and lent whole to the next job it fits;
    otherwise every :meth:`take` allocates and a given-back buffer is dropped.

    Invariants: at most one buffer is kept, and it is never lent twice at once (a job that comes
    while it is lent, or needs more rows than it has, gets a fresh buffer); a kept buffer is at
    most as large as the largest one lent, so the host memory staging holds between jobs is
    bounded by the prefetch bound that sized the jobs. ``take`` and ``give_back`` may run on
    different threads.

    NOTE: a whole prefix's staging (94 MB for 2K tokens of SmolLM2 in float32) is far above
    glibc's mmap threshold, so a fresh buffer is mapped anew for every job, each of its 4 KiB
    pages faults in as the tier's bytes land in it, and it is unmapped at release: the faults
    cost several times the copy (BENCHMARKS.md, "Reload bandwidth at every size"). Keeping the
    pages takes each fault once. Only on a CPU pool: an accelerator's pinned staging is copied
    asynchronously (reusing it would race the copy) and torch's pinned-memory allocator already
    caches it with the copy's completion in mind.
    """

    def __init__(self, pool):
        self.bytes_per_block = pool.bytes_per_block
        self.is_pinned = pool.device.type != "cpu"
        self.is_recycled = not self.is_pinned
        self._kept: torch.Tensor | None = None
        self._lock = threading.Lock()

    def take(self, num_rows: int) -> torch.Tensor:
        """At least ``num_rows`` staging rows (their content is undefined)."""
        with self._lock:
            kept = self._kept
            if self.is_recycled and kept is not None and kept.shape[0] >= num_rows:
                self._kept = None
                return kept
        # NOTE: empty() does not fault the pages in; rows a job never reaches stay untouched.
        return torch.empty((num_rows, self.bytes_per_block), dtype=torch.uint8, pin_memory=self.is_pinned)

    def give_back(self, rows: torch.Tensor | None) -> None:
        """``rows`` (what :meth:`take` returned) are no longer read by anyone: keep them for reuse."""
        if rows is None or not self.is_recycled:
            return
        with self._lock:
            if self._kept is None or rows.shape[0] > self._kept.shape[0]:
                self._kept = rows

    def snapshot(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` for a reader that outlives the job (a queued tier write): a copy when the
        buffer will be lent again, else the rows themselves."""
        return rows.clone() if self.is_recycled else rows
