"""``fsspec``: one object per KV block under any fsspec URL (file://, memory://, s3:// with s3fs).

The layout is written once, here, for the tier (one model's objects) and its admin view (every
model's, for ``corekv store``): ``<url>/<fp12>/<hh>/<hexhash>``, ``hh`` the hash's first two hex
digits; a local writer's temporary object is ``<hexhash>.tmp-<uuid>`` beside it. How the store is
opened and called (``storage_options``, concurrency, the deadline) is
:mod:`corekv.tiers.fsspec_calls`'s business.
"""
from __future__ import annotations

import errno
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from corekv.errors import ConfigError, CoreKVError, describe_exception
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier
from corekv.tier_admin import EntryUse, StoreAdmin, StoredEntry
from corekv.tier_faults import Cooldowns
from corekv.tiers.fsspec_calls import Calls, open_filesystem
from corekv.tiers.local_objects import TMP_MARK as _TMP_MARK
from corekv.tiers.local_objects import read_regular_file, sweep_temporary, write_aside

logger = logging.getLogger(__name__)
#: the largest object `corekv store` reads as an entry (the tier itself reads at most its entry size)
MAX_ENTRY_BYTES = 1024**3
_OBJECT_PATH = re.compile(r"([0-9a-f]{12})/([0-9a-f]{2})/((?:[0-9a-f]{2})+)")
_ADMIN_BATCH = 64  # objects read or deleted per batch of calls by the admin view


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


def _check_numbers(*, timeout: float, retry_interval: float, concurrency: int) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"timeout must be a number of seconds > 0 (the deadline of every call "
                          f"to the store), got {timeout!r}", path="timeout")
    if isinstance(retry_interval, bool) or not isinstance(retry_interval, (int, float)) or retry_interval < 0:
        raise ConfigError(f"retry_interval must be a number of seconds >= 0, got {retry_interval!r}",
                          path="retry_interval")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be a whole number >= 1, got {concurrency!r}", path="concurrency")


