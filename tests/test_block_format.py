"""The tier entry format: fixed header, checksum, typed reasons for every mismatch."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corekv.block_format import (HEADER_SIZE, EntryCodec, EntryError, EntryFault, decode_entry,
                                 encode_entry, fingerprint_digest, read_header)

SPEC = {"fingerprint": b"model-a", "dtype": "float32", "shape": (2, 3, 4)}
PAYLOAD = bytes(range(96))


def reason_of(data, **spec):
    with pytest.raises(EntryError) as info:
        decode_entry(data, **{**SPEC, **spec})
    return info.value.reason


def test_round_trip_returns_the_payload_without_a_copy():
    entry = encode_entry(PAYLOAD, **SPEC)
    assert len(entry) == HEADER_SIZE + 96 and entry[:4] == b"CKVB"
    payload = decode_entry(entry, **SPEC)
    assert bytes(payload) == PAYLOAD and payload.readonly and payload.obj is entry


def test_the_header_is_stable_across_processes_and_versions():
    """The on-disk bytes are a contract: a change here must bump FORMAT_VERSION."""
    entry = encode_entry(bytes(4), fingerprint=b"m", dtype="uint8", shape=(4,))
    assert entry[:8] == b"CKVB\x01\x00\x01\x01"
    assert entry[24:28] == (4).to_bytes(4, "little") and entry[56:64] == (4).to_bytes(8, "little")


@pytest.mark.parametrize("spec, reason", [
    ({"fingerprint": b"model-b"}, EntryFault.FINGERPRINT),
    ({"dtype": "int32"}, EntryFault.DTYPE),
    ({"shape": (3, 2, 4)}, EntryFault.SHAPE),
    ({"shape": (4, 6)}, EntryFault.SHAPE),
])
def test_a_different_model_dtype_or_shape_names_its_reason(spec, reason):
    assert reason_of(encode_entry(PAYLOAD, **SPEC), **spec) == reason


@pytest.mark.parametrize("offset, reason", [
    (0, EntryFault.MAGIC), (4, EntryFault.VERSION), (6, EntryFault.DTYPE), (7, EntryFault.SHAPE),
    (10, EntryFault.FINGERPRINT), (30, EntryFault.SHAPE), (60, EntryFault.LENGTH),
    (66, EntryFault.CHECKSUM), (HEADER_SIZE, EntryFault.CHECKSUM), (HEADER_SIZE + 95, EntryFault.CHECKSUM),
])
def test_a_flipped_byte_anywhere_is_caught(offset, reason):
    entry = bytearray(encode_entry(PAYLOAD, **SPEC))
    entry[offset] ^= 0x01
    assert reason_of(bytes(entry)) == reason


@pytest.mark.parametrize("length", [0, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 95])
def test_truncated_entries_are_reported_as_truncated(length):
    assert reason_of(encode_entry(PAYLOAD, **SPEC)[:length]) == EntryFault.TRUNCATED


def test_trailing_bytes_are_rejected():
    assert reason_of(encode_entry(PAYLOAD, **SPEC) + b"x") == EntryFault.TRUNCATED


def test_a_payload_of_the_wrong_size_is_refused_with_both_sizes():
    with pytest.raises(ValueError, match=r"payload has 95 bytes but this tier stores blocks of 96 bytes"):
        encode_entry(PAYLOAD[:95], **SPEC)


@pytest.mark.parametrize("spec, message", [
    ({"dtype": "complex64"}, "dtype 'complex64' is not supported"),
    ({"shape": ()}, "shape .* is invalid"),
    ({"shape": (2, -1)}, "shape .* is invalid"),
    ({"shape": tuple([1] * 9)}, "shape .* is invalid"),
    ({"fingerprint": b""}, "fingerprint must be non-empty"),
])
def test_bad_codec_arguments_name_the_argument(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EntryCodec(**{**SPEC, **spec})


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(min_size=16, max_size=16), position=st.integers(0, HEADER_SIZE + 15),
       bit=st.integers(0, 7))
def test_no_single_bit_flip_ever_decodes(payload, position, bit):
    spec = {"fingerprint": "m", "dtype": "int16", "shape": (8,)}
    entry = bytearray(encode_entry(payload, **spec))
    entry[position] ^= 1 << bit
    with pytest.raises(EntryError):
        decode_entry(bytes(entry), **spec)


def test_read_header_reports_what_an_entry_claims_without_a_model():
    header = read_header(encode_entry(PAYLOAD, **SPEC))
    assert (header.dtype, header.shape, header.payload_bytes) == ("float32", (2, 3, 4), 96)
    assert header.model_digest == fingerprint_digest(b"model-a") and header.version == 1
    with pytest.raises(EntryError) as info:
        read_header(b"not an entry at all, but long enough to hold a header" * 2)
    assert info.value.reason == EntryFault.MAGIC
