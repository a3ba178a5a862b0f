"""``lmdb``: KV blocks in an LMDB environment on local disk, shared by the machine's processes.

The store's layout is written once, here, for the tier (one model's entries) and its admin view
(every model's, for ``corekv store``): named DB ``blocks`` maps ``model digest[:6] + block hash``
to the entry, named DB ``access`` maps the same keys to the last access time, and named DB
``stats`` maps them to what eviction policies other than LRU read: the time the entry was stored,
its hits and its priority (``<QIi``: ns, count, the highest priority it was written with; a record
of the 12-byte ``<QI`` format stores wrote before priorities reads as priority 0, and a key without
a readable one as stored at its last access, never hit, priority 0).
"""
from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterator, Sequence

import lmdb

from corekv.errors import ConfigError, CoreKVError
from corekv.eviction import EntryStats, EvictionPolicy, make_policy
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier
from corekv.tier_admin import EntryUse, StoreAdmin, StoredEntry
from corekv.tiers.lmdb_file import close_lmdb, open_lmdb

logger = logging.getLogger(__name__)
_KEY_PREFIX_BYTES = 6
_BLOCKS_DB, _ACCESS_DB, _STATS_DB = b"blocks", b"access", b"stats"
_STATS = struct.Struct("<QIi")  # stored at (ns), hits, priority
_STATS_V1 = struct.Struct("<QI")  # stored at (ns), hits: the records of stores written before priorities
#: the record holds a priority as an i32; one outside is stored clamped (priorities are small
#: ints in practice, and a clamped one still sorts above or below every other)
_PRIORITY_RANGE = (-2**31, 2**31 - 1)
_FLUSH_ACCESS_EVERY = 256
_EPOCH_KEY = b"\x00corekv-epoch"  # in the access DB; never a block key (those are 22+ bytes)


#: LMDB's errors that mean the file itself is damaged (not a full map or a busy reader table)
_DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError)


class StoreDamagedError(CoreKVError):
    """A store's file is damaged: a page or an entry lies outside it, or its B-tree is broken."""


