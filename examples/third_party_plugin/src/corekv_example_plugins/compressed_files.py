"""``compressed_files``: KV blocks as zstd-compressed files in a folder, kept across restarts.

A small persistent tier: one file per entry, ``<path>/<fp12>/<hexhash>.zst`` (``fp12``: the
model's 12 hex digits, so models sharing the folder never meet), holding the zstd frame of the
whole entry (header + payload), so :class:`corekv.tier.Tier` validates every decompressed entry as
it does for any tier. It has no capacity of its own (the disk's) and never evicts.

Its entries outlive the process, so it also declares an admin view (:class:`CompressedFilesAdmin`,
``TierSpec.admin``): ``corekv store stats|ls|verify|clear`` then work on it with no code in corekv.
The layout lives in this module alone (:func:`entry_path`, :func:`stored_files`), read by both.
"""
from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import zstandard

from corekv.errors import ConfigError
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier
from corekv.tier_admin import StoreAdmin, StoredEntry

_MODEL_FOLDER = re.compile(r"[0-9a-f]{12}")
_ENTRY_FILE = re.compile(r"((?:[0-9a-f]{2})+)\.zst")  # a writer's "<name>.tmp-<uuid>" never matches


def entry_path(root: Path, fp12: str, key: BlockHash) -> Path:
    return root / fp12 / f"{key.hex()}.zst"


def stored_files(root: Path, fp12: str | None = None) -> Iterator[tuple[str, BlockHash, Path]]:
    """``(fp12, block hash, file)`` of every entry file under ``root``, or of one model's."""
    if fp12 is not None:
        folders = [root / fp12]
    else:
        folders = sorted(p for p in root.iterdir() if _MODEL_FOLDER.fullmatch(p.name)) if root.is_dir() else []
    for folder in folders:
        for file in sorted(folder.iterdir()) if folder.is_dir() else ():
            match = _ENTRY_FILE.fullmatch(file.name)
            if match is not None:
                yield folder.name, bytes.fromhex(match.group(1)), file


def decompress(record: bytes) -> bytes:
    """The entry in a file's bytes; a damaged file gives ``b""``, which fails the header check
    as truncated (a counted fault for the tier, a bad entry for ``corekv store verify``)."""
    try:
        return zstandard.ZstdDecompressor().decompress(record)
    except zstandard.ZstdError:
        return b""


class CompressedFilesTier(Tier):
    """Invariants: a file at an entry's name is a whole compressed entry or absent (written under
    a temporary name, then renamed, which is atomic on one file system); no index is kept in
    memory, so other processes' writes and deletions are seen at once."""

    is_persistent = True
    is_shared = True
    supports_listing = True

    def __init__(self, *, path: str, level: int = 3, block_bytes: int, fingerprint: bytes,
                 dtype: str = "uint8", shape: Sequence[int] | None = None, name: str | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "compressed_files")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(f"path must be a folder, got {path!r}; e.g. ./kv-files", path="path")
        if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 22:
            raise ConfigError(f"level must be an int from 1 (fastest) to 22 (smallest), got "
                              f"{level!r}", path="level")
        self.root = Path(path)
        (self.root / self.fp12).mkdir(parents=True, exist_ok=True)
        self._compressor = zstandard.ZstdCompressor(level=level)

    @property
    def capacity_bytes(self) -> None:
        return None

    @property
    def used_bytes(self) -> int:
        return sum(file.stat().st_size for _, _, file in stored_files(self.root, self.fp12))

    @property
    def num_entries(self) -> int:
        return sum(1 for _ in stored_files(self.root, self.fp12))

    def keys(self) -> Iterator[BlockHash]:
        return iter([key for _, key, _ in stored_files(self.root, self.fp12)])

    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        entries: list[bytes | None] = []
        for key in keys:
            try:
                entries.append(decompress(entry_path(self.root, self.fp12, key).read_bytes()))
            except FileNotFoundError:
                entries.append(None)
        return entries

    def _write_entries(self, items) -> int:
        num_stored = 0
        for key, parts in items:
            file = entry_path(self.root, self.fp12, key)
            if not file.exists():
                record = self._compressor.compress(b"".join(bytes(part) for part in parts))
                temporary = file.with_name(f"{file.name}.tmp-{uuid.uuid4().hex}")
                try:
                    temporary.write_bytes(record)
                    os.replace(temporary, file)
                except OSError:
                    temporary.unlink(missing_ok=True)
                    self._stats["errors"] += 1  # a full or read-only disk: a skip, not a crash
                    continue
                self._stats["puts"] += 1
                self._stats["bytes_written"] += len(record)
            num_stored += 1
        return num_stored

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        return [entry_path(self.root, self.fp12, key).exists() for key in keys]

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        for key in keys:
            entry_path(self.root, self.fp12, key).unlink(missing_ok=True)


class CompressedFilesAdmin(StoreAdmin):
    """Every model's entries in the folder ``path``; ``level`` is accepted and unused."""

    def __init__(self, *, path: str, level: int = 3):
        self.root = Path(path)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no compressed_files store at {self.root} (nothing was stored "
                                    "yet, or path points elsewhere)")

    def entries(self) -> Iterator[StoredEntry]:
        for model, key, file in stored_files(self.root):
            try:
                record = file.read_bytes()
            except FileNotFoundError:
                continue  # deleted since the listing
            yield StoredEntry(file, key, model, decompress(record))

    def delete(self, refs: Sequence[Path]) -> None:
        for file in refs:
            Path(file).unlink(missing_ok=True)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="compressed_files",
        factory=CompressedFilesTier,
        admin=CompressedFilesAdmin,
        options={
            "path": Option("str", help="folder of the compressed entry files, e.g. ./kv-files"),
            "level": Option("int", default=3, minimum=1,
                            help="zstd level: 1 is fastest, higher is smaller and slower (max 22)"),
        },
        description="zstd-compressed KV blocks as files in a folder, kept across restarts "
                    "(example plugin)",
    )]
