"""The model runner: one forward over a mixed batch of prefill chunks and decode tokens.

The scheduler hands over :class:`ScheduledChunk` s; the runner flattens them into one
``[1, T]`` batch (decodes first, see :mod:`corekv.engine.attention`), builds the per-step
:class:`~corekv.engine.step_metadata.AttentionMetadata` with a few vectorised ops, runs the HF model
once, and returns the logits of each chunk's last token.
"""
from __future__ import annotations

import sys

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from os.path import commonprefix

import torch

from corekv.errors import CoreKVError
from corekv.engine.attention import ATTENTION_NAME, forward_context
from corekv.engine.step_metadata import (AttentionMetadata, DecodeGroup, PrefillBatch, PrefillGroup, PrefillSlice,
                                         ShortChunkGroup)
from corekv.engine.cpu.elementwise import use_native_elementwise
from corekv.engine.cpu.linears import use_native_linears
from corekv.engine.kv_pool import KVPool
from corekv.engine.models import LoadedModel
from corekv.engine.cpu.native import NATIVE_DTYPES, load_native_attention


@dataclass
class ScheduledChunk:
    """Tokens ``token_ids`` at positions ``start_pos .. start_pos + len - 1`` of one sequence.

    The KV of positions ``< start_pos`` is already in the pool through ``block_table``, and
    ``block_table`` covers every position of the chunk (it may be longer).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    #: logits rows wanted: those of the chunk's last ``num_logits`` tokens (a speculative
    #: verification needs one per draft token, plus one)
    num_logits: int = 1


#: decodes (or equal prefill chunks) sharing leading blocks take the cascade path only when it saves
#: gathering (or, natively, reading) at least this many tokens' KV per layer, i.e. (rows - 1) *
#: shared tokens.
#: NOTE: a cascade costs an extra attention call and the merge, which a small saving does not pay
#: for; the threshold is the torch path's measured break-even (BENCHMARKS.md, "decode cascade only
#: when it saves >= 1,024 tokens of gathering"), where the saving is a gather. The native decode
#: kernel reads blocks in place and needs no cascade (see ModelRunner).
CASCADE_MIN_SAVED_TOKENS = 1024
#: prefill chunks of at most this many tokens after some context (a decode and its drafts) share one
#: padded attention call per length (:class:`ShortChunkGroup`) instead of a masked call each
#: NOTE: a speculative step verifies one such chunk per decoding sequence; one call per chunk per
#: layer would cost more than the drafts save on a large batch
SHORT_CHUNK_MAX_TOKENS = 32


class ModelRunner:
    """Runs a :class:`LoadedModel` over a :class:`KVPool` (shapes, dtype and device must match).

    Invariant: :meth:`execute` writes exactly the chunks' slots of the pool and reads only
    blocks named in the chunks' block tables.
    """

    def __init__(self, loaded: LoadedModel, kv_pool: KVPool, *,
                 cascade_min_saved_tokens: int | None = None, compile: bool = False,
                 native: bool | None = None) -> None:
        if cascade_min_saved_tokens is not None and (
                not isinstance(cascade_min_saved_tokens, int) or isinstance(cascade_min_saved_tokens, bool)
                or cascade_min_saved_tokens < 0):
            raise CoreKVError(f"ModelRunner: cascade_min_saved_tokens must be None or an int >= 0, got "
                              f"{cascade_min_saved_tokens!r}; 0 takes the cascade path for any shared block")
        expected = (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device)
        got = (kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype, kv_pool.device)
        if expected != got:
            raise CoreKVError(
                f"ModelRunner: kv_pool (layers, kv heads, head_dim, dtype, device) = {got} does not match the "
                f"model's {expected}; build the KVPool from the LoadedModel's fields"
            )
        if loaded.hf_config._attn_implementation != ATTENTION_NAME:
            loaded.model.set_attn_implementation(ATTENTION_NAME)
        self.loaded = loaded
        self.model = loaded.model
        self.kv_pool = kv_pool
        self.block_size = kv_pool.block_size
        self.device = kv_pool.device
        self._gather_buffers: dict[str, torch.Tensor] = {}
        self._queries_per_kv_head = loaded.hf_config.num_attention_heads // loaded.num_kv_heads
        if not isinstance(compile, bool):
            raise CoreKVError(f"ModelRunner: compile must be True or False, got {compile!r}")
        # NOTE: torch.compile wraps the model without changing it (a LoadedModel may be shared, and
        # model.generate keeps running it eagerly); dynamic shapes, so steps of any size share a graph
        # (with the native float32 linears: one graph for decode-sized steps, one for the rest;
        # bfloat16 linears choose their kernel inside their op, so bfloat16 keeps one graph).
        self._forward = torch.compile(self.model, dynamic=True) if compile else self.model
        # NOTE: on CPU the native kernels (attention; linears of decode-sized steps) run when asked, by
        # default when compiled: both build C++ for this machine (load_native_attention raises
        # NativeBuildError)
        native_ok = self.device.type == "cpu" and kv_pool.dtype in NATIVE_DTYPES
        if native is None:
            native = compile and native_ok
        if not isinstance(native, bool) or (native and not native_ok):
            raise CoreKVError(
                f"ModelRunner: native must be True, False or None, and True only for a CPU pool of "
                f"{' or '.join(map(str, NATIVE_DTYPES))}; got {native!r} for a {kv_pool.dtype} pool "
                f"on {self.device}: pass native=False (or None) there")
        self._native = load_native_attention() if native else None
        # NOTE: by default (None) the native runner's decodes take no cascade: the kernel reads a
        # shared prefix's blocks in place, row after row of a KV head while they are in cache, which
        # costs less than a separate attention call over them and the merge (BENCHMARKS.md, "Session
        # 19"); the torch path's threshold is a gather's break-even.
        if cascade_min_saved_tokens is None:
            cascade_min_saved_tokens = sys.maxsize if self._native is not None else CASCADE_MIN_SAVED_TOKENS
        self._cascade_min_saved_blocks = -(-cascade_min_saved_tokens // self.block_size)
        if self._native is not None:
            use_native_linears(self.model, self._native)
            use_native_elementwise(self.model)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(chunks), vocab]`` of each chunk's last token
        (with ``num_logits > 1`` chunks: ``[sum of num_logits, vocab]``, each chunk's rows together,
        in chunk order, its tokens in position order)."""
        if not chunks:
            raise CoreKVError("ModelRunner.execute: chunks is empty; schedule at least one chunk")
        self._validate(chunks)
        # NOTE: single-token chunks (decodes, or a 1-token prompt) go first, grouped by shared
        # leading blocks, so each group is one batched attention call; `order` maps the runner's
        # layout back to the caller's order.
        bs = self.block_size
        decode_ids = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        groups = cascade_groups([chunks[i].block_table[:chunks[i].start_pos // bs + 1] for i in decode_ids],
                                min_saved_blocks=self._cascade_min_saved_blocks)
        order = [decode_ids[row] for rows, _ in groups for row in rows]
        prefill_groups, plain_prefills = self._prefill_groups(chunks)
        short_groups, plain_prefills = self._short_groups(chunks, plain_prefills)
        order += [i for ids, _ in prefill_groups for i in ids] + [i for ids in short_groups for i in ids] + plain_prefills
        ordered = [chunks[i] for i in order]
        meta, input_ids, positions, last_index = self._prepare(ordered, [(len(rows), n) for rows, n in groups],
                                                               [(len(ids), n) for ids, n in prefill_groups],
                                                               [len(ids) for ids in short_groups])
        with forward_context(meta):
            out = self._forward(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                logits_to_keep=last_index)
        if meta.num_layer_calls != self.loaded.num_layers:
            raise CoreKVError(
                f"{type(self.model).__name__} ran corekv's paged attention in {meta.num_layer_calls} of "
                f"{self.loaded.num_layers} layers; its modeling code bypasses transformers' AttentionInterface, "
                "so corekv cannot serve it: use a model whose attention dispatches through the interface"
            )
        logits = out.logits[0].float()
        if len(logits) != len(chunks):
            return logits[_caller_rows([c.num_logits for c in ordered], order).to(logits.device)]
        result = torch.empty_like(logits)
        result[torch.tensor(order, device=logits.device)] = logits
        return result

    def warm_up(self) -> None:
        """Run the step shapes a compiled forward specialises on (1 token; 2 or more; 128 or more,
        where bfloat16 linears switch kernels; one logit row or several) through the model once, so
        compiling happens now rather than in the first requests. Writes only into blocks 0.. of
        the pool, so call it before the pool holds KV anyone will read (as the engine does)."""
        bs = self.block_size
        max_blocks = min(self.kv_pool.num_blocks, -(-256 // bs))
        if max_blocks < 2:
            return  # too small a pool to stage the shapes; the first steps compile instead
        room = max_blocks * bs // 2  # tokens per chunk when two chunks share the staged blocks
        blocks = list(range(max_blocks))
        half = max_blocks // 2
        for lengths in ((1,), (1, 1), (2,), (min(room, 200),), (min(room, 100), min(room, 100))):
            tables = [blocks[:half], blocks[half:]] if len(lengths) == 2 else [blocks]
            self.execute([ScheduledChunk([0] * n, 0, table) for n, table in zip(lengths, tables)])

    def _prefill_groups(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[tuple[list[int], int]], list[int]]:
        """``([(chunk ids, num_shared_blocks)], other prefill ids)``: prefill chunks of the same length
        that start right after the same cached blocks form a group (see :class:`PrefillGroup`) when
        that saves gathering at least the cascade threshold; the others keep their own masked call.
        The native kernel takes every chunk as it comes (it reads shared blocks in place)."""
        bs = self.block_size
        if self._native is not None:
            return [], [i for i, chunk in enumerate(chunks) if len(chunk.token_ids) > 1]
        by_key: dict[tuple, list[int]] = {}
        plain = []
        for i, chunk in enumerate(chunks):
            if len(chunk.token_ids) == 1:
                continue
            if chunk.start_pos and chunk.start_pos % bs == 0:
                by_key.setdefault((tuple(chunk.block_table[:chunk.start_pos // bs]), len(chunk.token_ids)), []).append(i)
            else:
                plain.append(i)
        groups = []
        for (shared, _), ids in by_key.items():
            if len(ids) > 1 and (len(ids) - 1) * len(shared) >= self._cascade_min_saved_blocks:
                groups.append((ids, len(shared)))
            else:
                plain += ids
        return groups, sorted(plain)

    def _short_groups(self, chunks: Sequence[ScheduledChunk], plain: list[int]) -> tuple[list[list[int]], list[int]]:
        """``(groups of chunk ids, the other plain ids)``: the plain prefill chunks of 2 ..
        ``SHORT_CHUNK_MAX_TOKENS`` tokens after some context, grouped by length (torch path only:
        the native kernel takes every chunk in one call anyway)."""
        if self._native is not None:
            return [], plain
        by_length: dict[int, list[int]] = {}
        rest = []
        for i in plain:
            n = len(chunks[i].token_ids)
            if chunks[i].start_pos and n <= SHORT_CHUNK_MAX_TOKENS:
                by_length.setdefault(n, []).append(i)
            else:
                rest.append(i)
        return list(by_length.values()), rest

    def _prepare(self, chunks: list[ScheduledChunk], group_sizes: list[tuple[int, int]],
                 prefill_group_sizes: list[tuple[int, int]], short_group_sizes: list[int]):
        bs, device = self.block_size, self.device
        lengths = [len(c.token_ids) for c in chunks]
        starts = [c.start_pos for c in chunks]
        num_blocks = [(s + n + bs - 1) // bs for s, n in zip(starts, lengths)]
        tables = [c.block_table[:nb] for c, nb in zip(chunks, num_blocks)]
        # Per-token positions and slots, vectorised over the whole batch.
        lengths_t = torch.tensor(lengths)
        chunk_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lengths_t)
        token_starts = torch.cumsum(lengths_t, 0) - lengths_t
        positions = torch.tensor(starts)[chunk_of_token] + torch.arange(int(lengths_t.sum())) - token_starts[chunk_of_token]
        nb_t = torch.tensor(num_blocks)
        flat_tables = torch.tensor(list(chain.from_iterable(tables)), dtype=torch.long)
        table_bases = torch.cumsum(nb_t, 0) - nb_t
        slot_block_ids = flat_tables[table_bases[chunk_of_token] + positions // bs]

        num_decode = sum(1 for n in lengths if n == 1)
        decode_groups, row = [], 0
        for num_rows, num_shared in group_sizes:
            decode_groups.append(self._decode_group(row, tables[row:row + num_rows], starts[row:row + num_rows],
                                                    num_shared))
            row += num_rows
        prefill_groups, first_plain = [], num_decode
        for num_chunks, num_shared in prefill_group_sizes:
            begin = int(token_starts[first_plain])
            prefill_groups.append(PrefillGroup(
                begin, begin + num_chunks * lengths[first_plain], num_chunks,
                torch.tensor(tables[first_plain][:num_shared], dtype=torch.long, device=device)))
            first_plain += num_chunks
        short_groups = []
        for num_chunks in short_group_sizes:
            short_groups.append(self._short_group(int(token_starts[first_plain]), tables[first_plain:first_plain + num_chunks],
                                                  starts[first_plain:first_plain + num_chunks], lengths[first_plain]))
            first_plain += num_chunks
        prefill_batch = None
        if self._native is not None and first_plain < len(chunks):  # one native call for them all
            prefill_batch = self._prefill_batch(tables, lengths, starts, first_plain)
            prefills = []
        else:
            prefills = self._prefill_slices(tables, lengths, starts, token_starts, first_plain)
        meta = AttentionMetadata(
            kv_pool=self.kv_pool,
            slot_block_ids=slot_block_ids.to(device),
            slot_offsets=(positions % bs).to(device),
            num_decode_tokens=num_decode,
            decode_groups=decode_groups,
            prefill_groups=prefill_groups,
            short_groups=short_groups,
            prefills=prefills,
            prefill_batch=prefill_batch,
            buffers=self._gather_buffers,
            native=self._native,
        )
        input_ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)), dtype=torch.long)
        last_index = torch.cumsum(lengths_t, 0) - 1
        if any(c.num_logits != 1 for c in chunks):
            last_index = torch.cat([torch.arange(int(end) - c.num_logits + 1, int(end) + 1)
                                    for c, end in zip(chunks, last_index)])
        return meta, input_ids.to(device), positions.to(device), last_index.to(device)

    def _prefill_batch(self, tables, lengths, starts, first: int) -> PrefillBatch:
        """Chunks ``first ..`` (the prefills) as one :class:`PrefillBatch` for the native kernel."""
        rest = range(first, len(tables))
        width = max(len(tables[i]) for i in rest)
        padded = [tables[i] + [0] * (width - len(tables[i])) for i in rest]
        query_starts = torch.cumsum(torch.tensor([0] + [lengths[i] for i in rest]), 0)
        return PrefillBatch(torch.tensor(padded, dtype=torch.long), query_starts,
                            torch.tensor([starts[i] for i in rest]))

    def _prefill_slices(self, tables, lengths, starts, token_starts, first: int) -> list[PrefillSlice]:
        """Chunks ``first ..`` (the prefills outside groups), each with its own masked SDPA call."""
        device = self.device
        prefills = []
        for i in range(first, len(tables)):
            start, n = starts[i], lengths[i]
            mask = None
            if start:
                query_pos = torch.arange(start, start + n)
                mask = self._additive_mask(torch.arange(start + n)[None] > query_pos[:, None])[None, None].to(device)
            begin = int(token_starts[i])
            prefills.append(PrefillSlice(begin, begin + n, start, start + n,
                                         torch.tensor(tables[i], dtype=torch.long, device=device), mask))
        return prefills

    def _short_group(self, token_start: int, tables: list[list[int]], starts: list[int], chunk_len: int) -> ShortChunkGroup:
        """One :class:`ShortChunkGroup`: padded block tables and the mask of its ``(t, g)`` rows."""
        bs, device = self.block_size, self.device
        max_blocks = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        last_visible = torch.tensor(starts)[:, None] + torch.arange(chunk_len)[None]  # [chunks, t]
        mask = self._additive_mask(torch.arange(max_blocks * bs)[None, None] > last_visible[:, :, None])
        mask = mask.repeat_interleave(self._queries_per_kv_head, dim=1)[:, None]
        return ShortChunkGroup(token_start, token_start + len(tables) * chunk_len, len(tables), chunk_len,
                               padded.to(device), mask.to(device))

    def _additive_mask(self, hidden: torch.Tensor) -> torch.Tensor:
        """0 where ``hidden`` is False, -inf where True, in the pool's dtype.

        NOTE: additive and built once per step: SDPA converts a boolean mask to this in every layer.
        """
        return torch.zeros(hidden.shape, dtype=self.kv_pool.dtype).masked_fill_(hidden, float("-inf"))

    def _decode_group(self, row_start: int, tables: list[list[int]], starts: list[int], num_shared: int) -> DecodeGroup:
        """Padded block tables (after the shared blocks) and additive padding mask of one group."""
        bs, device = self.block_size, self.device
        max_blocks = max(len(t) for t in tables) - num_shared
        padded = torch.tensor([t[num_shared:] + [0] * (max_blocks + num_shared - len(t)) for t in tables],
                              dtype=torch.long)
        context = torch.tensor(starts) + 1 - num_shared * bs
        mask = None
        if self._native is None and bool((context != max_blocks * bs).any()):  # native: bound by context
            mask = self._additive_mask(torch.arange(max_blocks * bs)[None] >= context[:, None])[:, None, None].to(device)
        shared = torch.tensor(tables[0][:num_shared], dtype=torch.long, device=device) if num_shared else None
        return DecodeGroup(row_start, row_start + len(tables), padded.to(device), mask, shared, context.to(device))

    def _validate(self, chunks: list[ScheduledChunk]) -> None:
        bs, num_blocks = self.block_size, self.kv_pool.num_blocks
        for chunk in chunks:
            if not isinstance(chunk, ScheduledChunk):
                raise CoreKVError(f"ModelRunner.execute: expected ScheduledChunk items, got {type(chunk).__name__}")
            if not chunk.token_ids or not isinstance(chunk.start_pos, int) or chunk.start_pos < 0:
                raise CoreKVError(
                    f"ModelRunner.execute: a chunk needs >= 1 token and start_pos >= 0, got "
                    f"{len(chunk.token_ids)} tokens at start_pos={chunk.start_pos!r}"
                )
            if not isinstance(chunk.num_logits, int) or not 1 <= chunk.num_logits <= len(chunk.token_ids):
                raise CoreKVError(f"ModelRunner.execute: a chunk's num_logits must be an int in 1..its "
                                  f"{len(chunk.token_ids)} tokens, got {chunk.num_logits!r}")
            needed = (chunk.start_pos + len(chunk.token_ids) + bs - 1) // bs
            if len(chunk.block_table) < needed:
                raise CoreKVError(
                    f"ModelRunner.execute: a chunk ending at position {chunk.start_pos + len(chunk.token_ids)} needs "
                    f"{needed} blocks of {bs} tokens but its block_table has {len(chunk.block_table)}; allocate "
                    "blocks before scheduling the chunk"
                )
            table = chunk.block_table[:needed]
            if min(table) < 0 or max(table) >= num_blocks:
                raise CoreKVError(
                    f"ModelRunner.execute: block_table {table} has ids outside [0, {num_blocks}); "
                    "this indicates a bug in the block allocation"
                )


def _caller_rows(num_logits: list[int], order: list[int]) -> torch.Tensor:
    """Indexes into the runner-ordered logits rows (``num_logits[j]`` rows for ordered chunk ``j``,
    which is the caller's chunk ``order[j]``) that put them back in the caller's chunk order."""
    starts = [0]
    for n in num_logits:
        starts.append(starts[-1] + n)
    position = {chunk: j for j, chunk in enumerate(order)}
    return torch.tensor([row for i in range(len(order))
                         for row in range(starts[position[i]], starts[position[i] + 1])])


def cascade_groups(tables: list[list[int]], *, min_saved_blocks: int = 0) -> list[tuple[list[int], int]]:
    """Partition decode rows (their block tables, each ending with its query's block) into
    ``(rows, num_shared_blocks)`` groups: rows starting with the same block form a group that
    attends its common leading blocks once (``num_shared_blocks >= 1``, and every row keeps at
    least its last block of its own) when that saves gathering at least ``min_saved_blocks``
    blocks (``(rows - 1) * num_shared_blocks``); the remaining rows form one last group with 0.

    NOTE: the common prefix of a group is the prefix of all its rows, so one row that diverges
    early shortens it for the whole group; prompts that share a prefix share all of its blocks (the
    scheduler holds back a prompt whose prefix blocks are still being computed), so in practice a
    group's rows diverge at the same block.
    """
    by_first: dict[int, list[int]] = {}
    for row, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(row)
    groups, plain = [], []
    for rows in by_first.values():
        num_shared = 0
        if len(rows) > 1:
            group_tables = [tables[r] for r in rows]
            num_shared = min(len(commonprefix(group_tables)), min(len(t) for t in group_tables) - 1)
        if num_shared and (len(rows) - 1) * num_shared >= min_saved_blocks:
            groups.append((rows, num_shared))
        else:
            plain += rows
    if plain:
        groups.append((sorted(plain), 0))
    return groups
