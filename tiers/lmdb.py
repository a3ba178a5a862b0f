"""``lmdb``: KV blocks in an LMDB environment on local disk, shared by the machine's processes."""
from __future__ import annotations

import logging
import os
import struct
import threading
import time
from array import array
from collections.abc import Iterator, Sequence

import lmdb

from corekv.errors import ConfigError, describe_exception
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier

logger = logging.getLogger(__name__)
_open_paths: set[str] = set()
_open_paths_lock = threading.Lock()
_KEY_PREFIX_BYTES = 6
_FLUSH_ACCESS_EVERY = 256
_EPOCH_KEY = b"\x00corekv-epoch"  # in the access DB; never a block key (those are 22+ bytes)


class LMDBTier(Tier):
    """One LMDB entry per block, keyed ``model digest[:6] + block hash``, evicted by LRU.

    Invariants: named DB ``blocks`` maps key -> entry, ``access`` maps key -> last access time
    (ns, little-endian u64), written in the same transaction as the block, so a crash leaves both
    or neither; hits update ``access`` in batches (on the next write, every 256 hits, and on close);
    before a write that would take the live pages above ``evict_high`` of the map, the oldest
    entries (of any model) are deleted down to ``evict_low``. LMDB's own lock file serialises
    writers across processes and readers never block; one process opens a path at most once
    (LMDB's rule), which this class enforces, and a forked child must open its own (LMDB
    environments do not survive ``fork``; use the ``spawn`` start method or open after forking).

    A store that cannot be opened (a truncated or foreign ``data.mdb``, a file for a folder, no
    access) raises :class:`ConfigError` for ``path`` before LMDB maps anything (:func:`open_lmdb`).
    A data file truncated while a process has it mapped still kills that process with SIGBUS when
    it next reads a lost page; only not mapping the file would avoid that.
    """

    is_persistent = True
    is_shared = True
    supports_listing = True

    def __init__(self, *, path: str, size: int, block_bytes: int, fingerprint: bytes,
                 dtype: str = "uint8", shape: Sequence[int] | None = None, name: str | None = None,
                 max_readers: int = 126, sync: bool = True, evict_high: float = 0.9,
                 evict_low: float = 0.8):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "lmdb")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(f"path must be a directory path, got {path!r}; set "
                              "cache.tiers[].path", path="path")
        min_size = 4 * self.codec.entry_bytes
        if not isinstance(size, int) or size < min_size:
            raise ConfigError(f"size must be at least 4 block entries ({min_size} bytes), got "
                              f"{size!r}; raise cache.tiers[].size (e.g. 20GiB)", path="size")
        if not 0 < evict_low < evict_high <= 1:
            option = "evict_low" if 0 < evict_high <= 1 else "evict_high"
            raise ConfigError(f"evict_low={evict_low!r} and evict_high={evict_high!r} must satisfy "
                              "0 < evict_low < evict_high <= 1 (fractions of size), e.g. 0.8 "
                              "and 0.9", path=option)
        self.path = os.path.realpath(os.fspath(path))
        with _open_paths_lock:
            if self.path in _open_paths:
                raise ValueError(f"LMDB path {self.path!r} is already open in this process; LMDB "
                                 "forbids opening it twice: share the one LMDBTier object")
            self.env = open_lmdb(self.path, map_size=size, max_dbs=2, max_readers=max_readers,
                                 lock=True, subdir=True, sync=sync, metasync=sync)
            _open_paths.add(self.path)
        # NOTE: a process killed while reading leaves a stale reader slot that would pin old
        # pages forever (the map then fills up); clearing them on open keeps eviction effective.
        self.env.reader_check()
        self._blocks = self.env.open_db(b"blocks")
        self._access = self.env.open_db(b"access")
        self._page_bytes = self.env.stat()["psize"]
        self._key_prefix = self.codec.model_digest[:_KEY_PREFIX_BYTES]
        self._pending_access: dict[bytes, int] = {}
        self.evict_high, self.evict_low = evict_high, evict_low
        self._is_full_logged = False

    # ---------------------------------------------------------------- usage
    @property
    def capacity_bytes(self) -> int:
        return self.env.info()["map_size"]

    @property
    def used_bytes(self) -> int:
        with self.env.begin() as txn:
            return self._live_bytes(txn)

    @property
    def num_entries(self) -> int:
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self._blocks)
            if not cursor.set_range(self._key_prefix):
                return 0
            return sum(1 for key in cursor.iternext(values=False) if key.startswith(self._key_prefix))

    def keys(self) -> Iterator[BlockHash]:
        with self._lock, self.env.begin() as txn:
            cursor = txn.cursor(db=self._blocks)
            found = []
            if cursor.set_range(self._key_prefix):
                for key in cursor.iternext(values=False):
                    if not key.startswith(self._key_prefix):
                        break
                    found.append(key[_KEY_PREFIX_BYTES:])
        return iter(found)

    # ---------------------------------------------------------------- primitives
    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        try:
            with self.env.begin() as txn:
                entries = [txn.get(self._key_prefix + key, db=self._blocks) for key in keys]
        except lmdb.Error as e:
            self._count_error("read", e)
            return [None] * len(keys)
        now = time.time_ns()
        for key, entry in zip(keys, entries):
            if entry is not None:
                self._pending_access[self._key_prefix + key] = now
        if len(self._pending_access) >= _FLUSH_ACCESS_EVERY:
            self._flush_access()
        return entries

    def _visit_entries(self, keys: list[BlockHash], visit) -> None:
        # NOTE: with buffers=True an entry is a view of LMDB's map, valid until the read
        # transaction ends; visit() copies them out before that, so a reload copies only once.
        now, hit_keys, found = time.time_ns(), [], []
        try:
            with self.env.begin(buffers=True) as txn:
                for index, key in enumerate(keys):
                    entry = txn.get(self._key_prefix + key, db=self._blocks)
                    if entry is not None:
                        hit_keys.append(self._key_prefix + key)
                        found.append((index, entry))
                visit(found)
        except lmdb.Error as e:
            self._count_error("read", e)
        for db_key in hit_keys:
            self._pending_access[db_key] = now
        if len(self._pending_access) >= _FLUSH_ACCESS_EVERY:
            self._flush_access()

    def _write_entries(self, items) -> int:
        need = sum(self._pages_for(sum(len(p) for p in parts)) for _, parts in items)
        map_bytes = self.capacity_bytes
        try:
            if self.used_bytes + need > self.evict_high * map_bytes:
                self._evict(int(self.evict_low * map_bytes) - need)
                self._bump_epoch()
            for attempt in range(2):
                try:
                    return self._write_txn(items)
                except lmdb.MapFullError:
                    # NOTE: freed pages are reusable only after the deleting transaction commits
                    # and older readers finish, so a first eviction can still leave the map full.
                    if attempt == 0:
                        self._evict(int(self.evict_low * map_bytes) - 2 * need)
                        self._bump_epoch()
            if not self._is_full_logged:
                logger.warning("tier %s: LMDB map at %s is full even after eviction; skipping "
                               "writes (raise its size)", self.name, self.path)
                self._is_full_logged = True
            return self._write_one_by_one(items)
        except lmdb.Error as e:
            self._count_error("write", e)
            return 0

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        try:
            with self.env.begin(buffers=True) as txn:
                return [txn.get(self._key_prefix + key, db=self._blocks) is not None for key in keys]
        except lmdb.Error as e:
            self._count_error("read", e)
            return [False] * len(keys)

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(self._key_prefix + key, db=self._blocks)
                    txn.delete(self._key_prefix + key, db=self._access)
                    self._pending_access.pop(self._key_prefix + key, None)
        except lmdb.Error as e:
            self._count_error("delete", e)

    def _close(self) -> None:
        try:
            self._flush_access()
        finally:
            self.env.close()
            with _open_paths_lock:
                _open_paths.discard(self.path)

    # ---------------------------------------------------------------- helpers
    def _flush_access(self) -> None:
        if not self._pending_access:
            return
        try:
            self._write_txn([])
        except lmdb.Error as e:
            # NOTE: access stamps only order eviction; losing a batch of them (map full, disk
            # error) must never turn a successful read into an exception.
            self._pending_access.clear()
            self._count_error("access update", e)

    def _write_txn(self, items) -> int:
        now = time.time_ns().to_bytes(8, "little")
        num_written = num_bytes = 0
        with self.env.begin(write=True) as txn:
            for db_key, stamp in self._pending_access.items():
                if txn.get(db_key, db=self._blocks) is not None:  # it may have been evicted since
                    txn.put(db_key, stamp.to_bytes(8, "little"), db=self._access)
            for key, parts in items:
                db_key = self._key_prefix + key
                entry = parts[0] if len(parts) == 1 else b"".join(parts)
                if txn.put(db_key, entry, db=self._blocks, overwrite=False):
                    num_written += 1
                    num_bytes += len(entry)
                txn.put(db_key, now, db=self._access)
        self._pending_access.clear()
        self._stats["puts"] += num_written
        self._stats["bytes_written"] += num_bytes
        return len(items)

    def _write_one_by_one(self, items) -> int:
        num_stored = 0
        for item in items:
            try:
                num_stored += self._write_txn([item])
            except lmdb.MapFullError:
                break
        return num_stored

    def _evict(self, target_bytes: int) -> None:
        """Delete least recently used entries (of any model) until live pages fit target_bytes."""
        num_evicted = 0
        with self.env.begin(write=True, buffers=True) as txn:
            live = self._live_bytes(txn)
            if live <= target_bytes:
                return
            stamped = {bytes(k): int.from_bytes(v, "little") for k, v in txn.cursor(db=self._access)}
            order = sorted(((stamped.get(bytes(k), 0), bytes(k))
                            for k in txn.cursor(db=self._blocks).iternext(values=False)))
            for _, db_key in order:
                if live <= target_bytes:
                    break
                live -= self._pages_for(len(txn.get(db_key, db=self._blocks)))
                txn.delete(db_key, db=self._blocks)
                txn.delete(db_key, db=self._access)
                num_evicted += 1
        self._stats["evictions"] += num_evicted

    def _bump_epoch(self) -> None:
        # NOTE: LMDB reuses pages freed by transaction T only from transaction T + 2 on (the
        # previous snapshot stays intact for a reader that may still open it). One tiny commit
        # after an eviction makes the evicted pages available to the write that follows.
        with self.env.begin(write=True) as txn:
            epoch = int.from_bytes(txn.get(_EPOCH_KEY, b"", db=self._access), "little") + 1
            txn.put(_EPOCH_KEY, epoch.to_bytes(8, "little"), db=self._access)

    def _live_bytes(self, txn) -> int:
        pages = 0
        for stat in (self.env.stat(), txn.stat(self._blocks), txn.stat(self._access)):
            pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return pages * self._page_bytes

    def _pages_for(self, num_bytes: int) -> int:
        """Bytes of the overflow pages an entry of ``num_bytes`` occupies (16: page header)."""
        return -(-(num_bytes + 16) // self._page_bytes) * self._page_bytes

    def _count_error(self, what: str, error: Exception) -> None:
        self._stats["errors"] += 1
        logger.warning("tier %s: LMDB %s failed (%s: %s); treated as a miss/skip",
                       self.name, what, type(error).__name__, error)


# ---------------------------------------------------------------- the data file, before mapping
# LMDB's file layout on a 64-bit build (lmdb's mdb.c: MDB_page, MDB_meta, MDB_db, MDB_node), in
# the machine's byte order. Pages 0 and 1 are meta pages; the one with the larger txnid is current.
_PAGE_HEADER = struct.Struct("=QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_META = struct.Struct("=II")  # at byte 16: mm_magic, mm_version (mm_address, mm_mapsize follow)
# mm_dbs[0], the free-page DB, at byte 40: md_pad (the page size here), md_flags, md_depth,
# md_branch_pages, md_leaf_pages, md_overflow_pages, md_entries, md_root
_META_DB = struct.Struct("=IHHQQQQQ")
_META_TAIL = struct.Struct("=QQ")  # at byte 136, after mm_dbs[1]: mm_last_pg, mm_txnid
_META_BYTES = 152
_NODE = struct.Struct("=HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize; the key, then the data follow
_MAGIC, _DATA_VERSION, _NO_PAGE = 0xBEEFC0DE, 1, 2**64 - 1
_P_BRANCH, _P_LEAF, _P_META, _F_BIGDATA = 0x01, 0x02, 0x08, 0x01
_DAMAGED = ("the store is damaged: move its folder away or delete it (corekv store clear cannot "
            "read it either), or point path elsewhere")


def check_lmdb_file(path: str | os.PathLike) -> str | None:
    """Why the LMDB environment in directory ``path`` must not be opened, or ``None`` when it may.

    LMDB maps ``data.mdb`` whole, and reading a mapped page past the file's end kills the process
    with SIGBUS, which no exception handler sees. So this reads the two meta pages with plain file
    reads, before anything maps the file, and checks that the file holds every page the newer one
    counts. Pages at the end that are free need not be in the file (LMDB writes a page when it
    uses one and never reads a free one), so a shorter file is truncated only when the free-page
    DB does not list every missing page. The answer names the file, what is wrong and the fix.
    ``None`` also for a missing folder or ``data.mdb`` or an empty one: LMDB starts a fresh store.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return (f"{path} is a file, not a directory; point path at a directory for the LMDB store "
                "(it is created when missing), or move the file away")
    data_path = os.path.join(path, "data.mdb")
    if not os.path.lexists(data_path) or struct.calcsize("P") != 8:
        return None  # NOTE: the layout read here is a 64-bit build's; a 32-bit one goes unchecked
    try:
        with open(data_path, "rb") as file:
            problem, txnid = _check_data_file(file, data_path)
            for _ in range(2):
                # NOTE: a writer in another process may commit while the free-page DB is read and
                # reuse its pages; the verdict stands only when no commit happened meanwhile.
                if problem is None:
                    break
                again, txnid_again = _check_data_file(file, data_path)
                if txnid_again == txnid:
                    break
                problem, txnid = again, txnid_again
            return problem
    except OSError as e:
        return (f"{data_path} cannot be read ({describe_exception(e)}); make it a file this user "
                "can read and write, or point path elsewhere")


def open_lmdb(path: str, **options) -> lmdb.Environment:
    """``lmdb.open(path, **options)`` once :func:`check_lmdb_file` finds nothing wrong, creating
    the folder when missing.

    :raises ConfigError: for ``path``, naming what is wrong and the fix, for a store that
        :func:`check_lmdb_file` rejects or that LMDB fails to open.
    """
    problem = check_lmdb_file(path)
    if problem is not None:
        raise ConfigError(problem, path="path")
    try:
        os.makedirs(path, exist_ok=True)
        return lmdb.open(path, **options)
    except (OSError, lmdb.Error) as e:
        if isinstance(e, (lmdb.InvalidError, lmdb.VersionMismatchError)):
            # NOTE: data.mdb passed the check, so LMDB rejected lock.mdb, which it rebuilds by
            # itself unless another process holds it open.
            fix = ("its lock.mdb is not one this lmdb reads and another process holds it: stop the "
                   "processes that use the store, then delete lock.mdb (LMDB makes a new one)")
        else:
            fix = ("it must be a folder this user can read and write: fix its permissions, or "
                   "point path elsewhere")
        raise ConfigError(f"LMDB cannot open the store at {path} ({describe_exception(e)}); {fix}",
                          path="path") from e


def _check_data_file(file, data_path: str) -> tuple[str | None, int | None]:
    """``check_lmdb_file``'s answer for the open ``data.mdb`` and the txnid of its current meta."""
    first = _read_at(file, 0, _META_BYTES)
    if not first:
        return None, None  # zero bytes: LMDB writes the meta pages of an empty store
    if len(first) < _META_BYTES:
        return f"{data_path} is {len(first)} bytes, too short for LMDB's meta page; {_DAMAGED}", None
    problem = _meta_problem(first, 0)
    page_bytes = _META_DB.unpack_from(first, 40)[0]
    if problem is None and not (512 <= page_bytes <= 65536 and page_bytes & (page_bytes - 1) == 0):
        problem = f"meta page 0 names a page size of {page_bytes} bytes"
    if problem is not None:
        return f"{data_path} is not an LMDB data file ({problem}); {_DAMAGED}", None
    second = _read_at(file, page_bytes, _META_BYTES)
    # NOTE: the size is read after the meta pages: a writer grows the file before its meta page
    # names the new pages, so this order never sees a meta page ahead of the file.
    num_bytes = os.fstat(file.fileno()).st_size
    if len(second) < _META_BYTES:
        return _truncated(data_path, num_bytes, 2 * page_bytes), None
    problem = _meta_problem(second, 1)
    if problem is not None:
        return f"{data_path} is not an LMDB data file ({problem}); {_DAMAGED}", None
    last_page, txnid, free_root = max(
        ((*_META_TAIL.unpack_from(meta, 136), _META_DB.unpack_from(meta, 40)[7])
         for meta in (first, second)), key=lambda fields: fields[1])  # the newer meta page
    need_bytes = (last_page + 1) * page_bytes
    if num_bytes >= need_bytes:
        return None, txnid
    num_pages = num_bytes // page_bytes
    free = _free_pages(file, free_root, page_bytes, num_pages)
    if free is not None and sum(1 for p in free if p <= last_page) == last_page + 1 - num_pages:
        return None, txnid
    return _truncated(data_path, num_bytes, need_bytes), txnid


def _meta_problem(page: bytes, index: int) -> str | None:
    """What LMDB's own check of a meta page (``mdb_env_read_header``) would reject, or ``None``."""
    flags = _PAGE_HEADER.unpack_from(page)[2]
    magic, version = _META.unpack_from(page, 16)
    if magic != _MAGIC:
        return f"meta page {index} has magic {magic:#010x}, not LMDB's {_MAGIC:#x}"
    if not flags & _P_META:
        return f"page {index} is not marked as a meta page"
    if version != _DATA_VERSION:
        return (f"meta page {index} has data format version {version}; this lmdb reads "
                f"{_DATA_VERSION}")
    return None


def _truncated(data_path: str, num_bytes: int, need_bytes: int) -> str:
    return (f"{data_path} is truncated: {num_bytes} of the {need_bytes} bytes its meta page names; "
            f"{_DAMAGED}")


def _free_pages(file, root: int, page_bytes: int, num_pages: int) -> set[int] | None:
    """The free page numbers from ``num_pages`` on, read from the free-page DB rooted at ``root``
    (a B-tree of ID lists: ``[count, page numbers...]``); ``None`` when a page of that DB is
    missing from the file or is not a B-tree page."""
    found: set[int] = set()
    todo, seen = ([] if root == _NO_PAGE else [root]), set()
    try:
        while todo:
            page_number = todo.pop()
            if page_number in seen or page_number >= num_pages:
                return None
            seen.add(page_number)
            page = _read_at(file, page_number * page_bytes, page_bytes)
            _, _, flags, lower, _ = _PAGE_HEADER.unpack_from(page)
            if not flags & (_P_BRANCH | _P_LEAF) or not _PAGE_HEADER.size <= lower <= page_bytes:
                return None
            for (offset,) in struct.iter_unpack("=H", page[_PAGE_HEADER.size:lower & ~1]):
                lo, hi, node_flags, key_bytes = _NODE.unpack_from(page, offset)
                if flags & _P_BRANCH:
                    todo.append(lo | hi << 16 | node_flags << 32)  # a child's page number
                    continue
                data_bytes, start = lo | hi << 16, offset + _NODE.size + key_bytes
                if node_flags & _F_BIGDATA:  # the list lives on overflow pages from this one
                    (first,) = struct.unpack_from("=Q", page, start)
                    data = (_read_at(file, first * page_bytes + _PAGE_HEADER.size, data_bytes)
                            if first < num_pages else b"")
                else:
                    data = page[start:start + data_bytes]
                if len(data) != data_bytes or data_bytes < 8 or data_bytes % 8:
                    return None
                ids = array("Q", data)
                if ids[0] >= len(ids):
                    return None
                found.update(p for p in ids[1:ids[0] + 1] if p >= num_pages)
    except struct.error:  # a node offset past the page's end
        return None
    return found


def _read_at(file, offset: int, num_bytes: int) -> bytes:
    file.seek(offset)
    return file.read(num_bytes)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="lmdb",
        factory=LMDBTier,
        options={
            "path": Option("str", help="directory of the LMDB environment, e.g. ./kvstore"),
            "size": Option("size", default=20 * 1024**3, help="LMDB map size (disk bytes)", minimum=1),
            "max_readers": Option("int", default=126, help="reader slots (threads x processes)", minimum=1),
            "sync": Option("bool", default=True, help="fsync each commit (off: faster, a power "
                           "loss may drop the last writes)"),
            "evict_high": Option("float", default=0.9, help="evict when this full", minimum=0),
            "evict_low": Option("float", default=0.8, help="evict down to this fraction", minimum=0),
        },
        description="KV blocks in an LMDB file on local disk, LRU, shared by the machine's processes",
    )]
