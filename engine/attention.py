"""corekv's paged attention, plugged into transformers through ``AttentionInterface``.

The model's own attention module projects Q/K/V and applies its rotary embedding; this function
then (1) writes the new K/V into their pool slots and (2) lets every sequence of the flattened
batch attend causally over its own blocks. No model class is copied or patched: any decoder whose
modeling code dispatches through ``AttentionInterface`` runs unchanged.

The batch layout is fixed by :class:`corekv.engine.model_runner.ModelRunner`: the first
``num_decode_tokens`` tokens are single-token chunks (decodes, batched per :class:`DecodeGroup` into
one padded SDPA call over gathered blocks, or one call of the native kernel that reads the pool
itself (``engine.compile`` on CPU), plus one for the group's shared leading blocks); the rest are
prefill chunks (per :class:`PrefillGroup` two calls, per :class:`ShortChunkGroup` one padded call, then
one masked SDPA call for each other chunk; or, native, one call of a kernel that reads the pool for
all of them).

The runner hands each step's :class:`AttentionMetadata` over through :func:`forward_context`.
Called outside one (e.g. by ``model.generate``) it is exactly transformers' SDPA attention, so a
loaded model remains an ordinary Hugging Face model.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from corekv.engine.step_metadata import AttentionMetadata, DecodeGroup, PrefillGroup, ShortChunkGroup
from corekv.errors import CoreKVError

ATTENTION_NAME = "corekv_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query`` is ``[1, num_heads, T, head_dim]``, ``key``/``value`` ``[1, num_kv_heads, T, head_dim]``;
    returns ``([1, T, num_heads, head_dim], None)`` like transformers' own attention functions."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        # NOTE: traced by torch.compile (engine.compile): the paged path stays one opaque op, so the
        # graph spans the whole decoder and the op reads the step's metadata when it runs.
        _refuse_unsupported(module, kwargs)
        return torch.ops.corekv.paged_attention(query, key, value, module.layer_idx, scaling), None
    meta: AttentionMetadata | None = getattr(_step, "meta", None)
    if meta is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    _refuse_unsupported(module, kwargs)
    return _paged_attention(meta, module.layer_idx, query, key, value, scaling), None


@contextmanager
def forward_context(meta: AttentionMetadata):
    """Every layer of the forward run inside reads ``meta`` (set by the model runner per step).

    NOTE: a thread-local rather than a forward kwarg, so a compiled model's graph does not take
    (and guard on) a new Python object every step.
    """
    _step.meta = meta
    try:
        yield
    finally:
        _step.meta = None


_step = threading.local()


def in_native_step() -> bool:
    """True inside :func:`forward_context` of a step that runs the native kernels, on this thread."""
    return native_kernels() is not None


def native_kernels():
    """The native kernels of the step this thread runs (:class:`~corekv.engine.cpu.native.NativeKernels`),
    or None outside a step or in a torch-path one."""
    meta = getattr(_step, "meta", None)
    return None if meta is None else meta.native


def _refuse_unsupported(module, kwargs) -> None:
    if kwargs.get("sliding_window") or kwargs.get("softcap") or getattr(module, "sinks", None) is not None:
        raise CoreKVError(
            f"{type(module).__name__} (layer {module.layer_idx}) asks for sliding-window, soft-capped or sink "
            "attention, which corekv's paged attention does not implement; serve a model with plain causal "
            "full attention"
        )


@torch.library.custom_op("corekv::paged_attention", mutates_args=())
def _paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                        scaling: float) -> torch.Tensor:
    """:func:`_paged_attention` as one op for compiled graphs (it writes the pool, which the graph
    never sees: the pool is not an input, and layers are ordered by their data dependence)."""
    meta = getattr(_step, "meta", None)
    if meta is None:
        raise CoreKVError("a model compiled for corekv (engine.compile) ran outside a ModelRunner step; "
                          "call the uncompiled model (LoadedModel.model) for plain Hugging Face use")
    return _paged_attention(meta, layer_idx, query, key, value, scaling)


@_paged_attention_op.register_fake
def _(query, key, value, layer_idx, scaling):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def _paged_attention(meta: AttentionMetadata, layer_idx: int, query, key, value, scaling) -> torch.Tensor:
    """Write this step's K/V into the pool, then attend: ``[1, T, num_heads, head_dim]``."""
    meta.num_layer_calls += 1
    k_cache, v_cache = meta.kv_pool.layer_kv(layer_idx)
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    # NOTE: the projections are laid out [T, heads, dim] in memory; these transposes are views.
    k_cache[meta.slot_block_ids, meta.slot_offsets] = key[0].transpose(0, 1)
    v_cache[meta.slot_block_ids, meta.slot_offsets] = value[0].transpose(0, 1)
    queries = query[0].transpose(0, 1)  # [T, H, D]
    out = query.new_empty(num_tokens, num_heads, head_dim)

    num_decode = meta.num_decode_tokens
    if num_decode:
        # NOTE: one query per sequence, so the query heads of a KV group become that group's query
        # rows ([B, Hkv, G, D]) and attention never materialises repeated K/V.
        q = queries[:num_decode].reshape(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
        for group in meta.decode_groups:
            rows = slice(group.row_start, group.row_end)
            out[rows] = _decode_attention(q[rows], k_cache, v_cache, group, meta, scaling).reshape(
                group.row_end - group.row_start, num_heads, head_dim)

    if meta.prefill_batch is not None:
        batch = meta.prefill_batch
        rows = queries[num_decode:]
        meta.native.prefill(rows if rows.stride(-1) == 1 else rows.contiguous(), k_cache, v_cache,
                            batch.block_tables, batch.query_starts, batch.start_pos, scaling, out[num_decode:])
    for group in meta.prefill_groups:
        out[group.token_start:group.token_end] = _prefill_group_attention(
            query, key, value, k_cache, v_cache, group, meta.buffers, scaling)
    for group in meta.short_groups:
        out[group.token_start:group.token_end] = _short_group_attention(queries, k_cache, v_cache, group,
                                                                        meta.buffers, num_kv_heads, scaling)
    gqa = num_heads != num_kv_heads
    for chunk in meta.prefills:
        q = query[:, :, chunk.token_start:chunk.token_end]
        if chunk.start_pos == 0:
            k = key[:, :, chunk.token_start:chunk.token_end]
            v = value[:, :, chunk.token_start:chunk.token_end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            table = chunk.block_table[None]
            k = _gather(k_cache, table, meta.buffers, "k")[:, :, :chunk.context_len]
            v = _gather(v_cache, table, meta.buffers, "v")[:, :, :chunk.context_len]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scaling, enable_gqa=gqa)
        out[chunk.token_start:chunk.token_end] = o[0].transpose(0, 1)
    return out[None]


def _decode_attention(q, k_cache, v_cache, group: DecodeGroup, meta: AttentionMetadata, scaling) -> torch.Tensor:
    """Attention of one group's decode queries ``[B, Hkv, G, D]`` over their blocks."""
    if meta.native is not None:
        # NOTE: reads each row's own blocks in the pool in one call, no gather (engine/cpu/native.py)
        out_own, lse_own = meta.native.decode(q, k_cache, v_cache, group.block_tables, group.context_lens, scaling)
        if group.shared_blocks is None:
            return out_own.to(q.dtype)
    else:
        k = _gather(k_cache, group.block_tables, meta.buffers, "k")
        v = _gather(v_cache, group.block_tables, meta.buffers, "v")
        if group.shared_blocks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling)
        out_own, lse_own = _attention_with_lse(q, k, v, group.mask, scaling)
    # NOTE: cascade attention. When a group of decoding sequences starts with the same blocks (a
    # shared system prompt or document, n > 1 samples), those blocks are gathered once and attended
    # by all B*G query rows in one GEMM-shaped call; only each sequence's own tail is gathered (or
    # read by the native kernel) per sequence. The two partial results merge exactly through their
    # log-sum-exps. This cuts the bytes a decode step moves through memory roughly by the shared
    # fraction of the context.
    batch, num_kv_heads, q_per_kv, head_dim = q.shape
    out_shared, lse_shared = _shared_attention(q.permute(1, 0, 2, 3).reshape(1, num_kv_heads, -1, head_dim),
                                               k_cache, v_cache, group.shared_blocks, meta.buffers, scaling)
    out_shared = out_shared.view(num_kv_heads, batch, q_per_kv, head_dim).transpose(0, 1)
    lse_shared = lse_shared.view(num_kv_heads, batch, q_per_kv).transpose(0, 1)
    return _merge(out_shared, lse_shared, out_own, lse_own).to(q.dtype)


