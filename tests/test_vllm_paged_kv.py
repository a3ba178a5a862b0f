"""corekv.integrations.vllm.paged_kv: vLLM's per-layer KV tensors as a pool of whole blocks, moved
by the offload code's pool copies through a real host tier. The tensors here are built in the two
layouts vLLM uses (block index on dim 0 as on CPU, on dim 1 as in GPU backends' ``[2, blocks, ...]``),
on CPU; no vLLM is needed to view them."""
from __future__ import annotations

import pytest
import torch

from corekv.errors import ConfigError
from corekv.integrations.vllm.paged_kv import PagedKV
from corekv.offload.pool_io import load_into_pool, pool_rows, snapshot_blocks
from corekv.tiers.host import HostTier

NUM_BLOCKS, LAYERS = 6, 3


def cpu_layout() -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 4, 16) for i in range(LAYERS)}  # [blocks, heads, bs, 2*hd]


def gpu_layout() -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.randn(2, NUM_BLOCKS, 4, 2, 8) for i in range(LAYERS)}  # [K/V, blocks, bs, heads, hd]


def block_of(kv: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    return kv.select(dim, block).clone()


@pytest.mark.parametrize("make, dim", [(cpu_layout, 0), (gpu_layout, 1)])
def test_blocks_round_trip_through_a_tier_into_other_blocks(make, dim):
    caches = make()
    page_bytes = caches["layer.0"].numel() // NUM_BLOCKS * 4
    pool = PagedKV(caches, num_blocks=NUM_BLOCKS, page_bytes=page_bytes, block_size=4)
    assert pool_rows(pool) is None and pool.block_shape == (LAYERS, page_bytes)
    tier = HostTier(size=1 << 20, block_bytes=pool.bytes_per_block, fingerprint=b"f" * 16, shape=pool.block_shape)
    keys = [b"block-a", b"block-b"]
    expected = [[block_of(kv, b, dim) for kv in caches.values()] for b in (1, 4)]
    assert tier.put([(k, row.numpy()) for k, row in zip(keys, snapshot_blocks(pool, [1, 4]))]) == 2
    untouched = [block_of(kv, 0, dim) for kv in caches.values()]
    assert load_into_pool(pool, tier, keys, [5, 2]) == [True, True]
    for block, want in zip((5, 2), expected):
        for kv, layer_block in zip(caches.values(), want):
            assert torch.equal(block_of(kv, block, dim), layer_block)
    for kv, layer_block in zip(caches.values(), untouched):
        assert torch.equal(block_of(kv, 0, dim), layer_block)


def test_an_unknown_layout_is_a_clear_error():
    caches = {"layer.0": torch.zeros(4, 3, NUM_BLOCKS)}  # blocks on the last dimension
    with pytest.raises(ConfigError, match="expects 6 blocks of .* on dimension 0 or 1"):
        PagedKV(caches, num_blocks=NUM_BLOCKS, page_bytes=48, block_size=4)


def test_a_cpu_load_stages_chunk_by_chunk_and_stops_at_the_first_miss(monkeypatch):
    """vLLM's CPU layout loads through a staging buffer of at most STAGED_BYTES (here one block),
    reused chunk after chunk; blocks after a miss stay untouched and read as misses."""
    from corekv.offload import pool_io

    caches = cpu_layout()
    page_bytes = caches["layer.0"].numel() // NUM_BLOCKS * 4
    pool = PagedKV(caches, num_blocks=NUM_BLOCKS, page_bytes=page_bytes, block_size=4)
    monkeypatch.setattr(pool_io, "STAGED_BYTES", pool.bytes_per_block)
    tier = HostTier(size=1 << 20, block_bytes=pool.bytes_per_block, fingerprint=b"f" * 16, shape=pool.block_shape)
    keys = [b"a", b"b", b"missing", b"c"]
    assert tier.put([(k, row.numpy()) for k, row in zip([b"a", b"b", b"c"], snapshot_blocks(pool, [0, 1, 2]))]) == 3
    want = [[block_of(kv, b, 0) for kv in caches.values()] for b in (0, 1)]
    before = [block_of(kv, 5, 0) for kv in caches.values()]
    calls = []
    get_into = tier.get_into
    monkeypatch.setattr(tier, "get_into", lambda ks, out: calls.append(len(ks)) or get_into(ks, out))
    staging = pool_io.StagingBuffers(pool)
    assert load_into_pool(pool, tier, keys, [3, 4, 5, 5], staging) == [True, True, False, False]
    assert calls == [1, 1, 1]  # one block per chunk; nothing asked after the miss
    for block, layers in zip((3, 4), want):
        assert all(torch.equal(block_of(kv, block, 0), layer) for kv, layer in zip(caches.values(), layers))
    assert all(torch.equal(block_of(kv, 5, 0), layer) for kv, layer in zip(caches.values(), before))
    assert staging.take(1).shape[0] == 1  # the one buffer kept is a chunk's, not the whole load's
