"""The tier entry format: a block's raw KV bytes behind a small fixed header, bound to its key.

Layout (little-endian, 88 bytes, then the payload)::

    magic      4s   b"CKVB"
    version    H    FORMAT_VERSION
    dtype      B    DTYPE_CODES[dtype]
    ndim       B    number of used dims (<= MAX_DIMS)
    model      16s  xxh3-128 digest of the model fingerprint
    dims       8I   the block's shape, unused dims 0
    length     Q    payload length in bytes
    integrity  B    INTEGRITY_CHECKSUM or INTEGRITY_MAC: how ``tag`` was made
    reserved   7x   zero
    tag        16s  over (the key the entry was written under, the header's first 72 bytes, the
                    payload): xxh3-128 (a checksum), or keyed BLAKE2b-128 with the tier's secret

Every field is checked on load and a mismatch names its reason (:class:`EntryFault`), so a tier
can count and log faults by kind. The tag covers the key, so an entry moved to another key (two
values swapped, every value shifted to the next key) fails its check like a damaged one: an entry
is KV only for the key it was written for. A checksum stops accidents, not attackers: anyone who
can write to the store and knows this format can compute one. With a secret (``cache.integrity``)
the tag is a MAC, and an entry nobody holding the secret wrote is a miss. Nothing is ever
pickled: the worst a hostile entry can do is fail these checks.
"""
from __future__ import annotations

import copy
import enum
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"CKVB"
FORMAT_VERSION = 2
MAX_DIMS = 8
INTEGRITY_CHECKSUM = 0
INTEGRITY_MAC = 1
_HEADER = struct.Struct("<4sHBB16s8IQB7x16s")
HEADER_SIZE = _HEADER.size  # 88
_CHECKED = HEADER_SIZE - 16  # every header byte but the tag is covered by the tag
_INTEGRITY_AT = _CHECKED - 8  # offset of the integrity byte
_MAC_PERSON = b"corekv-entry-v2"  # BLAKE2b personalisation: these MACs mean nothing elsewhere
MIN_SECRET_BYTES = 16

#: dtype name -> (code, itemsize). Codes are part of the on-disk format: only ever append.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1), "int8": (2, 1), "int16": (3, 2), "int32": (4, 4), "int64": (5, 8),
    "float16": (6, 2), "bfloat16": (7, 2), "float32": (8, 4), "float64": (9, 8),
    "float8_e4m3fn": (10, 1), "float8_e5m2": (11, 1),
}
_CODE_TO_DTYPE = {code: name for name, (code, _) in DTYPES.items()}


class EntryFault(str, enum.Enum):
    """Why an entry was rejected; every value is a miss, never wrong KV."""

    TRUNCATED = "truncated"
    MAGIC = "magic"
    VERSION = "version"
    FINGERPRINT = "fingerprint"
    DTYPE = "dtype"
    SHAPE = "shape"
    LENGTH = "length"
    CHECKSUM = "checksum"  # damaged bytes, or an entry written under another key
    MAC = "mac"  # not authenticated by this tier's secret (or made without one)


class EntryError(ValueError):
    """An entry failed a header, checksum or MAC check; ``reason`` is an :class:`EntryFault`."""

    def __init__(self, reason: EntryFault, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


def fingerprint_digest(fingerprint: bytes | str) -> bytes:
    """The 16-byte digest a header stores for a model fingerprint of any length."""
    if isinstance(fingerprint, str):
        fingerprint = fingerprint.encode()
    if not isinstance(fingerprint, (bytes, bytearray)) or not fingerprint:
        raise TypeError(f"fingerprint must be non-empty bytes or str, got {fingerprint!r}; pass the "
                        "model fingerprint digest the engine computed")
    return xxhash.xxh3_128_digest(bytes(fingerprint))


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a block of ``shape`` elements of ``dtype`` (validating both)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported by the entry format; expected one of "
                         f"{sorted(DTYPES)}")
    shape = tuple(shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(not isinstance(d, int) or not 0 < d < 2**32 for d in shape):
        raise ValueError(f"shape {shape!r} is invalid; expected 1 to {MAX_DIMS} positive ints "
                         "(the block's KV layout, e.g. (layers, 2, heads, block_size, head_dim))")
    return math.prod(shape) * DTYPES[dtype][1]


def check_secret(secret: bytes | None) -> bytes | None:
    """``secret`` if it is usable as a MAC key (``None``: no MAC); raises ``ValueError``."""
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)) or not MIN_SECRET_BYTES <= len(secret) <= 64:
        raise ValueError(f"the integrity secret must be {MIN_SECRET_BYTES} to 64 bytes, got "
                         f"{len(secret) if isinstance(secret, (bytes, bytearray)) else type(secret).__name__}"
                         "; use e.g. `openssl rand -hex 32` (64 hex characters are taken as 32 bytes)")
    return bytes(secret)