def _prefill_group_attention(query, key, value, k_cache, v_cache, group: PrefillGroup, buffers: dict,
                             scaling) -> torch.Tensor:
    """``[tokens, num_heads, head_dim]`` attention of one :class:`PrefillGroup`'s chunks.

    NOTE: faster than one masked call per chunk over its gathered context (BENCHMARKS.md,
    "Prefill attention, W2's step shape"): the shared part is one large call, the causal part one
    batched call, and no mask is built.
    """
    tokens = slice(group.token_start, group.token_end)
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_tokens = group.token_end - group.token_start
    rows = query[0, :, tokens]  # [H, T, D]; query heads h*G .. h*G+G-1 read KV head h
    out_shared, lse_shared = _shared_attention(rows.reshape(1, num_kv_heads, -1, head_dim), k_cache, v_cache,
                                               group.shared_blocks, buffers, scaling)
    # each chunk causally over itself, the chunks as the batch (flash attention reads KV heads as is)
    m, n = group.num_chunks, num_tokens // group.num_chunks
    out_own, lse_own = _attention_with_lse(rows.view(num_heads, m, n, head_dim).transpose(0, 1),
                                           key[0, :, tokens].view(num_kv_heads, m, n, head_dim).transpose(0, 1),
                                           value[0, :, tokens].view(num_kv_heads, m, n, head_dim).transpose(0, 1),
                                           None, scaling, is_causal=True)
    merged = _merge(out_shared.reshape(num_heads, num_tokens, head_dim), lse_shared.reshape(num_heads, num_tokens),
                    out_own.transpose(0, 1).reshape(num_heads, num_tokens, head_dim),
                    lse_own.transpose(0, 1).reshape(num_heads, num_tokens))
    return merged.transpose(0, 1)