class FsspecTier(Tier):
    """Blocks as objects ``<url>/<fp12>/<hh>/<hexhash>`` (entry = header + payload).

    Invariants: an object at a block's path is a complete entry or absent: on a local disk it is
    written under a temporary name and renamed into place (atomic), and object stores make each
    PUT atomic; readers ignore temporary names. A batch is one call per object, run concurrently
    (at most ``concurrency``) on a remote store, with no HEAD before a GET, each call bounded by
    ``timeout`` seconds: a store that fails or outlives it makes the batch's blocks misses or
    skips, counts one ``errors`` and cools down for ``retry_interval`` seconds, during which calls
    skip it without touching the network. Membership is always asked of the store,
    never of a cached listing, so every machine sees the blocks the others wrote. With
    ``size`` > 0, the objects known to this process (listed at open, sorted by mtime, then in this
    process's access order) are evicted oldest first to stay under ``size``: best effort, as other
    writers are only seen at open.
    """

    is_persistent = True
    is_shared = True
    supports_listing = True

    def __init__(self, *, url: str, size: int = 0, block_bytes: int, fingerprint: bytes,
                 dtype: str = "uint8", shape: Sequence[int] | None = None, name: str | None = None,
                 storage_options: dict[str, Any] | None = None, timeout: float = 5.0,
                 retry_interval: float = 5.0, concurrency: int = 16):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "fsspec")
        if not isinstance(size, int) or size < 0:
            raise ConfigError(f"size must be a byte count >= 0 (0: no cap), got {size!r}", path="size")
        _check_numbers(timeout=timeout, retry_interval=retry_interval, concurrency=concurrency)
        self.fs, self.root = open_filesystem(url, storage_options, timeout=timeout)
        self.url, self.size = url, size
        self._calls = Calls(self.fs, timeout=timeout, concurrency=concurrency)
        self._cooldowns = Cooldowns(self.name, retry_interval, self._stats, kind="store")
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
        if self._is_local:
            entries = [self._read_local(path) for path in paths]
        else:
            # NOTE: start=0 makes s3fs send one ranged GET; without a range it first asks the
            # object's size (a HEAD) to decide whether to split the download. The range ends one
            # byte past an entry: a larger object is cut (then a miss), never fetched whole.
            outcomes = self._each("read", "cat_file", [(path,) for path in paths], start=0,
                                  end=self.codec.entry_bytes + 1, is_empty_ok=True)
            entries = [outcome if isinstance(outcome, bytes) else None for outcome in outcomes]
        for path, entry in zip(paths, entries):
            if entry is not None and path in self._path_to_bytes:
                self._path_to_bytes.move_to_end(path)
        return entries

    def _write_entries(self, items) -> int:
        num_stored = 0
        path_to_planned: dict[str, tuple[Any, int]] = {}  # what this batch writes: parts, bytes
        for key, parts in items:
            path = self._path(key)
            if path in self._path_to_bytes and path not in path_to_planned:
                self._path_to_bytes.move_to_end(path)
                num_stored += 1
                continue
            entry_bytes = sum(len(p) for p in parts)
            if self.size:
                if not self._make_room(entry_bytes, path_to_planned):
                    continue
                self._path_to_bytes[path] = entry_bytes
                self._used += entry_bytes
            path_to_planned[path] = (parts, entry_bytes)
        paths = list(path_to_planned)
        if self._is_local:
            outcomes = self._each("write", "local", [(path, path_to_planned[path][0]) for path in paths])
        else:  # one PUT per object: atomic on object stores
            outcomes = self._each("write", "pipe_file",
                                  [(path, b"".join(path_to_planned[path][0])) for path in paths])
        for path, outcome in zip(paths, outcomes):
            entry_bytes = path_to_planned[path][1]
            if isinstance(outcome, BaseException):
                self._used -= self._path_to_bytes.pop(path, 0)
                continue
            num_stored += 1
            self._stats["puts"] += 1
            self._stats["bytes_written"] += entry_bytes
        return num_stored

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        paths = [(self._path(key),) for key in keys]
        if self.fs.async_impl:
            # NOTE: a one-byte ranged GET answers membership in one request; s3fs's exists()
            # may send a HEAD and then a listing for every absent object.
            outcomes = self._each("exists", "cat_file", paths, start=0, end=1, is_empty_ok=True)
            return [isinstance(outcome, bytes) for outcome in outcomes]
        return [outcome is True for outcome in self._each("exists", "exists", paths)]

    def is_reachable(self) -> bool:
        """A local folder is; a remote store answered one membership call (of a key no block
        has) within the deadline. Asked of ``required: true`` tiers at start only."""
        if self._is_local:
            return True
        self._contains_entries([b"\x00corekv-reachable"])
        return not self._cooldowns.is_down(self.url)

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        paths = [self._path(key) for key in keys]
        for path in paths:
            self._used -= self._path_to_bytes.pop(path, 0)
        self._each("delete", "rm_file", [(path,) for path in paths])

    # ---------------------------------------------------------------- helpers
    def _path(self, key: BlockHash) -> str:
        return _object_path(self.root, self.fp12, key)

    def _each(self, what: str, method: str, arg_tuples: list[tuple], is_empty_ok: bool = False,
              **kwargs) -> list:
        """Outcomes of ``method`` over ``arg_tuples`` (:class:`Calls`); all of them exceptions
        while the store cools down. An absent object is an outcome, not a failure; any other
        exception puts the store in its cool-down (one ``errors`` per batch). With
        ``is_empty_ok``, a ranged read refused as unsatisfiable (an empty object: a damaged
        entry, which the caller's check rejects) answers ``b""``."""
        if not arg_tuples:
            return []
        if self._cooldowns.is_down(self.url):
            return [ConnectionError(f"{self.url} is cooling down")] * len(arg_tuples)
        if method == "local":
            outcomes = [self._call_local(*args) for args in arg_tuples]
        elif method == "listing":
            outcomes = [self._calls.listing(*args, **kwargs) for args in arg_tuples]
        else:
            outcomes = self._calls.each(method, arg_tuples, **kwargs)
        if is_empty_ok:
            outcomes = [b"" if _is_unsatisfiable_range(o) else o for o in outcomes]
        failure = next((o for o in outcomes if isinstance(o, BaseException)
                        and not isinstance(o, FileNotFoundError)), None)
        if failure is not None:
            self._cooldowns.failed(self.url, what, failure)
        else:
            self._cooldowns.succeeded(self.url)
        return outcomes

    def _call_local(self, path: str, parts) -> BaseException | None:
        # NOTE: a reader (or a crash) must never see half an entry: write aside, then rename;
        # a failed write (a full disk) removes its temporary object (local_objects.write_aside)
        try:
            write_aside(path, parts)
        except Exception as e:  # noqa: BLE001 - a failed write is an outcome (a skip)
            return e
        return None

    def _read_local(self, path: str) -> bytes | None:
        """A local entry, or None: absent, or not a regular file of at most an entry's size (a
        FIFO, a symlink, a huge file: counted, never read; local_objects.read_regular_file)."""
        try:
            return read_regular_file(path, self.codec.entry_bytes)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._stats["errors"] += 1
            logger.warning("tier %s: %s is not a block entry (%s); treated as a miss", self.name,
                           path, describe_exception(e))
            return None

    def _make_room(self, entry_bytes: int, path_to_planned: dict) -> bool:
        """Evict the oldest objects until ``entry_bytes`` more fit (one planned by this batch
        is dropped from it rather than written and deleted); False if it can never fit."""
        if entry_bytes > self.size:
            return False
        evicted = []
        while self._used + entry_bytes > self.size and self._path_to_bytes:
            path, size = self._path_to_bytes.popitem(last=False)
            self._used -= size
            self._stats["evictions"] += 1
            if path_to_planned.pop(path, None) is None:
                evicted.append((path,))
        self._each("delete", "rm_file", evicted)
        return self._used + entry_bytes <= self.size

    def _scan(self) -> None:
        objects = sorted(self._list(self.root).items(), key=lambda item: _mtime(item[1]))
        for path, info in objects:
            self._path_to_bytes[path] = info["size"]
            self._used += info["size"]

    def _list(self, prefix: str) -> dict[str, dict]:
        found = self._each("list", "listing", [(prefix,)], detail=True)[0]
        if isinstance(found, BaseException):
            return {}
        return {self.fs._strip_protocol(path): info for path, info in found.items()
                if _TMP_MARK not in path.rsplit("/", 1)[-1]}


