"""Whole blocks between the KV pool and host buffers: snapshots out, tier reads in.

NOTE: on a CPU pool these are row-by-row numpy copies over a uint8 view of the block-major
storage: each block is one contiguous run of bytes, and torch's gathers and scatters
(``index_select``, ``index_copy_``) run far below memcpy for rows this wide (BENCHMARKS.md,
"Tier bandwidth").
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from corekv.hashing import BlockHash
from corekv.tier import Tier

__all__ = ["pool_rows", "snapshot_blocks", "load_into_pool", "write_rows"]


def pool_rows(pool) -> np.ndarray:
    """A CPU pool's storage as uint8 rows, one per block (a view: writes land in the pool)."""
    return pool.storage.view(pool.num_blocks, -1).view(torch.uint8).numpy()


def snapshot_blocks(pool, block_ids: Sequence[int]) -> torch.Tensor:
    """A CPU copy of blocks ``block_ids``: uint8 ``[len(block_ids), bytes_per_block]``."""
    if pool.storage.device.type != "cpu":
        return pool.read_blocks(list(block_ids)).to("cpu").view(torch.uint8).reshape(len(block_ids), -1)
    rows = pool_rows(pool)
    out = np.empty((len(block_ids), pool.bytes_per_block), dtype=np.uint8)
    for i, block_id in enumerate(block_ids):
        out[i] = rows[block_id]
    return torch.from_numpy(out)


def write_rows(pool, block_ids: Sequence[int], rows: torch.Tensor) -> None:
    """Copy host ``rows`` (uint8 ``[len(block_ids), bytes_per_block]``) into pool blocks
    ``block_ids``: row copies on a CPU pool (see the module note), one batched host-to-device
    ``write_blocks`` otherwise."""
    if pool.storage.device.type != "cpu":
        pool.write_blocks(list(block_ids), rows)
        return
    if rows.shape != (len(block_ids), pool.bytes_per_block) or rows.dtype != torch.uint8:
        raise ValueError(f"rows must be uint8 [{len(block_ids)}, {pool.bytes_per_block}], got "
                         f"{rows.dtype} {tuple(rows.shape)}; pass one staging row per block id")
    dst, src = pool_rows(pool), rows.numpy()
    for i, block_id in enumerate(block_ids):
        dst[block_id] = src[i]


def load_into_pool(pool, tier: Tier, keys: list[BlockHash], block_ids: list[int]) -> list[bool]:
    """``tier.get_into`` of ``keys`` into pool blocks ``block_ids``; the leading hits land in the
    pool. On a CPU pool the tier copies straight into the blocks (no staging buffer); otherwise
    through one pinned staging buffer and one batched host-to-device copy."""
    if pool.storage.device.type == "cpu":
        rows = pool_rows(pool)
        return tier.get_into(keys, [rows[b] for b in block_ids])
    staging = torch.empty((len(keys), pool.bytes_per_block), dtype=torch.uint8, pin_memory=True)
    flags = tier.get_into(keys, list(staging.numpy()))
    num_ok = next((i for i, ok in enumerate(flags) if not ok), len(flags))
    if num_ok:
        pool.write_blocks(block_ids[:num_ok], staging[:num_ok])
    return flags
