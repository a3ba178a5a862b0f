"""The tier entry format: a block's raw KV bytes behind a small fixed header.

Layout (little-endian, 72 bytes, then the payload)::

    magic      4s   b"CKVB"
    version    H    FORMAT_VERSION
    dtype      B    DTYPE_CODES[dtype]
    ndim       B    number of used dims (<= MAX_DIMS)
    model      16s  xxh3-128 digest of the model fingerprint
    dims       8I   the block's shape, unused dims 0
    length     Q    payload length in bytes
    checksum   Q    xxh3-64 over the header's first 64 bytes and the payload

Every field is checked on load and a mismatch names its reason (:class:`EntryFault`), so a tier
can count and log faults by kind. Nothing is ever pickled: a tier may be shared or tampered with,
and the worst a hostile entry can do is fail these checks.
"""
from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"CKVB"
FORMAT_VERSION = 1
MAX_DIMS = 8
_HEADER = struct.Struct("<4sHBB16s8IQQ")
HEADER_SIZE = _HEADER.size  # 72
_CHECKED = HEADER_SIZE - 8  # every header byte but the checksum is covered by the checksum

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
    CHECKSUM = "checksum"


class EntryError(ValueError):
    """An entry failed a header or checksum check; ``reason`` is an :class:`EntryFault`."""

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


class EntryCodec:
    """Encodes and checks entries for one (model fingerprint, dtype, shape).

    Invariant: every entry this codec encodes decodes with it to the same payload, and no entry
    made with a different fingerprint, dtype, shape or format version decodes with it. The header
    is the same for every block of a tier but for its checksum, so it is packed once here.
    """

    def __init__(self, *, fingerprint: bytes | str, dtype: str, shape: Sequence[int]):
        self.dtype = dtype
        self.shape = tuple(shape)
        self.payload_bytes = nbytes_of(dtype, self.shape)
        self.model_digest = fingerprint_digest(fingerprint)
        dims = self.shape + (0,) * (MAX_DIMS - len(self.shape))
        self._prefix = _HEADER.pack(MAGIC, FORMAT_VERSION, DTYPES[dtype][0], len(self.shape),
                                    self.model_digest, *dims, self.payload_bytes, 0)[:_CHECKED]

    @property
    def entry_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes

    def header(self, payload) -> bytes:
        """The 72-byte header for ``payload`` (any bytes-like object of ``payload_bytes``)."""
        view = memoryview(payload).cast("B")
        if view.nbytes != self.payload_bytes:
            raise ValueError(f"payload has {view.nbytes} bytes but this tier stores blocks of "
                             f"{self.payload_bytes} bytes ({self.dtype}{list(self.shape)}); "
                             "pass exactly one block's KV bytes")
        digest = xxhash.xxh3_64()
        digest.update(self._prefix)
        digest.update(view)
        return self._prefix + digest.intdigest().to_bytes(8, "little")

    def encode(self, payload) -> bytes:
        return self.header(payload) + bytes(payload)

    def decode(self, data) -> memoryview:
        """The payload of ``data`` as a read-only view (no copy); raises :class:`EntryError`."""
        view = memoryview(data).cast("B").toreadonly()
        if view.nbytes < HEADER_SIZE:
            raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, shorter than a header")
        if view[:_CHECKED] != self._prefix:
            self._raise_header_mismatch(view)
        if view.nbytes != self.entry_bytes:
            raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, expected {self.entry_bytes}")
        _check_checksum(view)
        return view[HEADER_SIZE:]

    def _raise_header_mismatch(self, view: memoryview) -> None:
        magic, version, code, ndim, model, *rest = _HEADER.unpack(view[:HEADER_SIZE])
        dims, length = tuple(rest[:min(ndim, MAX_DIMS)]), rest[MAX_DIMS]
        if magic != MAGIC:
            raise EntryError(EntryFault.MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise EntryError(EntryFault.VERSION, f"format version {version}, expected {FORMAT_VERSION}")
        if model != self.model_digest:
            raise EntryError(EntryFault.FINGERPRINT, f"stored for model {model.hex()[:12]}, "
                             f"expected {self.model_digest.hex()[:12]}")
        if code != DTYPES[self.dtype][0]:
            raise EntryError(EntryFault.DTYPE, f"dtype {_CODE_TO_DTYPE.get(code, code)!r}, expected {self.dtype!r}")
        if dims != self.shape or ndim > MAX_DIMS:
            raise EntryError(EntryFault.SHAPE, f"shape {dims}, expected {self.shape}")
        if length != self.payload_bytes:
            raise EntryError(EntryFault.LENGTH, f"payload length {length}, expected {self.payload_bytes}")
        raise EntryError(EntryFault.CHECKSUM, "header bytes were altered")


@dataclass(frozen=True)
class EntryHeader:
    """What an entry's header claims (unverified): for tools that list a store's models."""

    version: int
    dtype: str
    shape: tuple[int, ...]
    model_digest: bytes
    payload_bytes: int


def read_header(data) -> EntryHeader:
    """Parse an entry's header without checking it against a model (``corekv store ls``).

    Raises :class:`EntryError` (``TRUNCATED`` or ``MAGIC``) when ``data`` is not an entry at all.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, shorter than a header")
    magic, version, code, ndim, model, *rest = _HEADER.unpack(view[:HEADER_SIZE])
    if magic != MAGIC:
        raise EntryError(EntryFault.MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    return EntryHeader(version=version, dtype=_CODE_TO_DTYPE.get(code, f"unknown({code})"),
                       shape=tuple(rest[:min(ndim, MAX_DIMS)]), model_digest=model,
                       payload_bytes=rest[MAX_DIMS])


def check_entry(data) -> EntryHeader:
    """Check an entry of *any* model (``corekv store verify``): a known format version and dtype,
    a shape that matches the payload length, the full length, and the checksum.

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
    _check_checksum(view)
    return header


def _check_checksum(view: memoryview) -> None:
    digest = xxhash.xxh3_64()
    digest.update(view[:_CHECKED])
    digest.update(view[HEADER_SIZE:])
    if digest.intdigest() != int.from_bytes(view[_CHECKED:HEADER_SIZE], "little"):
        raise EntryError(EntryFault.CHECKSUM, "checksum does not match the entry's bytes")


def encode_entry(payload, *, fingerprint: bytes | str, dtype: str, shape: Sequence[int]) -> bytes:
    """Header + ``payload`` for one block. ``payload`` must have ``prod(shape) * itemsize`` bytes."""
    return EntryCodec(fingerprint=fingerprint, dtype=dtype, shape=shape).encode(payload)


def decode_entry(data, *, fingerprint: bytes | str, dtype: str, shape: Sequence[int]) -> memoryview:
    """The checked payload of ``data``; raises :class:`EntryError` naming the first mismatch."""
    return EntryCodec(fingerprint=fingerprint, dtype=dtype, shape=shape).decode(data)
