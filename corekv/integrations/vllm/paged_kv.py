"""vLLM's paged KV, per-layer tensors, seen as a pool of whole blocks (the pool protocol of
:mod:`corekv.offload.pool_io`), so the offload code moves vLLM's blocks as it moves corekv's.

vLLM gives one tensor per attention layer with the block index on one dimension (dim 0 on CPU:
``[num_blocks, kv_heads, block_size, 2 * head_size]``; dim 1 for the ``[2, num_blocks, ...]``
layouts of GPU backends). One corekv block is every layer's slice of one vLLM block, as raw
bytes: ``[num_layers, page_bytes]`` uint8, in the layer order vLLM registered. Copies are one
``index_select`` / ``index_copy_`` per layer per batch of blocks, never per token; bytes are
copied as they are, so the layout inside a block (the CPU kernel keeps K transposed) is vLLM's
business, and it is part of the model fingerprint (:mod:`corekv.integrations.vllm.settings`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from corekv.errors import ConfigError

__all__ = ["PagedKV"]


class PagedKV:
    """Whole blocks of vLLM's KV tensors, read and written as uint8 rows of every layer.

    Invariants: every layer tensor has ``num_blocks`` blocks on the same dimension and
    ``page_bytes`` bytes per block; the tensors are vLLM's own (writes land in vLLM's KV).
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int, page_bytes: int):
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors; the corekv connector needs the "
                              "model's attention KV")
        self.layer_names = list(kv_caches)
        self.layers = list(kv_caches.values())
        first = self.layers[0]
        self.device = first.device
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        self.block_dims = [self._block_dim(name, t, num_blocks, page_bytes) for name, t in kv_caches.items()]
        self.block_shape = (len(self.layers), page_bytes)
        self.bytes_per_block = len(self.layers) * page_bytes

    @staticmethod
    def _block_dim(name: str, tensor: torch.Tensor, num_blocks: int, page_bytes: int) -> int:
        # NOTE: the block index is dim 0 (CPU) or dim 1 (a K/V pair first); dim 0 wins a tie.
        for dim in (0, 1):
            if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
                per_block = tensor.numel() // num_blocks * tensor.element_size()
                if per_block == page_bytes:
                    return dim
        raise ConfigError(f"vLLM's KV tensor {name!r} has shape {tuple(tensor.shape)} ({tensor.dtype}); "
                          f"the corekv connector expects {num_blocks} blocks of {page_bytes} bytes on "
                          "dimension 0 or 1 (an attention layout it does not know)")

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``block_ids`` as uint8 ``[len(block_ids), num_layers, page_bytes]`` on the KV's device."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.empty((len(index), len(self.layers), self.page_bytes), dtype=torch.uint8, device=self.device)
        for layer, (kv, dim) in enumerate(zip(self.layers, self.block_dims)):
            rows = kv.index_select(dim, index).movedim(dim, 0).reshape(len(index), -1)
            out[:, layer] = rows.view(torch.uint8)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write uint8 rows (``[n, num_layers * page_bytes]`` or ``[n, num_layers, page_bytes]``,
        any device) into blocks ``block_ids``."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        rows = data.to(self.device, non_blocking=True).reshape(len(index), len(self.layers), self.page_bytes)
        for layer, (kv, dim) in enumerate(zip(self.layers, self.block_dims)):
            shape = kv.shape[:dim] + kv.shape[dim + 1:]
            blocks = rows[:, layer].contiguous().view(kv.dtype).reshape(len(index), *shape)
            kv.index_copy_(dim, index, blocks.movedim(0, dim))