def _tag(key: bytes, header_prefix, payload, secret: bytes | None) -> bytes:
    """The 16-byte tag over ``key``, the header's checked bytes and ``payload``.

    NOTE: the key's length goes first, so (key, header) pairs cannot be re-split to collide.
    """
    digest = (xxhash.xxh3_128() if secret is None
              else hashlib.blake2b(key=secret, digest_size=16, person=_MAC_PERSON))
    digest.update(len(key).to_bytes(2, "little"))
    digest.update(key)
    digest.update(header_prefix)
    digest.update(payload)
    return digest.digest()


class EntryCodec:
    """Encodes and checks entries for one (model fingerprint, dtype, shape, secret).

    Invariant: an entry this codec encodes under key ``k`` decodes with it under ``k`` to the same
    payload, and under no other key; no entry made with a different fingerprint, dtype, shape,
    format version or secret (or without the secret, when this codec has one) decodes with it.
    The header is the same for every block of a tier but for its tag, so it is packed once here.
    """

    def __init__(self, *, fingerprint: bytes | str, dtype: str, shape: Sequence[int],
                 secret: bytes | None = None):
        self.dtype = dtype
        self.shape = tuple(shape)
        self.payload_bytes = nbytes_of(dtype, self.shape)
        self.model_digest = fingerprint_digest(fingerprint)
        self.secret = check_secret(secret)
        self.integrity = INTEGRITY_CHECKSUM if self.secret is None else INTEGRITY_MAC
        dims = self.shape + (0,) * (MAX_DIMS - len(self.shape))
        self._prefix = _HEADER.pack(MAGIC, FORMAT_VERSION, DTYPES[dtype][0], len(self.shape),
                                    self.model_digest, *dims, self.payload_bytes, self.integrity,
                                    bytes(16))[:_CHECKED]

    @property
    def entry_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes

    def with_secret(self, secret: bytes | None) -> EntryCodec:
        """The same layout, with ``secret`` as its MAC key (``None``: a plain checksum)."""
        codec = copy.copy(self)
        codec.secret = check_secret(secret)
        codec.integrity = INTEGRITY_CHECKSUM if codec.secret is None else INTEGRITY_MAC
        codec._prefix = (self._prefix[:_INTEGRITY_AT] + bytes([codec.integrity])
                         + self._prefix[_INTEGRITY_AT + 1:])
        return codec

    def header(self, key: bytes, payload) -> bytes:
        """The header for ``payload`` (any bytes-like object of ``payload_bytes``) under ``key``."""
        view = memoryview(payload).cast("B")
        if view.nbytes != self.payload_bytes:
            raise ValueError(f"payload has {view.nbytes} bytes but this tier stores blocks of "
                             f"{self.payload_bytes} bytes ({self.dtype}{list(self.shape)}); "
                             "pass exactly one block's KV bytes")
        return self._prefix + _tag(key, self._prefix, view, self.secret)

    def encode(self, key: bytes, payload) -> bytes:
        return self.header(key, payload) + bytes(payload)

    def decode(self, key: bytes, data) -> memoryview:
        """The payload of ``data`` read under ``key``, as a read-only view (no copy); raises
        :class:`EntryError`."""
        view = memoryview(data).cast("B").toreadonly()
        if view.nbytes < HEADER_SIZE:
            raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, shorter than a header")
        if view[:_CHECKED] != self._prefix:
            self._raise_header_mismatch(view)
        if view.nbytes != self.entry_bytes:
            raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, expected {self.entry_bytes}")
        _check_tag(key, view, self.secret)
        return view[HEADER_SIZE:]

    def _raise_header_mismatch(self, view: memoryview) -> None:
        header = _unpack(view)
        if header.version != FORMAT_VERSION:
            raise EntryError(EntryFault.VERSION, f"format version {header.version}, expected {FORMAT_VERSION}")
        if header.model_digest != self.model_digest:
            raise EntryError(EntryFault.FINGERPRINT, f"stored for model {header.model_digest.hex()[:12]}, "
                             f"expected {self.model_digest.hex()[:12]}")
        if header.dtype != self.dtype:
            raise EntryError(EntryFault.DTYPE, f"dtype {header.dtype!r}, expected {self.dtype!r}")
        if header.shape != self.shape or header.ndim > MAX_DIMS:
            raise EntryError(EntryFault.SHAPE, f"shape {header.shape}, expected {self.shape}")
        if header.payload_bytes != self.payload_bytes:
            raise EntryError(EntryFault.LENGTH, f"payload length {header.payload_bytes}, expected {self.payload_bytes}")
        if header.integrity != self.integrity:
            raise EntryError(EntryFault.MAC, _integrity_mismatch(header.integrity, self.integrity))
        raise EntryError(EntryFault.CHECKSUM, "header bytes were altered")