def _short_group_attention(queries, k_cache, v_cache, group: ShortChunkGroup, buffers: dict, num_kv_heads: int,
                           scaling) -> torch.Tensor:
    """``[tokens, num_heads, head_dim]`` attention of one :class:`ShortChunkGroup`'s chunks.

    NOTE: as for decodes, a KV head's query heads become rows of one call ([chunks, Hkv, q * G, D]),
    so K/V is gathered once per chunk and never repeated per query head.
    """
    n, q = group.num_chunks, group.chunk_len
    _, num_heads, head_dim = queries.shape
    per_kv = num_heads // num_kv_heads
    rows = queries[group.token_start:group.token_end].reshape(n, q, num_kv_heads, per_kv, head_dim)
    rows = rows.transpose(1, 2).reshape(n, num_kv_heads, q * per_kv, head_dim)
    k = _gather(k_cache, group.block_tables, buffers, "k")
    v = _gather(v_cache, group.block_tables, buffers, "v")
    o = F.scaled_dot_product_attention(rows, k, v, attn_mask=group.mask, scale=scaling)
    return o.view(n, num_kv_heads, q, per_kv, head_dim).transpose(1, 2).reshape(n * q, num_heads, head_dim)


def _shared_attention(rows, k_cache, v_cache, blocks, buffers: dict, scaling):
    """Query ``rows`` ``[1, num_kv_heads, R, head_dim]`` (all rows of a KV head together) over the
    cached ``blocks`` (gathered once): ``(out [1, num_kv_heads, R, head_dim], lse [1, num_kv_heads, R])``."""
    k = _gather(k_cache, blocks[None], buffers, "k_shared")
    v = _gather(v_cache, blocks[None], buffers, "v_shared")
    return _attention_with_lse(rows, k, v, None, scaling)


def _merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Attention over the union of two key sets from the parts' outputs and log-sum-exps (float32).

    NOTE: part a's weight exp(lse_a) / (exp(lse_a) + exp(lse_b)) is sigmoid(lse_a - lse_b): three
    small ops instead of the seven of the log-sum-exp form, and a decode step runs this per layer.
    """
    weight = torch.sigmoid(lse_a - lse_b)[..., None]
    return torch.lerp(out_b.float(), out_a.float(), weight)


def _attention_with_lse(q, k, v, mask, scaling, is_causal=False):
    """``(softmax(q k^T * scale + mask) v, logsumexp)``; ``mask`` is additive (0 / -inf) or None;
    ``is_causal`` (square ``q``/``k`` only) hides each query's later keys. ``k``/``v`` may have
    fewer heads than ``q`` (grouped-query attention: query head h reads KV head h // group)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k, v, is_causal=is_causal, attn_mask=mask, scale=scaling)
        return out, lse
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    if mask is not None:
        scores = scores + mask
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v), lse


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, buffers: dict, name: str) -> torch.Tensor:
    """``[B, num_kv_heads, num_blocks * block_size, head_dim]`` view over a copy of the blocks.

    NOTE: the copy lands in a buffer reused by every layer and step (grown when too small): a fresh
    multi-MB tensor per layer costs page faults that take about as long as the copy itself.
    """
    batch, num_blocks = block_tables.shape
    rows = batch * num_blocks
    buffer = buffers.get(name)
    if buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != cache.shape[1:]:
        buffer = buffers[name] = cache.new_empty((max(rows, 2 * (0 if buffer is None else buffer.shape[0])),
                                                  *cache.shape[1:]))
    blocks = torch.index_select(cache, 0, block_tables.reshape(-1), out=buffer[:rows])
    return blocks.view(batch, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
