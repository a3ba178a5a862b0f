"""``compressed_host``: KV blocks in host memory, each entry zstd-compressed, under a byte budget.

Compression is lossless, so a reloaded block is bit-identical to the one offloaded and the
engine's output cannot change. How much it saves depends on the KV dtype (see the README's
measurement): float32 KV mostly carries noise in its low mantissa bytes, so plain zstd gains
little; the byte *shuffle* stored here (all first bytes of the block's values, then all second
bytes, ...) groups the sign/exponent bytes, which are highly repetitive, and compresses markedly
better at the same speed.

Stored record: ``[mode][zstd frame of (entry header + payload, shuffled when mode > 1)]`` where
``mode`` is the shuffle width in bytes (1: not shuffled). The 72-byte entry header and its
checksum are kept inside the frame, so :class:`corekv.tier.Tier` validates every decompressed
entry as it does for any tier.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import zstandard

from corekv.block_format import DTYPES, HEADER_SIZE
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier


def shuffle_bytes(data: bytes, width: int) -> bytes:
    """Byte plane ``i`` of every ``width``-byte value, for ``i`` in ``0 .. width-1``."""
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width).T.tobytes()


def unshuffle_bytes(data: bytes, width: int) -> bytes:
    """The inverse of :func:`shuffle_bytes`."""
    return np.frombuffer(data, dtype=np.uint8).reshape(width, -1).T.tobytes()


class CompressedHostTier(Tier):
    """An LRU cache of compressed entries whose total compressed size stays within ``size``.

    Invariants: ``used_bytes == sum(len(r) for r in key_to_record.values()) <= capacity_bytes``;
    ``key_to_record`` is in LRU order (oldest first; hits and re-puts move a key to the end);
    decompressing a record and unshuffling it gives back exactly the entry that was put.
    """

    supports_listing = True

    def __init__(self, *, size: int, level: int = 1, shuffle: bool = True, block_bytes: int,
                 fingerprint: bytes, dtype: str = "uint8", shape: Sequence[int] | None = None,
                 name: str | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "compressed_host")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive number of bytes, got {size!r}; set "
                             "cache.tiers[].size for the compressed_host tier (e.g. 2GiB)")
        if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 22:
            raise ValueError(f"level must be an int from 1 (fastest) to 22 (smallest), got {level!r}; "
                             "set cache.tiers[].level (1 or 3 are good defaults)")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be true or false, got {shuffle!r}")
        self.size = size
        self.level = level
        self.shuffle_width = DTYPES[dtype][1] if shuffle else 1
        self._compressor = zstandard.ZstdCompressor(level=level)
        self._decompressor = zstandard.ZstdDecompressor()
        self.key_to_record: OrderedDict[BlockHash, bytes] = OrderedDict()
        self._used_bytes = 0
        self._raw_bytes = 0  # uncompressed entry bytes held (for the compression ratio)

    # ---------------------------------------------------------------- usage
    @property
    def capacity_bytes(self) -> int:
        return self.size

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_entries(self) -> int:
        return len(self.key_to_record)

    @property
    def compression_ratio(self) -> float | None:
        """Uncompressed / compressed bytes of what the tier holds now (``None`` when empty)."""
        return self._raw_bytes / self._used_bytes if self._used_bytes else None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "codec": f"zstd-{self.level}",
                "shuffle_width": self.shuffle_width, "compression_ratio": self.compression_ratio}

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            return iter(list(self.key_to_record))

    # ---------------------------------------------------------------- primitives
    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        entries: list[bytes | None] = []
        for key in keys:
            record = self.key_to_record.get(key)
            if record is not None:
                self.key_to_record.move_to_end(key)
                record = self._decode_record(record)
            entries.append(record)
        return entries

    def _write_entries(self, items) -> int:
        num_stored = 0
        for key, parts in items:
            if key in self.key_to_record:
                self.key_to_record.move_to_end(key)
                num_stored += 1
                continue
            entry = b"".join(bytes(part) for part in parts)
            record = self._encode_record(entry)
            if len(record) > self.size:
                continue  # can never fit: a skip (counted by Tier.put)
            while self._used_bytes + len(record) > self.size:
                self._drop(next(iter(self.key_to_record)))
                self._stats["evictions"] += 1
            self.key_to_record[key] = record
            self._used_bytes += len(record)
            self._raw_bytes += len(entry)
            self._stats["puts"] += 1
            self._stats["bytes_written"] += len(record)
            num_stored += 1
        return num_stored

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        return [key in self.key_to_record for key in keys]

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        for key in keys:
            if key in self.key_to_record:
                self._drop(key)

    def _close(self) -> None:
        self.key_to_record.clear()
        self._used_bytes = self._raw_bytes = 0

    # ---------------------------------------------------------------- helpers
    def _encode_record(self, entry: bytes) -> bytes:
        width = self.shuffle_width
        # NOTE: only a whole entry of this tier's layout is shuffled; anything else (a malformed
        # entry a test or a bug wrote) is stored as is, so it still reads back and fails the
        # header checks instead of failing here.
        if width > 1 and len(entry) == self.codec.entry_bytes:
            entry = entry[:HEADER_SIZE] + shuffle_bytes(entry[HEADER_SIZE:], width)
        else:
            width = 1
        return bytes([width]) + self._compressor.compress(entry)

    def _decode_record(self, record: bytes) -> bytes:
        try:
            entry = self._decompressor.decompress(record[1:])
            width = record[0]
            if width > 1:
                entry = entry[:HEADER_SIZE] + unshuffle_bytes(entry[HEADER_SIZE:], width)
            return entry
        except (zstandard.ZstdError, ValueError, IndexError):
            # NOTE: an empty entry fails Tier's header check as "truncated", so a damaged record
            # is counted as a fault, logged, deleted and treated as a miss like any bad entry.
            return b""

    def _drop(self, key: BlockHash) -> None:
        record = self.key_to_record.pop(key)
        self._used_bytes -= len(record)
        # NOTE: the raw size of an entry of this layout is fixed; a malformed one only skews the
        # ratio, never the budget (which counts compressed bytes exactly).
        self._raw_bytes = max(0, self._raw_bytes - self.codec.entry_bytes)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="compressed_host",
        factory=CompressedHostTier,
        options={
            "size": Option("size", help="bytes of compressed entries kept in CPU memory, e.g. 2GiB",
                           minimum=1),
            "level": Option("int", default=1, minimum=1,
                            help="zstd level: 1 is fastest, higher is smaller and slower (max 22)"),
            "shuffle": Option("bool", default=True,
                              help="byte-shuffle values before compressing (better ratio on float KV)"),
        },
        description="zstd-compressed KV blocks in CPU memory under a byte budget, LRU (example plugin)",
    )]
