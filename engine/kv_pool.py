"""The device KV pool: preallocated K and V storage for every layer, addressed by block id.

One tensor holds everything, block-major::

    storage[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

NOTE: block-major (and not layer-major) because a block is the unit every tier moves: all of one
block's bytes, for every layer, are one contiguous run of memory, so ``read_blocks`` and
``write_blocks`` are a single gather/scatter along dim 0. Attention still reads one layer of a block
as one contiguous ``block_size * num_kv_heads * head_dim`` run (``layer_kv`` below), which is all a
paged gather needs.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from corekv.errors import CoreKVError

logger = logging.getLogger(__name__)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CoreKVError(f"KVPool: {name} must be a positive int, got {value!r}; pass a value >= 1")
    return value


class KVPool:
    """Fixed-size paged K/V storage for one model.

    Invariants: the storage is allocated once, in ``__init__``, and never resized or reallocated
    (views handed out by :meth:`layer_kv` stay valid for the pool's life); block ``b`` for layer
    ``l`` holds tokens ``b``'s owner placed there and nothing else; the pool does not track which
    blocks are in use (the prefix-cache backend owns residency).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = _positive_int("num_layers", num_layers)
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CoreKVError(f"KVPool: dtype must be a floating torch.dtype, got {dtype!r}; pass e.g. torch.float32")
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.storage = torch.zeros((num_blocks, *self.block_shape), dtype=dtype, device=self.device)
        # NOTE: built once: every layer of every step asks for its views, and slicing is not free
        self._layer_views = [(self.storage[:, i, 0], self.storage[:, i, 1]) for i in range(num_layers)]
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens capacity; %d bytes per token, %d bytes per block, %.1f MiB",
            num_blocks, block_size, self.capacity_tokens, self.bytes_per_token, self.bytes_per_block,
            num_blocks * self.bytes_per_block / 2**20,
        )

    # -- sizes ------------------------------------------------------------------------------------
    @staticmethod
    def compute_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token for every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.compute_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def num_blocks_for_memory(
        cls, memory_bytes: int, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in ``memory_bytes`` (raises if not even one does)."""
        _positive_int("memory_bytes", memory_bytes)
        per_block = cls.compute_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * block_size
        num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise CoreKVError(
                f"engine.kv_cache_memory={memory_bytes} bytes holds no block: one block of {block_size} tokens "
                f"needs {per_block} bytes; raise engine.kv_cache_memory or lower engine.block_size"
            )
        return int(num_blocks)

    # -- access for attention ---------------------------------------------------------------------
    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._layer_views[layer_idx]

    # -- whole-block moves (tiers, copy-on-write) -------------------------------------------------
    def read_blocks(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Copy blocks out: ``[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]``,
        contiguous, so row ``i`` is block ``block_ids[i]``'s bytes ready to store
        (``row.view(torch.uint8)`` or ``row.numpy()``)."""
        index = self._index("block_ids", block_ids)
        return self.storage.index_select(0, index)

    def write_blocks(self, block_ids: Sequence[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Copy blocks in: ``data`` as returned by :meth:`read_blocks` (any device; same dtype and
        shape ``[len(block_ids), *block_shape]``, or the same bytes as uint8)."""
        index = self._index("block_ids", block_ids)
        expected = (len(index), *self.block_shape)
        if not isinstance(data, torch.Tensor):
            raise CoreKVError(f"KVPool.write_blocks: data must be a torch.Tensor, got {type(data).__name__}")
        if data.dtype == torch.uint8 and self.dtype != torch.uint8:
            if data.numel() != len(index) * self.bytes_per_block:
                raise CoreKVError(
                    f"KVPool.write_blocks: data has {data.numel()} bytes, expected {len(index)} blocks x "
                    f"{self.bytes_per_block} bytes; pass bytes produced by read_blocks of the same pool layout"
                )
            data = data.contiguous().view(self.dtype)
        if data.dtype != self.dtype or data.numel() != len(index) * self.bytes_per_block // self.storage.element_size():
            raise CoreKVError(
                f"KVPool.write_blocks: data is {data.dtype} {tuple(data.shape)}, expected {self.dtype} {expected}; "
                "pass the tensor read_blocks returned"
            )
        self.storage.index_copy_(0, index, data.reshape(expected).to(self.device, non_blocking=True))

    def copy_blocks(self, src_ids: Sequence[int] | torch.Tensor, dst_ids: Sequence[int] | torch.Tensor) -> None:
        """Copy every layer's K/V of ``src_ids[i]`` onto ``dst_ids[i]`` (copy-on-write)."""
        src = self._index("src_ids", src_ids)
        dst = self._index("dst_ids", dst_ids)
        if len(src) != len(dst):
            raise CoreKVError(
                f"KVPool.copy_blocks: src_ids has {len(src)} ids but dst_ids has {len(dst)}; pass equal lengths"
            )
        # NOTE: gather first, then scatter, so overlapping src/dst sets copy the old contents.
        self.storage.index_copy_(0, dst, self.storage.index_select(0, src))

    def _index(self, name: str, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(block_ids, dtype=torch.long)
        if index.dim() != 1:
            raise CoreKVError(f"KVPool: {name} must be a flat sequence of block ids, got shape {tuple(index.shape)}")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise CoreKVError(
                f"KVPool: {name} contains ids outside [0, {self.num_blocks}): min {int(index.min())}, "
                f"max {int(index.max())}; pass block ids the backend allocated from this pool"
            )
        return index.to(self.device)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now (None when unknown): CUDA's free memory, or
    on CPU the kernel's MemAvailable (Linux; elsewhere the free physical pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
