"""vLLM's paged KV, per-layer tensors, seen as a pool of whole blocks (the pool protocol of
:mod:`corekv.offload.pool_io`), so the offload code moves vLLM's blocks as it moves corekv's.

vLLM gives one tensor per attention layer with the block index on one dimension (dim 0 on CPU:
``[num_blocks, kv_heads, block_size, 2 * head_size]``; dim 1 for the ``[2, num_blocks, ...]``
layouts of GPU backends). One corekv block is every layer's slice of one vLLM block, as raw
bytes: ``[num_layers, page_bytes]`` uint8, in the layer order vLLM registered. Bytes are copied
as they are, so the layout inside a block (the CPU kernel keeps K transposed) is vLLM's
business, and it is part of the model fingerprint (:mod:`corekv.integrations.vllm.settings`).

Copies are never per token. Where every layer is a contiguous CPU tensor with blocks on dim 0
(vLLM's CPU build), a layer's block is one run of ``page_bytes`` bytes, and a batch is copied
with one numpy copy per layer per run of consecutive block ids; otherwise with one
``index_select`` / ``index_copy_`` per layer per batch.

NOTE: on CPU, torch's gather and scatter of rows this wide run well below memcpy, and the
``index_copy_`` path copies each layer twice (its strided slice made contiguous first):
BENCHMARKS.md, "vLLM connector: TTFT of a reloaded prefix".
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from corekv.errors import ConfigError

__all__ = ["PagedKV"]


class PagedKV:
    """Whole blocks of vLLM's KV tensors, read and written as uint8 rows of every layer.

    Invariants: every layer tensor has ``num_blocks`` blocks on the same dimension and
    ``page_bytes`` bytes per block; the tensors are vLLM's own (writes land in vLLM's KV), and
    ``layer_rows``, where set, are views of those same tensors.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int, page_bytes: int,
                 block_size: int):
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors; the corekv connector needs the "
                              "model's attention KV")
        self.layer_names = list(kv_caches)
        self.layers = list(kv_caches.values())
        first = self.layers[0]
        self.device = first.device
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per block (vLLM's --block-size)
        self.page_bytes = page_bytes
        self.block_dims = [self._block_dim(name, t, num_blocks, page_bytes) for name, t in kv_caches.items()]
        self.block_shape = (len(self.layers), page_bytes)
        self.bytes_per_block = len(self.layers) * page_bytes
        #: per layer, its blocks as uint8 rows (numpy views of vLLM's tensors: writes land in
        #: vLLM's KV), where every layer is contiguous on the CPU with blocks on dim 0; else None
        self.layer_rows: list[np.ndarray] | None = None
        if all(t.device.type == "cpu" and t.is_contiguous() and d == 0 for t, d in zip(self.layers, self.block_dims)):
            self.layer_rows = [t.view(torch.uint8).view(num_blocks, page_bytes).numpy() for t in self.layers]

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
        if self.layer_rows is not None:
            out = np.empty((len(block_ids), len(self.layers), self.page_bytes), dtype=np.uint8)
            for row, first, num in _runs(block_ids):
                for layer, rows in enumerate(self.layer_rows):
                    out[row:row + num, layer] = rows[first:first + num]
            return torch.from_numpy(out)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.empty((len(index), len(self.layers), self.page_bytes), dtype=torch.uint8, device=self.device)
        for layer, (kv, dim) in enumerate(zip(self.layers, self.block_dims)):
            rows = kv.index_select(dim, index).movedim(dim, 0).reshape(len(index), -1)
            out[:, layer] = rows.view(torch.uint8)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write uint8 rows (``[n, num_layers * page_bytes]`` or ``[n, num_layers, page_bytes]``,
        any device) into blocks ``block_ids``."""
        if self.layer_rows is not None:
            src = data.to("cpu").reshape(len(block_ids), len(self.layers), self.page_bytes).numpy()
            for row, first, num in _runs(block_ids):
                for layer, rows in enumerate(self.layer_rows):
                    rows[first:first + num] = src[row:row + num, layer]
            return
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        rows = data.to(self.device, non_blocking=True).reshape(len(index), len(self.layers), self.page_bytes)
        for layer, (kv, dim) in enumerate(zip(self.layers, self.block_dims)):
            shape = kv.shape[:dim] + kv.shape[dim + 1:]
            blocks = rows[:, layer].contiguous().view(kv.dtype).reshape(len(index), *shape)
            kv.index_copy_(dim, index, blocks.movedim(0, dim))


def _runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(position in block_ids, first block id, length)`` of each run of consecutive block ids."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield start, block_ids[start], i - start
            start = i
