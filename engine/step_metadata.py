"""What one forward of the model runner computes: the flattened batch's layout, read by every layer.

:class:`corekv.engine.model_runner.ModelRunner` builds one :class:`AttentionMetadata` per step
and :mod:`corekv.engine.attention` reads it in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from corekv.engine.kv_pool import KVPool
from corekv.engine.cpu.native import NativeKernels


@dataclass
class PrefillSlice:
    """One prefill chunk inside the flattened batch: tokens ``[token_start, token_end)`` sit at
    positions ``start_pos ..`` of their sequence, whose first ``context_len`` positions (cached
    ones included) are in ``block_table`` after this step's write."""

    token_start: int
    token_end: int
    start_pos: int
    context_len: int
    #: long [num_blocks covering context_len] (unused when start_pos == 0)
    block_table: torch.Tensor
    #: additive (0 / -inf) [1, 1, num_tokens, context_len]; None when start_pos == 0 (plain causal)
    mask: torch.Tensor | None


@dataclass
class PrefillGroup:
    """``num_chunks`` prefill chunks of equal length, adjacent in the flattened batch (tokens
    ``[token_start, token_end)``), each starting right after the same cached ``shared_blocks``.

    Their queries attend the shared blocks in one call, and each chunk attends itself causally in
    one batched call; the two partial results merge through their log-sum-exps (as for decodes).
    """

    token_start: int
    token_end: int
    num_chunks: int
    #: long [num_shared_blocks]
    shared_blocks: torch.Tensor


@dataclass
class ShortChunkGroup:
    """``num_chunks`` prefill chunks of ``chunk_len`` tokens each (2 .. ``SHORT_CHUNK_MAX_TOKENS``,
    e.g. a decode and the drafts it verifies), adjacent in the flattened batch (tokens
    ``[token_start, token_end)``), each after its own context: one padded call like a decode
    group's, instead of one masked call per chunk.

    Invariant: chunk ``c``'s query heads of KV head ``h`` are rows ``(t, g)`` (token ``t``, query
    head ``h * G + g``) of ``mask[c, 0]``, which hides the padding and each token's later ones.
    """

    token_start: int
    token_end: int
    num_chunks: int
    chunk_len: int
    #: long [chunks, num_blocks] (padded with block 0)
    block_tables: torch.Tensor
    #: additive (0 / -inf) [chunks, 1, chunk_len * G, num_blocks * block_size]
    mask: torch.Tensor


@dataclass
class PrefillBatch:
    """Every prefill chunk of the step, for the native kernel (one call per layer): chunk ``c``'s
    queries are the prefill tokens ``query_starts[c] .. query_starts[c + 1] - 1`` (counted after the
    decodes), at positions ``start_pos[c] ..``, attending causally over their sequence's blocks."""

    #: long [chunks, max_blocks], each row covering its chunk's context (padded with block 0)
    block_tables: torch.Tensor
    #: long [chunks + 1]
    query_starts: torch.Tensor
    #: long [chunks]
    start_pos: torch.Tensor


@dataclass
class DecodeGroup:
    """Decode rows ``[row_start, row_end)`` of the flattened batch (one token each).

    Invariants: row ``r``'s blocks are ``shared_blocks`` (blocks every row of the group starts
    with, or None) followed by its row of ``block_tables``; rows are padded with block 0 and the
    padding is masked out by the additive ``mask`` (0 / -inf; None when every row is exactly full,
    or when the native kernel bounds each row by ``context_lens`` instead); each row holds at least
    the block of its query token.
    """

    row_start: int
    row_end: int
    #: long [rows, num_blocks]
    block_tables: torch.Tensor
    #: additive [rows, 1, 1, num_blocks * block_size] or None
    mask: torch.Tensor | None = None
    #: long [num_shared_blocks] or None
    shared_blocks: torch.Tensor | None = None
    #: long [rows]: each row's tokens in its ``block_tables`` row (the native kernel's bound)
    context_lens: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-forward description of the batch; built once per step, read by every layer.

    Invariants: ``slot_block_ids[t], slot_offsets[t]`` is token ``t``'s slot; decode tokens come
    first, and ``decode_groups`` cover rows ``0 .. num_decode_tokens - 1`` exactly once, in order.
    """

    kv_pool: KVPool
    slot_block_ids: torch.Tensor
    slot_offsets: torch.Tensor
    num_decode_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    #: the prefill chunks after the decodes: first the groups', then the short chunks' groups,
    #: then each remaining one's slice (torch path), or all of them as one batch (native path)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    #: then the short chunks' groups (torch path)
    short_groups: list[ShortChunkGroup] = field(default_factory=list)
    prefills: list[PrefillSlice] = field(default_factory=list)
    prefill_batch: PrefillBatch | None = None
    #: reusable gather buffers by name (owned by the runner, kept across steps; see ``_gather``)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the native attention kernels (:mod:`corekv.engine.cpu.native`), or None for the torch path
    native: NativeKernels | None = None
    #: attention calls seen this forward; the runner checks it equals the number of layers, so a
    #: model that bypasses the AttentionInterface fails loudly instead of leaving the pool unwritten
    num_layer_calls: int = 0
