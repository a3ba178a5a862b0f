"""``fsspec``: one object per KV block under any fsspec URL (file://, memory://, s3:// with s3fs).

The layout is written once, here, for the tier (one model's objects) and its admin view (every
model's, for ``corekv store``): ``<url>/<fp12>/<hh>/<hexhash>``, ``hh`` the hash's first two hex
digits; a local writer's temporary object is ``<hexhash>.tmp-<uuid>`` beside it.
"""
from __future__ import annotations

import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from corekv.errors import ConfigError
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier
from corekv.tier_admin import StoreAdmin, StoredEntry

logger = logging.getLogger(__name__)
_TMP_MARK = ".tmp-"
_OBJECT_PATH = re.compile(r"([0-9a-f]{12})/([0-9a-f]{2})/((?:[0-9a-f]{2})+)")


def _object_path(root: str, fp12: str, key: BlockHash) -> str:
    hexhash = key.hex()
    return f"{root}/{fp12}/{hexhash[:2]}/{hexhash}"


def _parse_object_path(root: str, path: str) -> tuple[str, BlockHash] | None:
    """``(fp12, block hash)`` of a block object's path under ``root``; ``None`` for any other
    object (a writer's temporary one, a foreign file)."""
    match = _OBJECT_PATH.fullmatch(path[len(root) + 1:]) if path.startswith(f"{root}/") else None
    if match is None or not match.group(3).startswith(match.group(2)):
        return None
    return match.group(1), bytes.fromhex(match.group(3))