def _split_db_key(db_key: bytes) -> tuple[str, BlockHash]:
    """The model's 12 hex digits and the block hash of a ``blocks`` key."""
    return db_key[:_KEY_PREFIX_BYTES].hex(), db_key[_KEY_PREFIX_BYTES:]


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

    A store that cannot be opened (a truncated, damaged or foreign ``data.mdb``, a file for a
    folder, no access) raises :class:`ConfigError` for ``path`` before LMDB maps anything: every
    B-tree page is checked then (:func:`corekv.tiers.lmdb_file.open_lmdb`). A damaged page LMDB
    reports later (``CorruptedError``, ``PageNotFoundError``, ``BadTxnError``) quarantines the store
    in this process: logged once, every lookup a counted miss, nothing written.
    NOTE: a data file damaged or truncated *while* a process has it mapped can still kill that
    process with SIGBUS: py-lmdb touches every page of a value inside ``get`` (its preload), before
    any check of ours could run; only not mapping the file would avoid that.
    """

    is_persistent = True
    is_shared = True
    supports_listing = True
    keeps_priorities = True

    def __init__(self, *, path: str, size: int, block_bytes: int, fingerprint: bytes,
                 dtype: str = "uint8", shape: Sequence[int] | None = None, name: str | None = None,
                 max_readers: int = 126, sync: bool = True, evict_high: float = 0.9,
                 evict_low: float = 0.8, eviction: str | EvictionPolicy | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "lmdb")
        self.eviction = make_policy(eviction)
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
        self.env = _open_store(self.path, size=size, max_readers=max_readers, sync=sync)
        # NOTE: a process killed while reading leaves a stale reader slot that would pin old
        # pages forever (the map then fills up); clearing them on open keeps eviction effective.
        self.env.reader_check()
        self._blocks = self.env.open_db(_BLOCKS_DB)
        self._access = self.env.open_db(_ACCESS_DB)
        self._stats_db = self.env.open_db(_STATS_DB)
        self._page_bytes = self.env.stat()["psize"]
        self._key_prefix = self.codec.model_digest[:_KEY_PREFIX_BYTES]
        self._pending_access: dict[bytes, int] = {}
        self._pending_hits: dict[bytes, int] = {}
        self.evict_high, self.evict_low = evict_high, evict_low
        self._is_full_logged = False
        #: why this process quarantined the store (a damaged page found while reading); None: healthy
        self.damage: str | None = None

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
                    found.append(_split_db_key(key)[1])
        return iter(found)

    # ---------------------------------------------------------------- primitives
    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        if self.damage is not None:
            return [None] * len(keys)
        try:
            with self.env.begin() as txn:
                entries = [txn.get(self._key_prefix + key, db=self._blocks) for key in keys]
        except lmdb.Error as e:
            self._count_error("read", e)
            return [None] * len(keys)
        now, hits = time.time_ns(), self._pending_hits
        for key, entry in zip(keys, entries):
            if entry is not None:
                db_key = self._key_prefix + key
                self._pending_access[db_key] = now
                hits[db_key] = hits.get(db_key, 0) + 1
        if len(self._pending_access) >= _FLUSH_ACCESS_EVERY:
            self._flush_access()
        return entries

    def _visit_entries(self, keys: list[BlockHash], visit) -> None:
        # NOTE: with buffers=True an entry is a view of LMDB's map, valid until the read
        # transaction ends; visit() copies them out before that, so a reload copies only once.
        now, hit_keys, found = time.time_ns(), [], []
        if self.damage is not None:
            return
        try:
            with self.env.begin(buffers=True) as txn:
                for index, key in enumerate(keys):
                    entry = txn.get(self._key_prefix + key, db=self._blocks)
                    if entry is not None:
                        hit_keys.append(self._key_prefix + key)
                        found.append((index, entry))
                visit(found)
        except lmdb.Error as e:
            hit_keys = []
            self._count_error("read", e)
        hits = self._pending_hits
        for db_key in hit_keys:
            self._pending_access[db_key] = now
            hits[db_key] = hits.get(db_key, 0) + 1
        if len(self._pending_access) >= _FLUSH_ACCESS_EVERY:
            self._flush_access()

    def _write_entries(self, items, priorities=None) -> int:
        if self.damage is not None:
            return 0
        need = sum(self._pages_for(sum(len(p) for p in parts)) for _, parts in items)
        map_bytes = self.capacity_bytes
        try:
            if self.used_bytes + need > self.evict_high * map_bytes:
                self._evict(int(self.evict_low * map_bytes) - need)
                self._bump_epoch()
            for attempt in range(2):
                try:
                    return self._write_txn(items, priorities)
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
            return self._write_one_by_one(items, priorities)
        except lmdb.Error as e:
            self._count_error("write", e)
            return 0

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        # NOTE: a cursor's set_key, not a get, which would touch every page of each entry (see
        # _write_txn): membership must not fault in (or read from disk) the entries it asks about
        if self.damage is not None:
            return [False] * len(keys)
        try:
            with self.env.begin() as txn:
                cursor = txn.cursor(db=self._blocks)
                return [cursor.set_key(self._key_prefix + key) for key in keys]
        except lmdb.Error as e:
            self._count_error("read", e)
            return [False] * len(keys)

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        if self.damage is not None:
            return
        try:
            db_keys = [self._key_prefix + key for key in keys]
            with self.env.begin(write=True) as txn:
                _delete_db_keys(txn, db_keys, self._blocks, self._access, self._stats_db)
            for db_key in db_keys:
                self._pending_access.pop(db_key, None)
                self._pending_hits.pop(db_key, None)
        except lmdb.Error as e:
            self._count_error("delete", e)

    def _close(self) -> None:
        try:
            if self.damage is None:
                self._flush_access()
        finally:
            close_lmdb(self.env)

    # ---------------------------------------------------------------- helpers
    def _flush_access(self) -> None:
        if not self._pending_access or self.damage is not None:
            return
        try:
            self._write_txn([])
        except lmdb.Error as e:
            # NOTE: access stamps only order eviction; losing a batch of them (map full, disk
            # error) must never turn a successful read into an exception.
            self._pending_access.clear()
            self._pending_hits.clear()
            self._count_error("access update", e)

    def _write_txn(self, items, priorities=None) -> int:
        now = time.time_ns().to_bytes(8, "little")
        num_written = num_bytes = 0
        # NOTE: presence is a cursor's set_key, never a get: py-lmdb's get (and a cursor's value)
        # touches every page of the value before it returns, so a check would read the whole
        # entry (from disk for lmdb, page faults for shm; BENCHMARKS.md, "The warm single prompt").
        # buffers=True: a stats get returns a view of the map, not a copy.
        with self.env.begin(write=True, buffers=True) as txn:
            hits, blocks = self._pending_hits, txn.cursor(db=self._blocks)
            for db_key, stamp in self._pending_access.items():
                if blocks.set_key(db_key):  # it may have been evicted since
                    txn.put(db_key, stamp.to_bytes(8, "little"), db=self._access)
                    if db_key in hits:
                        stored_at, num_hits, priority = _read_stats(txn.get(db_key, db=self._stats_db), stamp)
                        txn.put(db_key, _STATS.pack(stored_at, min(num_hits + hits[db_key], 2**32 - 1),
                                                    priority), db=self._stats_db)
            for index, (key, parts) in enumerate(items):
                db_key = self._key_prefix + key
                entry = parts[0] if len(parts) == 1 else b"".join(parts)
                priority = 0 if priorities is None else min(max(priorities[index], _PRIORITY_RANGE[0]),
                                                            _PRIORITY_RANGE[1])
                if txn.put(db_key, entry, db=self._blocks, overwrite=False):
                    num_written += 1
                    num_bytes += len(entry)
                    txn.put(db_key, _STATS.pack(int.from_bytes(now, "little"), 0, priority), db=self._stats_db)
                elif priority:
                    # NOTE: a key keeps the highest priority it was written with (any process's
                    # write): a block's priority is already the highest of the requests that used
                    # it, and a write from a device that saw fewer of them must not demote it
                    stored_at, num_hits, old = _read_stats(txn.get(db_key, db=self._stats_db),
                                                           int.from_bytes(now, "little"))
                    if priority > old:
                        txn.put(db_key, _STATS.pack(stored_at, num_hits, priority), db=self._stats_db)
                txn.put(db_key, now, db=self._access)
        self._pending_access.clear()
        self._pending_hits.clear()
        self._stats["puts"] += num_written
        self._stats["bytes_written"] += num_bytes
        return len(items)

    def _write_one_by_one(self, items, priorities=None) -> int:
        num_stored = 0
        for index, item in enumerate(items):
            try:
                num_stored += self._write_txn([item], None if priorities is None else [priorities[index]])
            except lmdb.MapFullError:
                break
        return num_stored

    def _evict(self, target_bytes: int) -> None:
        """Delete entries (of any model) in the eviction policy's order (least recently used
        first by default) until live pages fit target_bytes."""
        num_evicted = 0
        with self.env.begin(write=True, buffers=True) as txn:
            live = self._live_bytes(txn)
            if live <= target_bytes:
                return
            stamped = {bytes(k): int.from_bytes(v, "little") for k, v in txn.cursor(db=self._access)}
            stats = {bytes(k): bytes(v) for k, v in txn.cursor(db=self._stats_db)}
            order_key = self.eviction.key

            def entry_key(db_key: bytes):
                last = stamped.get(db_key, 0)
                stored_at, num_hits, priority = _read_stats(stats.get(db_key), last)
                return order_key(EntryStats(last, num_hits, priority, stored_at))

            # NOTE: the same (key, db_key) sort as before policies were a seam: with LRU the key
            # is the access stamp, so LRU evicts exactly the entries it evicted then.
            order = sorted(((entry_key(k), k) for k in map(bytes, txn.cursor(db=self._blocks)
                                                              .iternext(values=False))))
            for _, db_key in order:
                if live <= target_bytes:
                    break
                live -= self._pages_for(len(txn.get(db_key, db=self._blocks)))
                _delete_db_keys(txn, [db_key], self._blocks, self._access, self._stats_db)
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
        for stat in (self.env.stat(), txn.stat(self._blocks), txn.stat(self._access),
                     txn.stat(self._stats_db)):
            pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return pages * self._page_bytes

    def _pages_for(self, num_bytes: int) -> int:
        """Bytes of the overflow pages an entry of ``num_bytes`` occupies (16: page header)."""
        return -(-(num_bytes + 16) // self._page_bytes) * self._page_bytes

    def _count_error(self, what: str, error: Exception) -> None:
        self._stats["errors"] += 1
        if isinstance(error, _DAMAGE_ERRORS):
            # NOTE: a damaged B-tree gives more wrong sizes and page numbers; reading on risks a
            # SIGBUS and writing on spreads the damage, so this process leaves the store alone.
            self.damage = f"{type(error).__name__}: {error}"
            logger.error("tier %s: the LMDB store at %s is damaged (%s); this process no longer "
                         "reads or writes it (every lookup is a miss). Run `corekv store verify`, "
                         "then move the folder away or delete it", self.name, self.path, self.damage)
            return
        logger.warning("tier %s: LMDB %s failed (%s: %s); treated as a miss/skip",
                       self.name, what, type(error).__name__, error)


class LMDBAdmin(StoreAdmin):
    """The LMDB store at ``path`` seen whole: every model's entries (``corekv store``).

    Takes the tier's options: ``size`` is the map size to open with, ``max_readers`` and ``sync``
    as for the tier; ``evict_high`` and ``evict_low`` are accepted and unused (a view never
    evicts). It counts as this process's one open of ``path``, as an :class:`LMDBTier` does.
    """

    def __init__(self, *, path: str, size: int, max_readers: int = 126, sync: bool = True,
                 evict_high: float = 0.9, evict_low: float = 0.8, eviction: str | None = None):
        self.path = os.path.realpath(os.fspath(path))
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no LMDB store at {self.path} (nothing was stored yet, or "
                                    "cache.tiers[].path points elsewhere)")
        try:
            self.env = _open_store(self.path, size=size, max_readers=max_readers, sync=sync)
        except ConfigError as e:
            # NOTE: for the store tools a damaged store is a run-time failure (exit code 1),
            # not a config field: the path is right, the data behind it is not.
            raise CoreKVError(str(e)) from e
        self._blocks = self.env.open_db(_BLOCKS_DB)
        self._access = self.env.open_db(_ACCESS_DB)
        self._stats_db = self.env.open_db(_STATS_DB)
        self._is_closed = False

    def entries(self) -> Iterator[StoredEntry]:
        """Every entry; a damaged page met on the way raises :class:`StoreDamagedError`."""
        # NOTE: streamed inside one read transaction (a snapshot; writers are not blocked), so a
        # 20 GiB store is never held in memory; callers delete only after iterating.
        try:
            with self.env.begin() as txn:
                for db_key, data in txn.cursor(db=self._blocks):
                    model, key = _split_db_key(db_key)
                    yield StoredEntry(db_key, key, model, data)
        except lmdb.Error as e:
            raise StoreDamagedError(f"the LMDB store at {self.path} is damaged "
                                    f"({type(e).__name__}: {' '.join(str(e).split())}); move its "
                                    "folder away or delete it") from e

    def delete(self, refs: Sequence[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            _delete_db_keys(txn, refs, self._blocks, self._access, self._stats_db)

    #: NOTE: a running tier writes its hits' stamps in batches (every 256 hits, on its next
    #: write and on close), so a use may show up to that late
    age_basis = "last read or write"

    def usage(self) -> Iterator[EntryUse]:
        """Every entry's size and access stamp (an entry without one counts as used at the epoch)."""
        try:
            # NOTE: buffers=True: the sizes are read from the map without copying the entries
            with self.env.begin(buffers=True) as txn:
                for db_key, data in txn.cursor(db=self._blocks):
                    stamp = txn.get(db_key, db=self._access)
                    last_used = int.from_bytes(stamp, "little") / 1e9 if stamp is not None else 0.0
                    db_key = bytes(db_key)
                    yield EntryUse(db_key, _split_db_key(db_key)[0], len(data), last_used)
        except lmdb.Error as e:
            raise StoreDamagedError(f"the LMDB store at {self.path} is damaged "
                                    f"({type(e).__name__}: {' '.join(str(e).split())}); move its "
                                    "folder away or delete it") from e

    def capacity_bytes(self) -> int:
        return self.env.info()["map_size"]

    def close(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            close_lmdb(self.env)


def _open_store(path: str, *, size: int, max_readers: int, sync: bool) -> lmdb.Environment:
    return open_lmdb(path, map_size=size, max_dbs=3, max_readers=max_readers, lock=True,
                     subdir=True, sync=sync, metasync=sync)


def _read_stats(record, last_access: int) -> tuple[int, int, int]:
    """``(stored at, hits, priority)`` of a ``stats`` record. NOTE: a record of the format before
    priorities (12 bytes) reads as priority 0 and one of any other size (or none) as stored at
    ``last_access``, never hit, priority 0: a store written by an older corekv, or damaged, only
    orders eviction worse, it never fails a write."""
    if record is not None:
        if len(record) == _STATS.size:
            return _STATS.unpack(record)
        if len(record) == _STATS_V1.size:
            return (*_STATS_V1.unpack(record), 0)
    return last_access, 0, 0


def _delete_db_keys(txn, db_keys, *dbs) -> None:
    """Delete entries and their access stamps and stats (absent keys are ignored) in ``txn``."""
    for db_key in db_keys:
        for db in dbs:
            txn.delete(db_key, db=db)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="lmdb",
        factory=LMDBTier,
        admin=LMDBAdmin,
        options={
            "path": Option("str", help="directory of the LMDB environment, e.g. ./kvstore"),
            "size": Option("size", default=20 * 1024**3, help="LMDB map size (disk bytes)", minimum=1),
            "max_readers": Option("int", default=126, help="reader slots (threads x processes)", minimum=1),
            "sync": Option("bool", default=True, help="fsync each commit (off: faster, a power "
                           "loss may drop the last writes)"),
            "evict_high": Option("float", default=0.9, help="evict when this full", minimum=0),
            "evict_low": Option("float", default=0.8, help="evict down to this fraction", minimum=0),
            "eviction": Option("eviction", default="lru", help=(
                "which entries a full store deletes first: lru, lfu, priority (the lowest priority "
                "of the requests that used a block first, ties lru), a plugin's policy")),
        },
        description="KV blocks in an LMDB file on local disk, LRU by default, shared by the machine's processes",
    )]
