"""The tier entry format: fixed header, a tag bound to the key, typed reasons for every mismatch."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corekv.block_format import (HEADER_SIZE, EntryCodec, EntryError, EntryFault, check_entry,
                                 decode_entry, encode_entry, fingerprint_digest, read_header)

SPEC = {"fingerprint": b"model-a", "dtype": "float32", "shape": (2, 3, 4)}
PAYLOAD = bytes(range(96))
KEY = b"block-hash-of-block-0"
SECRET = b"sixteen-or-more-bytes-of-secret"


def reason_of(data, key=KEY, **spec):
    with pytest.raises(EntryError) as info:
        decode_entry(key, data, **{**SPEC, **spec})
    return info.value.reason


def test_round_trip_returns_the_payload_without_a_copy():
    entry = encode_entry(KEY, PAYLOAD, **SPEC)
    assert len(entry) == HEADER_SIZE + 96 and entry[:4] == b"CKVB"
    payload = decode_entry(KEY, entry, **SPEC)
    assert bytes(payload) == PAYLOAD and payload.readonly and payload.obj is entry


def test_the_header_is_stable_across_processes_and_versions():
    """The on-disk bytes are a contract: a change here must bump FORMAT_VERSION."""
    entry = encode_entry(KEY, bytes(4), fingerprint=b"m", dtype="uint8", shape=(4,))
    assert HEADER_SIZE == 88 and entry[:8] == b"CKVB\x02\x00\x01\x01"
    assert entry[24:28] == (4).to_bytes(4, "little") and entry[56:64] == (4).to_bytes(8, "little")
    assert entry[64:72] == bytes(8)  # integrity 0 (a checksum), then reserved zeros
    assert entry[72:88].hex() == "b1bdc7a9a9bbf64388541e75845e382b"


@pytest.mark.parametrize("spec, reason", [
    ({"fingerprint": b"model-b"}, EntryFault.FINGERPRINT),
    ({"dtype": "int32"}, EntryFault.DTYPE),
    ({"shape": (3, 2, 4)}, EntryFault.SHAPE),
    ({"shape": (4, 6)}, EntryFault.SHAPE),
])
def test_a_different_model_dtype_or_shape_names_its_reason(spec, reason):
    assert reason_of(encode_entry(KEY, PAYLOAD, **SPEC), **spec) == reason


@pytest.mark.parametrize("offset, reason", [
    (0, EntryFault.MAGIC), (4, EntryFault.VERSION), (6, EntryFault.DTYPE), (7, EntryFault.SHAPE),
    (10, EntryFault.FINGERPRINT), (30, EntryFault.SHAPE), (60, EntryFault.LENGTH),
    (64, EntryFault.MAC), (66, EntryFault.CHECKSUM), (80, EntryFault.CHECKSUM),
    (HEADER_SIZE, EntryFault.CHECKSUM), (HEADER_SIZE + 95, EntryFault.CHECKSUM),
])
def test_a_flipped_byte_anywhere_is_caught(offset, reason):
    entry = bytearray(encode_entry(KEY, PAYLOAD, **SPEC))
    entry[offset] ^= 0x01
    assert reason_of(bytes(entry)) == reason


@pytest.mark.parametrize("length", [0, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 95])
def test_truncated_entries_are_reported_as_truncated(length):
    assert reason_of(encode_entry(KEY, PAYLOAD, **SPEC)[:length]) == EntryFault.TRUNCATED


def test_trailing_bytes_are_rejected():
    assert reason_of(encode_entry(KEY, PAYLOAD, **SPEC) + b"x") == EntryFault.TRUNCATED


def test_a_payload_of_the_wrong_size_is_refused_with_both_sizes():
    with pytest.raises(ValueError, match=r"payload has 95 bytes but this tier stores blocks of 96 bytes"):
        encode_entry(KEY, PAYLOAD[:95], **SPEC)


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
    entry = bytearray(encode_entry(KEY, payload, **spec))
    entry[position] ^= 1 << bit
    with pytest.raises(EntryError):
        decode_entry(KEY, bytes(entry), **spec)


def test_read_header_reports_what_an_entry_claims_without_a_model():
    header = read_header(encode_entry(KEY, PAYLOAD, **SPEC))
    assert (header.dtype, header.shape, header.payload_bytes) == ("float32", (2, 3, 4), 96)
    assert header.model_digest == fingerprint_digest(b"model-a") and header.version == 2
    with pytest.raises(EntryError) as info:
        read_header(b"not an entry at all, but long enough to hold a header" * 2)
    assert info.value.reason == EntryFault.MAGIC


def test_an_entry_read_under_another_key_is_a_checksum_fault():
    entry = encode_entry(KEY, PAYLOAD, **SPEC)
    assert reason_of(entry, key=b"block-hash-of-block-1") == EntryFault.CHECKSUM
    assert reason_of(entry, key=KEY + b"\0") == EntryFault.CHECKSUM


@settings(max_examples=100, deadline=None)
@given(key=st.binary(min_size=1, max_size=40), other=st.binary(min_size=1, max_size=40))
def test_no_entry_decodes_under_any_key_but_its_own(key, other):
    entry = encode_entry(key, PAYLOAD, **SPEC)
    assert bytes(decode_entry(key, entry, **SPEC)) == PAYLOAD
    if other != key:
        with pytest.raises(EntryError):
            decode_entry(other, entry, **SPEC)


def test_a_mac_entry_needs_the_secret_and_a_plain_one_is_refused_with_a_secret():
    mac_entry = encode_entry(KEY, PAYLOAD, **SPEC, secret=SECRET)
    assert mac_entry[64] == 1 and bytes(decode_entry(KEY, mac_entry, **SPEC, secret=SECRET)) == PAYLOAD
    assert reason_of(mac_entry) == EntryFault.MAC  # no secret here: cannot be checked, so a miss
    assert reason_of(encode_entry(KEY, PAYLOAD, **SPEC), secret=SECRET) == EntryFault.MAC
    assert reason_of(mac_entry, secret=b"another secret, same length!!!!") == EntryFault.MAC
    assert reason_of(mac_entry, key=b"another key", secret=SECRET) == EntryFault.MAC


def test_a_forged_mac_entry_with_its_integrity_byte_cleared_is_a_miss():
    """Clearing the integrity byte does not turn a keyed tier's check into a checksum check."""
    entry = bytearray(encode_entry(KEY, PAYLOAD, **SPEC, secret=SECRET))
    entry[64] = 0
    assert reason_of(bytes(entry), secret=SECRET) == EntryFault.MAC


@pytest.mark.parametrize("secret", [b"short", b"x" * 65, "a str"])
def test_a_secret_of_the_wrong_size_or_type_is_refused(secret):
    with pytest.raises(ValueError, match="integrity secret must be 16 to 64 bytes"):
        EntryCodec(**SPEC, secret=secret)


def test_check_entry_verifies_any_model_under_its_key():
    entry = encode_entry(KEY, PAYLOAD, **SPEC)
    assert check_entry(KEY, entry).shape == (2, 3, 4)
    with pytest.raises(EntryError, match="checksum"):
        check_entry(b"other", entry)
    mac_entry = encode_entry(KEY, PAYLOAD, **SPEC, secret=SECRET)
    assert check_entry(KEY, mac_entry, SECRET).integrity == 1
    with pytest.raises(EntryError, match="carries a MAC"):
        check_entry(KEY, mac_entry)