@dataclass(frozen=True)
class EntryHeader:
    """What an entry's header claims (unverified): for tools that list a store's models."""

    version: int
    dtype: str
    shape: tuple[int, ...]
    model_digest: bytes
    payload_bytes: int
    integrity: int
    ndim: int


def _unpack(view: memoryview) -> EntryHeader:
    magic, version, code, ndim, model, *rest = _HEADER.unpack(view[:HEADER_SIZE])
    if magic != MAGIC:
        raise EntryError(EntryFault.MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    return EntryHeader(version=version, dtype=_CODE_TO_DTYPE.get(code, f"unknown({code})"),
                       shape=tuple(rest[:min(ndim, MAX_DIMS)]), model_digest=model,
                       payload_bytes=rest[MAX_DIMS], integrity=rest[MAX_DIMS + 1], ndim=ndim)


def read_header(data) -> EntryHeader:
    """Parse an entry's header without checking it against a model (``corekv store ls``).

    Raises :class:`EntryError` (``TRUNCATED`` or ``MAGIC``) when ``data`` is not an entry at all.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, shorter than a header")
    return _unpack(view)


def check_entry(key: bytes, data, secret: bytes | None = None) -> EntryHeader:
    """Check an entry of *any* model read under ``key`` (``corekv store verify``): a known format
    version and dtype, a shape that matches the payload length, the full length, and the tag
    (the MAC with ``secret``, which keyed entries need and plain ones must not have).

    :returns: the entry's header; raises :class:`EntryError` naming the first fault.
    """
    header = read_header(data)
    view = memoryview(data).cast("B")
    if header.version != FORMAT_VERSION:
        raise EntryError(EntryFault.VERSION, f"format version {header.version}, expected {FORMAT_VERSION}")
    if header.dtype not in DTYPES:
        raise EntryError(EntryFault.DTYPE, f"unknown dtype {header.dtype}")
    if not header.shape or header.payload_bytes != nbytes_of(header.dtype, header.shape):
        raise EntryError(EntryFault.SHAPE, f"shape {header.shape} of {header.dtype} does not match "
                         f"payload length {header.payload_bytes}")
    if view.nbytes != HEADER_SIZE + header.payload_bytes:
        raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, expected "
                         f"{HEADER_SIZE + header.payload_bytes}")
    expected = INTEGRITY_CHECKSUM if secret is None else INTEGRITY_MAC
    if header.integrity != expected:
        raise EntryError(EntryFault.MAC, _integrity_mismatch(header.integrity, expected))
    _check_tag(key, view, secret)
    return header


def _integrity_mismatch(found: int, expected: int) -> str:
    if expected == INTEGRITY_MAC:
        return "the entry carries no MAC, and this tier accepts only entries written with its secret"
    if found == INTEGRITY_MAC:
        return "the entry carries a MAC, and this tier has no secret to check it (cache.integrity)"
    return f"unknown integrity kind {found}"


def _check_tag(key: bytes, view: memoryview, secret: bytes | None) -> None:
    if _tag(key, view[:_CHECKED], view[HEADER_SIZE:], secret) != view[_CHECKED:HEADER_SIZE]:
        if secret is not None:
            raise EntryError(EntryFault.MAC, "the MAC does not match the entry's key and bytes (damaged, "
                             "moved from another key, or not written with this tier's secret)")
        raise EntryError(EntryFault.CHECKSUM, "checksum does not match the entry's key and bytes "
                         "(damaged, or moved from another key)")


def encode_entry(key: bytes, payload, *, fingerprint: bytes | str, dtype: str, shape: Sequence[int],
                 secret: bytes | None = None) -> bytes:
    """Header + ``payload`` for one block stored under ``key``; ``payload`` must have
    ``prod(shape) * itemsize`` bytes."""
    return EntryCodec(fingerprint=fingerprint, dtype=dtype, shape=shape, secret=secret).encode(key, payload)


def decode_entry(key: bytes, data, *, fingerprint: bytes | str, dtype: str, shape: Sequence[int],
                 secret: bytes | None = None) -> memoryview:
    """The checked payload of ``data`` read under ``key``; raises :class:`EntryError` naming the
    first mismatch."""
    return EntryCodec(fingerprint=fingerprint, dtype=dtype, shape=shape, secret=secret).decode(key, data)
