"""The KV event wire format (``corekv.kv_event_wire``): vLLM's msgspec layout, read back with plain msgpack.

vLLM encodes its event structs with ``array_like=True, omit_defaults=True, tag=True``: a batch is
``[ts, [event, ...]]`` (the data-parallel rank appended only when set) and an event is an array
whose first element is the struct's name. These tests decode corekv's payloads with ``msgpack``
alone, so they check the bytes a vLLM consumer sees, not corekv's own reader.
"""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corekv.kv_event_wire import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventDecodeError, cache_salt_key,
    decode_batch, encode_batch,
)

H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 32


def test_a_batch_is_a_positional_array_with_tagged_events_in_vllm_field_order():
    batch = KVEventBatch(12.5, [
        BlockStored([H1, H2], None, [1, 2, 3, 4], 2),
        BlockStored([H3], H2, [5, 6], 2, lora_id=7, medium="GPU"),
        BlockRemoved([H1]),
        AllBlocksCleared(),
    ])
    assert msgpack.unpackb(encode_batch(batch)) == [12.5, [
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, None, None],
        ["BlockStored", [H3], H2, [5, 6], 2, 7, "GPU"],
        ["BlockRemoved", [H1], None],
        ["AllBlocksCleared"],
    ]]


def test_extra_keys_follow_medium_and_lora_name_in_vllm_order_only_when_set():
    key = cache_salt_key("tenant-a")
    batch = KVEventBatch(1.0, [BlockStored([H1, H2], None, [1, 2, 3, 4], 2, extra_keys=[(key,), None]),
                               BlockStored([H3], H2, [5, 6], 2, lora_name="my-lora")])
    assert msgpack.unpackb(encode_batch(batch))[1] == [
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, None, None, None, [[key], None]],
        ["BlockStored", [H3], H2, [5, 6], 2, None, None, "my-lora"],
    ]


def test_the_tenant_key_is_a_digest_equal_for_equal_salts_and_absent_without_one():
    key = cache_salt_key("tenant-a")
    assert key == cache_salt_key("tenant-a") != cache_salt_key("tenant-b")
    assert key.startswith("cache_salt_sha256:") and len(key) == len("cache_salt_sha256:") + 32
    assert "tenant-a" not in key
    assert cache_salt_key(None) is None and cache_salt_key("") is None   # both are no salt
    with pytest.raises(TypeError, match=r"cache_salt_key\(cache_salt=\.\.\.\) got 7"):
        cache_salt_key(7)


def test_hashes_travel_as_msgpack_bin_and_the_timestamp_as_a_double():
    payload = encode_batch(KVEventBatch(1.0, [BlockRemoved([H1])]))
    # 0x92: array of 2; 0xcb: float64; 0xc4 0x10: bin of 16 bytes (str would be 0xb0 / 0xd9)
    assert payload.startswith(b"\x92\xcb") and b"\xc4\x10" + H1 in payload
    assert isinstance(msgpack.unpackb(payload, raw=True)[1][0][1][0], bytes)


def test_the_data_parallel_rank_is_sent_only_when_set():
    assert len(msgpack.unpackb(encode_batch(KVEventBatch(1.0, [])))) == 2
    assert msgpack.unpackb(encode_batch(KVEventBatch(1.0, [], data_parallel_rank=3))) == [1.0, [], 3]


hashes = st.one_of(st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32),
                   st.integers(min_value=0, max_value=2**64 - 1))
media = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "host", "lmdb"]))
extra_key = st.one_of(st.text(max_size=8), st.binary(max_size=8), st.integers(0, 99),
                      st.tuples(st.text(max_size=4), st.integers(0, 99)))   # vLLM's (mm hash, offset)


@st.composite
def stored_events(draw):
    block_hashes = draw(st.lists(hashes, max_size=4))
    extra_keys = draw(st.one_of(st.none(), st.lists(
        st.one_of(st.none(), st.tuples(extra_key) | st.tuples(extra_key, extra_key)),
        min_size=len(block_hashes), max_size=len(block_hashes))))
    return BlockStored(block_hashes, draw(st.one_of(st.none(), hashes)),
                       draw(st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=64)),
                       draw(st.integers(min_value=1, max_value=256)),
                       draw(st.one_of(st.none(), st.integers(0, 99))), draw(media),
                       draw(st.one_of(st.none(), st.text(max_size=8))), extra_keys)


