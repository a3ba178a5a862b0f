"""KVPool: sizing, whole-block reads/writes for tiers, copy-on-write, argument checks."""
from __future__ import annotations

import logging

import pytest
import torch

from corekv.errors import CoreKVError
from corekv.engine.kv_pool import KVPool


def make_pool(num_blocks=8, dtype=torch.float32):
    return KVPool(num_layers=3, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=5, dtype=dtype)


def fill_distinct(pool: KVPool) -> None:
    pool.storage.copy_(torch.arange(pool.storage.numel(), dtype=torch.float32).view_as(pool.storage))


def test_sizes_follow_the_layout():
    pool = make_pool(dtype=torch.bfloat16)
    assert pool.bytes_per_token == 2 * 3 * 2 * 5 * 2  # K and V, layers, kv heads, head_dim, 2 bytes
    assert pool.bytes_per_block == pool.bytes_per_token * 4
    assert pool.capacity_tokens == 32
    assert pool.storage.numel() * pool.storage.element_size() == 8 * pool.bytes_per_block


def test_num_blocks_for_memory_rounds_down_and_refuses_zero():
    kwargs = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=5, dtype=torch.float32)
    per_block = make_pool().bytes_per_block
    assert KVPool.num_blocks_for_memory(per_block * 10 + per_block - 1, **kwargs) == 10
    with pytest.raises(CoreKVError, match="kv_cache_memory"):
        KVPool.num_blocks_for_memory(per_block - 1, **kwargs)


def test_start_logs_bytes_per_token_and_capacity(caplog):
    with caplog.at_level(logging.INFO, logger="corekv.engine.kv_pool"):
        pool = make_pool()
    assert f"{pool.bytes_per_token} bytes per token" in caplog.text
    assert f"{pool.capacity_tokens} tokens capacity" in caplog.text


def test_layer_views_alias_the_storage():
    pool = make_pool()
    k, v = pool.layer_kv(1)
    assert k.shape == (8, 4, 2, 5)
    k[3, 2] = 7.0
    v[3, 2] = 9.0
    assert torch.all(pool.storage[3, 1, 0, 2] == 7.0) and torch.all(pool.storage[3, 1, 1, 2] == 9.0)


def test_read_then_write_moves_whole_blocks_for_every_layer():
    pool = make_pool()
    fill_distinct(pool)
    data = pool.read_blocks([5, 2])
    assert data.shape == (2, 3, 2, 4, 2, 5) and data.is_contiguous()
    assert torch.equal(data[0], pool.storage[5])
    other = make_pool()
    other.write_blocks([0, 7], data)
    assert torch.equal(other.storage[0], pool.storage[5]) and torch.equal(other.storage[7], pool.storage[2])
    assert torch.count_nonzero(other.storage[1:7]) == 0  # nothing else was touched


def test_write_accepts_the_raw_bytes_of_a_block():
    pool = make_pool()
    fill_distinct(pool)
    raw = pool.read_blocks([4])[0].contiguous().view(torch.uint8).reshape(-1)
    assert raw.numel() == pool.bytes_per_block
    other = make_pool()
    other.write_blocks([1], raw.clone())
    assert torch.equal(other.storage[1], pool.storage[4])


def test_copy_blocks_copies_every_layer_and_tolerates_overlap():
    pool = make_pool()
    fill_distinct(pool)
    before = pool.storage.clone()
    pool.copy_blocks([1, 2], [2, 3])  # 2 is both a source and a destination
    assert torch.equal(pool.storage[2], before[1]) and torch.equal(pool.storage[3], before[2])
    assert torch.equal(pool.storage[1], before[1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(block_size=-1), "block_size"),
    (dict(dtype=torch.int32), "dtype"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    base = dict(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    with pytest.raises(CoreKVError, match=match):
        KVPool(**{**base, **kwargs})


def test_block_ids_and_data_are_checked():
    pool = make_pool()
    with pytest.raises(CoreKVError, match=r"outside \[0, 8\)"):
        pool.read_blocks([8])
    with pytest.raises(CoreKVError, match="expected torch.float32"):
        pool.write_blocks([0], torch.zeros(3, 3))
    with pytest.raises(CoreKVError, match="equal lengths"):
        pool.copy_blocks([0, 1], [2])