def _open_fs(url: str, storage_options: dict[str, Any] | None):
    """``(filesystem, root)`` for ``url``; a URL fsspec cannot open is a ConfigError for it."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url must be an fsspec URL string, got {url!r}; e.g. file:///data/kv "
                          "or s3://bucket/prefix", path="url")
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise ConfigError(f"url {url!r} cannot be opened by fsspec ({e}); install the "
                          "filesystem's package (e.g. s3fs for s3://) or fix the URL", path="url") from e
    return fs, root.rstrip("/")


class FsspecTier(Tier):
    """Blocks as objects ``<url>/<fp12>/<hh>/<hexhash>`` (entry = header + payload).

    Invariants: an object at a block's path is a complete entry or absent: on a local disk it is
    written under a temporary name and renamed into place (atomic), and object stores make each
    PUT atomic; readers ignore temporary names. With ``size`` > 0, the objects known to this
    process (listed at open, sorted by mtime, then in this process's access order) are evicted
    oldest first to stay under ``size``: best effort, as other writers are only seen at open.
    """

    is_persistent = True
    is_shared = True
    supports_listing = True

    def __init__(self, *, url: str, size: int = 0, block_bytes: int, fingerprint: bytes,
                 dtype: str = "uint8", shape: Sequence[int] | None = None, name: str | None = None,
                 storage_options: dict[str, Any] | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "fsspec")
        if not isinstance(size, int) or size < 0:
            raise ConfigError(f"size must be a byte count >= 0 (0: no cap), got {size!r}", path="size")
        self.fs, self.root = _open_fs(url, storage_options)
        self.url, self.size = url, size
        self._is_local = isinstance(self.fs, LocalFileSystem)
        #: path -> object bytes, oldest first (kept only with a size cap)
        self._path_to_bytes: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        if size:
            self._scan()

    # ---------------------------------------------------------------- usage
    @property
    def capacity_bytes(self) -> int | None:
        return self.size or None

    @property
    def used_bytes(self) -> int:
        if self.size:
            return self._used
        return sum(info["size"] for info in self._list(self.root).values())

    @property
    def num_entries(self) -> int:
        return len(self._list(f"{self.root}/{self.fp12}"))

    def keys(self) -> Iterator[BlockHash]:
        found = (_parse_object_path(self.root, path) for path in self._list(f"{self.root}/{self.fp12}"))
        return iter([key for _, key in filter(None, found)])

    # ---------------------------------------------------------------- primitives
    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        paths = [self._path(key) for key in keys]
        try:
            found = self.fs.cat(paths, on_error="omit")
        except Exception as e:  # a remote store's errors are misses, never the engine's problem
            self._count_error("read", e)
            return [None] * len(keys)
        for path in found:
            if path in self._path_to_bytes:
                self._path_to_bytes.move_to_end(path)
        return [found.get(path) for path in paths]

    def _write_entries(self, items) -> int:
        num_stored = 0
        for key, parts in items:
            path = self._path(key)
            if path in self._path_to_bytes:
                self._path_to_bytes.move_to_end(path)
                num_stored += 1
                continue
            entry_bytes = sum(len(p) for p in parts)
            if self.size and not self._make_room(entry_bytes):
                continue
            try:
                self._write_object(path, parts)
            except Exception as e:
                self._count_error("write", e)
                continue
            num_stored += 1
            self._stats["puts"] += 1
            self._stats["bytes_written"] += entry_bytes
            if self.size:
                self._path_to_bytes[path] = entry_bytes
                self._used += entry_bytes
        return num_stored

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        try:
            return [self.fs.exists(self._path(key)) for key in keys]
        except Exception as e:
            self._count_error("exists", e)
            return [False] * len(keys)

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        for key in keys:
            self._remove(self._path(key))

    # ---------------------------------------------------------------- helpers
    def _path(self, key: BlockHash) -> str:
        return _object_path(self.root, self.fp12, key)

    def _write_object(self, path: str, parts) -> None:
        if not self._is_local:
            self.fs.pipe_file(path, b"".join(parts))  # one PUT: atomic on object stores
            return
        # NOTE: a reader (or a crash) must never see half an entry: write aside, then rename.
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        self.fs.mv(tmp, path)

    def _make_room(self, entry_bytes: int) -> bool:
        if entry_bytes > self.size:
            return False
        while self._used + entry_bytes > self.size and self._path_to_bytes:
            path, _ = next(iter(self._path_to_bytes.items()))
            self._remove(path)
            self._stats["evictions"] += 1
        return self._used + entry_bytes <= self.size

    def _remove(self, path: str) -> None:
        self._used -= self._path_to_bytes.pop(path, 0)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as e:
            self._count_error("delete", e)

    def _scan(self) -> None:
        objects = sorted(self._list(self.root).items(), key=lambda item: _mtime(item[1]))
        for path, info in objects:
            self._path_to_bytes[path] = info["size"]
            self._used += info["size"]

    def _list(self, prefix: str) -> dict[str, dict]:
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            self._count_error("list", e)
            return {}
        return {self.fs._strip_protocol(path): info for path, info in found.items()
                if _TMP_MARK not in path.rsplit("/", 1)[-1]}

    def _count_error(self, what: str, error: Exception) -> None:
        self._stats["errors"] += 1
        logger.warning("tier %s: %s on %s failed (%s: %s); treated as a miss/skip",
                       self.name, what, self.url, type(error).__name__, error)


class FsspecAdmin(StoreAdmin):
    """Every model's block objects under ``url`` (``corekv store``); ``size`` is the capacity
    reported (0: none)."""

    def __init__(self, *, url: str, size: int = 0, storage_options: dict[str, Any] | None = None):
        self.fs, self.root = _open_fs(url, storage_options)
        self.size = size

    def entries(self) -> Iterator[StoredEntry]:
        try:
            paths = sorted(self.fs.find(self.root))
        except FileNotFoundError:
            return
        for path in paths:
            parsed = _parse_object_path(self.root, self.fs._strip_protocol(path))
            if parsed is not None:
                try:
                    data = self.fs.cat_file(path)
                except FileNotFoundError:
                    continue  # deleted (evicted) since the listing
                yield StoredEntry(path, parsed[1], parsed[0], data)

    def delete(self, refs: Sequence[str]) -> None:
        for path in refs:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def capacity_bytes(self) -> int | None:
        return self.size or None


def _mtime(info: dict) -> float:
    value = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="fsspec",
        factory=FsspecTier,
        admin=FsspecAdmin,
        options={
            "url": Option("str", help="an fsspec URL: file:///data/kv, memory://kv, s3://bucket/prefix"),
            "size": Option("size", default=0, help="cap in bytes, LRU by mtime (0: no cap)", minimum=0),
        },
        description="one object per KV block under any fsspec URL (local disk, object stores)",
    )]