class FsspecAdmin(StoreAdmin):
    """Every model's block objects under ``url`` (``corekv store``); ``size`` is the capacity
    reported (0: none). Takes the tier's options; calls have the tier's deadline. Unlike the tier,
    a store that cannot be read is an error (a :class:`CoreKVError` saying why and what to do)."""

    def __init__(self, *, url: str, size: int = 0, storage_options: dict[str, Any] | None = None,
                 timeout: float = 5.0, retry_interval: float = 5.0, concurrency: int = 16):
        _check_numbers(timeout=timeout, retry_interval=retry_interval, concurrency=concurrency)
        self.fs, self.root = open_filesystem(url, storage_options, timeout=timeout)
        self.url, self.size, self.timeout = url, size, timeout
        self._calls = Calls(self.fs, timeout=timeout, concurrency=concurrency)
        self._paths = self._find()  # NOTE: here, so a store that cannot be read fails at open

    def entries(self) -> Iterator[StoredEntry]:
        paths = self._paths if self._paths is not None else self._find()
        self._paths = None
        found = [(path, parsed) for path in paths
                 if (parsed := _parse_object_path(self.root, self.fs._strip_protocol(path))) is not None]
        for start in range(0, len(found), _ADMIN_BATCH):
            batch = found[start:start + _ADMIN_BATCH]
            if isinstance(self.fs, LocalFileSystem):
                outcomes = [_read_listed(path) for path, _ in batch]
            else:
                outcomes = self._calls.each("cat_file", [(path,) for path, _ in batch], start=0,
                                            end=MAX_ENTRY_BYTES + 1)
            for (path, (model, key)), outcome in zip(batch, outcomes):
                if isinstance(outcome, FileNotFoundError):
                    continue  # deleted (evicted) since the listing
                self._check(outcome, "read")
                yield StoredEntry(path, key, model, outcome)

    #: NOTE: object stores keep no read time and the tier does not rewrite an object on a hit
    age_basis = "last write"

    def usage(self) -> Iterator[EntryUse]:
        """Every block object's size and modification time, from one listing (no object read)."""
        found = self._calls.listing(self.root, detail=True)
        if isinstance(found, FileNotFoundError):
            return
        self._check(found, "list")
        for path, info in found.items():
            parsed = _parse_object_path(self.root, self.fs._strip_protocol(path))
            if parsed is not None and info.get("type", "file") == "file":
                yield EntryUse(path, parsed[0], int(info.get("size") or 0), _mtime(info))

    def delete(self, refs: Sequence[str]) -> None:
        for start in range(0, len(refs), _ADMIN_BATCH):
            for outcome in self._calls.each("rm_file", [(path,) for path in refs[start:start + _ADMIN_BATCH]]):
                if not isinstance(outcome, FileNotFoundError):
                    self._check(outcome, "delete")

    def capacity_bytes(self) -> int | None:
        return self.size or None

    def sweep(self) -> int:
        """Temporary objects of failed local writes (object stores PUT each object whole)."""
        return sweep_temporary(self.root) if isinstance(self.fs, LocalFileSystem) else 0

    def _find(self) -> list[str]:
        found = self._calls.listing(self.root)
        if isinstance(found, FileNotFoundError):
            return []
        self._check(found, "list")
        return sorted(found)

    def _check(self, outcome, what: str) -> None:
        if not isinstance(outcome, BaseException):
            return
        text = describe_exception(outcome)
        if "credential" in text.lower():
            fix = ("give credentials through the environment (for s3://: AWS_ACCESS_KEY_ID and "
                   "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or name a profile in storage_options")
        elif isinstance(outcome, TimeoutError):
            fix = f"the store did not answer within timeout={self.timeout} s; check its endpoint"
        else:
            fix = "check the url, the storage_options and that the store is reachable"
        raise CoreKVError(f"{self.url}: {what} failed ({text}); {fix}") from outcome