events = st.one_of(
    stored_events(),
    st.builds(BlockRemoved, st.lists(hashes, max_size=4), media),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=200, deadline=None)
@given(st.builds(KVEventBatch, st.floats(allow_nan=False, allow_infinity=False), st.lists(events, max_size=6),
                 st.one_of(st.none(), st.integers(0, 64))))
def test_encode_then_decode_gives_the_same_batch(batch):
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_reads_newer_and_older_vllm_payloads():
    newer = msgpack.packb([2.0, [
        # newer vLLM appends lora_name, extra_keys, group_idx, ... to BlockStored
        ["BlockStored", [H1], None, [1, 2], 2, None, "GPU", "my-lora", [None], 0],
        ["BlockRemoved", [H1], "GPU", 0],
    ], 1], use_bin_type=True)
    assert decode_batch(newer) == KVEventBatch(2.0, [
        BlockStored([H1], None, [1, 2], 2, medium="GPU", lora_name="my-lora", extra_keys=[None]),
        BlockRemoved([H1], "GPU")], 1)
    older = msgpack.packb([3.0, [["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None],
                                 ["BlockRemoved", [11]]]])   # int hashes, no medium field
    assert decode_batch(older) == KVEventBatch(3.0, [BlockStored([11, 12], 10, [1, 2, 3, 4], 2),
                                                     BlockRemoved([11])])
    as_maps = msgpack.packb([4.0, [{"type": "BlockRemoved", "block_hashes": [H2]},
                                   {"type": "AllBlocksCleared"}]], use_bin_type=True)
    assert decode_batch(as_maps) == KVEventBatch(4.0, [BlockRemoved([H2]), AllBlocksCleared()])


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb({"ts": 1.0}), "expected a batch"),
    (msgpack.packb([1.0, [["BlockMoved", []]]]), "tag one of BlockStored, BlockRemoved"),
    (msgpack.packb([1.0, [{"type": "Nope"}]]), "unknown type 'Nope'"),
    (msgpack.packb([1.0, [["BlockRemoved", ["not-bytes"]]]]), "block_hashes holds 'not-bytes'"),
    (msgpack.packb([1.0, [["BlockStored", [], None, [1]]]]), "block_size"),
    (msgpack.packb(["soon", []]), r"ts=\.\.\.\) got 'soon'"),
])
def test_malformed_payloads_raise_a_decode_error_saying_what_is_wrong(payload, message):
    with pytest.raises(KVEventDecodeError, match=message):
        decode_batch(payload)


def test_events_check_their_arguments():
    with pytest.raises(TypeError, match=r"block_hashes=\.\.\.\) got b'ab'; expected a list"):
        BlockRemoved(b"ab")
    with pytest.raises(TypeError, match="token_ids holds '1'"):
        BlockStored([H1], None, ["1"], 16)
    with pytest.raises(TypeError, match="medium got 5"):
        BlockRemoved([H1], medium=5)
    with pytest.raises(ValueError, match="extra_keys has 1 entries for 2 block hashes; expected one per block"):
        BlockStored([H1, H2], None, [1, 2, 3, 4], 2, extra_keys=[None])
    with pytest.raises(TypeError, match="extra_keys holds 'salt'; expected a tuple"):
        BlockStored([H1], None, [1, 2], 2, extra_keys=["salt"])
    with pytest.raises(TypeError, match="lora_name got 3"):
        BlockStored([H1], None, [1, 2], 2, lora_name=3)
    with pytest.raises(TypeError, match="events holds"):
        KVEventBatch(1.0, [("stored", H1)])
    with pytest.raises(TypeError, match="expected a KVEventBatch"):
        encode_batch([1.0, []])
    with pytest.raises(TypeError, match="expected bytes"):
        decode_batch("text")