def _read_listed(path: str) -> bytes | FileNotFoundError:
    """A listed local object for ``corekv store``: its bytes; ``b""`` (a bad entry to verify,
    removed by --delete-bad) for what is not a regular file of at most MAX_ENTRY_BYTES."""
    try:
        return read_regular_file(path, MAX_ENTRY_BYTES)
    except FileNotFoundError as e:
        return e
    except OSError as e:
        logger.warning("%s is not a block entry (%s); listed as empty", path, describe_exception(e))
        return b""


def _is_unsatisfiable_range(outcome) -> bool:
    # NOTE: S3 answers a ranged GET of an empty object with 416, which s3fs raises as EINVAL
    return isinstance(outcome, OSError) and outcome.errno == errno.EINVAL and "range" in str(outcome).lower()


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
            "storage_options": Option("mapping", default=None,
                                      help="options for the filesystem (s3fs: endpoint_url, profile, "
                                      "client_kwargs: {region_name: ...}); never credentials: "
                                      "those come from the environment or a profile"),
            "timeout": Option("float", default=5.0, minimum=0.001,
                              help="seconds a call to the store may take (connect, read, retries); "
                              "past it the batch's blocks are misses and the store cools down"),
            "retry_interval": Option("float", default=5.0, minimum=0,
                                     help="seconds to treat a failed store as down before retrying"),
            "concurrency": Option("int", default=16, minimum=1,
                                  help="calls to a remote store in flight at once per batch"),
        },
        description="one object per KV block under any fsspec URL (local disk, object stores)",
    )]
