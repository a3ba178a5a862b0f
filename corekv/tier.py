"""The storage tier interface: whole KV blocks stored by their chained hash.

A tier is a small zarr-like store. Subclasses implement four batch primitives on *entries*
(header + payload, see :mod:`corekv.block_format`): ``_read_entries``, ``_write_entries``,
``_contains_entries``, ``_delete_entries``, and the usage properties. The public methods here add
what every tier must do the same way: argument checks, encoding on ``put``, validation on ``get``
(a bad entry is a miss, counted as a fault, logged once per reason, and deleted), statistics, and
the closed check. The offload code (:mod:`corekv.offload`) calls only the public methods.

A tier object serves one model. A persistent tier's plugin also gives an admin view of its whole
store, every model's entries, for ``corekv store`` (:mod:`corekv.tier_admin`). A tier is built from
its plugin's ``TierSpec`` by :func:`corekv.tier_factory.make_tier`, which documents the factory
convention.

Remote tiers (redis, fsspec on an object store) handle their stores' faults with
:class:`corekv.tier_faults.Cooldowns`: a deadline on every call, then a cool-down per node or
endpoint, so a dead or stalled store costs one deadline per ``retry_interval``, and only the keys
it holds.

This module stays whole past ~350 lines because it is one concept, the base class whose public
methods share its checks, lock, statistics and fault handling (the verify thread serves
``get_into`` alone).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor, wait
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from corekv.block_format import EntryCodec, EntryError, EntryFault
from corekv.errors import PluginError

BlockHash = bytes
Payload = memoryview  # a read-only view of a block's validated bytes; bytes(p) copies it
STAT_NAMES = ("hits", "misses", "bytes_read", "bytes_written", "puts", "skips", "evictions",
              "faults", "errors")
logger = logging.getLogger(__name__)
#: keys per membership call of :meth:`Tier.exists`
_EXISTS_CHUNK = 16

_verifier: ThreadPoolExecutor | None = None
_verifier_lock = threading.Lock()


def _verify_thread() -> ThreadPoolExecutor:
    """The one thread (shared by every tier) that checks and copies entries beside ``get_into``'s caller.

    NOTE: a reload reads each entry twice, once to checksum it and once to copy it, and xxhash
    and numpy's copy both release the GIL: a second thread doing half the entries halves the
    time (BENCHMARKS.md, "Tiers in the engine", "Reload bandwidth at every size").
    """
    global _verifier
    with _verifier_lock:
        if _verifier is None:
            _verifier = ThreadPoolExecutor(1, thread_name_prefix="corekv-verify")
        return _verifier


def _forget_verifier_in_child() -> None:
    global _verifier, _verifier_lock
    _verifier, _verifier_lock = None, threading.Lock()  # the thread did not survive the fork


os.register_at_fork(after_in_child=_forget_verifier_in_child)


class Tier(ABC):
    """A store of whole KV blocks keyed by chained block hash.

    Invariants: ``get`` never returns bytes that failed the header and tag checks, nor an entry
    read under any key but the one it was written for (the tag covers the key); a failed
    entry is gone after the ``get`` that found it; ``put`` and ``get`` never raise because the
    store is full, down or corrupt (they skip or miss and count it). Public methods take one lock,
    so the offload writer may store from a background thread while the step thread loads.

    Capabilities (class attributes): ``is_persistent`` (outlives the process), ``is_shared``
    (other processes or machines see the same entries), ``supports_ttl``, ``supports_listing``
    (``keys()`` works), ``supports_swap`` (swap preemption may park sequences' blocks here: a
    memory store that gives back exactly the bytes put, fast enough to write on the step's thread,
    and ``delete`` works; ``load_config`` reads it from the spec's factory, the tier class),
    ``keeps_priorities`` (the store records each entry's eviction priority for its eviction
    policy: ``put`` then hands ``_write_entries`` the items' priorities, see there).
    """

    is_persistent = False
    is_shared = False
    supports_ttl = False
    supports_listing = False
    supports_swap = False
    keeps_priorities = False

    def __init__(self, *, block_bytes: int, fingerprint: bytes, dtype: str = "uint8",
                 shape: Sequence[int] | None = None, name: str | None = None):
        if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}; pass the "
                             "size of one block's KV in bytes")
        shape = (block_bytes,) if shape is None and dtype == "uint8" else shape
        if shape is None:
            raise ValueError(f"shape is required for dtype {dtype!r}; pass the block's KV shape")
        self.codec = EntryCodec(fingerprint=fingerprint, dtype=dtype, shape=shape)
        if self.codec.payload_bytes != block_bytes:
            raise ValueError(f"block_bytes={block_bytes} does not match dtype {dtype!r} and shape "
                             f"{tuple(shape)} ({self.codec.payload_bytes} bytes); pass consistent values")
        self.block_bytes = block_bytes
        self.name = name or type(self).__name__
        #: 12 hex digits of the model digest: the key prefix of tiers shared between models
        self.fp12 = self.codec.model_digest.hex()[:12]
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._logged_faults: set[EntryFault] = set()
        self._lock = threading.RLock()
        self._is_closed = False

    # ---------------------------------------------------------------- public batch API
    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each of ``keys`` is present, in order: one batch call for any number of keys.

        Entries are not validated here (that would read them): a damaged entry counts as present
        until the read that finds it deletes it. Only reads count hits and misses.
        """
        keys = self._check_keys(keys, "keys")
        if not keys:
            return []
        with self._lock:
            self._check_open()
            present = self._contains_entries(keys)
        if len(present) != len(keys):
            raise PluginError(f"tier {self.name!r} ({type(self).__name__}): _contains_entries "
                              f"answered {len(present)} of {len(keys)} keys; it must answer every "
                              "key, in order")
        return [bool(is_present) for is_present in present]

    def exists(self, keys: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``keys`` present (:meth:`contains_many`'s answers).

        NOTE: asked in chunks that stop at the first miss: a prefix lookup wants the leading run
        only, and a store that answers membership per key (an object store) should not be asked
        about a long chain's every block after it already missed.
        """
        keys = self._check_keys(keys, "keys")
        run = 0
        for start in range(0, len(keys), _EXISTS_CHUNK):
            for is_present in self.contains_many(keys[start:start + _EXISTS_CHUNK]):
                if not is_present:
                    return run
                run += 1
        return run

    def get(self, keys: Sequence[BlockHash]) -> list[Payload | None]:
        """Validated payloads in ``keys`` order; ``None`` for a miss or a rejected entry."""
        keys = self._check_keys(keys, "keys")
        with self._lock:
            self._check_open()
            entries = self._read_entries(keys) if keys else []
            payloads: list[Payload | None] = []
            bad_keys = []
            for key, entry in zip(keys, entries):
                payload = None
                if entry is not None:
                    try:
                        payload = self.codec.decode(key, entry)
                    except EntryError as e:
                        self._record_fault(key, e)
                        bad_keys.append(key)
                payloads.append(payload)
            if bad_keys:
                self._delete_entries(bad_keys)
            num_hits = sum(p is not None for p in payloads)
            self._stats["hits"] += num_hits
            self._stats["misses"] += len(keys) - num_hits
            self._stats["bytes_read"] += num_hits * self.block_bytes
        return payloads

    def get_into(self, keys: Sequence[BlockHash], out: Sequence[Any]) -> list[bool]:
        """Like :meth:`get`, but copy each hit's payload into ``out[i]`` and return hit flags.

        ``out[i]`` is a writable, C-contiguous buffer of ``block_bytes`` (a numpy row, a CPU
        tensor's ``.numpy()``, a pinned staging buffer): no per-block allocation, and tiers whose
        entries are already in memory (host, LMDB's map) copy once, straight from their storage.
        On a miss or a rejected entry ``out[i]`` is left as it was.
        """
        keys = self._check_keys(keys, "keys")
        if not isinstance(out, Sequence) or len(out) != len(keys):
            raise ValueError(f"out must be a sequence of {len(keys)} buffers (one per key), got "
                             f"{type(out).__name__} of length {len(out) if hasattr(out, '__len__') else '?'}")
        views = [self._check_out(buffer, i) for i, buffer in enumerate(out)]
        hits = [False] * len(keys)
        bad_keys = []

        def visit(found: list[tuple[int, Any]]) -> None:
            # NOTE: the caller and the verify thread take entries from one counter (atomic under
            # the GIL) and each checks an entry, then copies it while its bytes are still in that
            # core's cache: one read from memory per byte, no hand-off per entry, and whichever
            # thread runs takes the next entry (BENCHMARKS.md, "Reload bandwidth at every size").
            counter = itertools.count()
            outcomes: list[EntryError | None] = [None] * len(found)

            def check_and_copy() -> None:
                for n in counter:
                    if n >= len(found):
                        return
                    index, entry = found[n]
                    try:
                        payload = self.codec.decode(keys[index], entry)
                    except EntryError as e:
                        outcomes[n] = e  # never copied: an entry is copied only after its check passed
                        continue
                    np.copyto(views[index], np.frombuffer(payload, dtype=np.uint8))

            helper = _verify_thread().submit(check_and_copy) if len(found) > 1 else None
            try:
                check_and_copy()
            finally:
                if helper is not None:
                    wait([helper])  # the entries may be views that end with this call
            if helper is not None:
                helper.result()  # a bug on the verify thread raises here, as on the caller's
            for (index, _), error in zip(found, outcomes):
                if error is None:
                    hits[index] = True
                else:
                    self._record_fault(keys[index], error)
                    bad_keys.append(keys[index])

        with self._lock:
            self._check_open()
            if keys:
                self._visit_entries(keys, visit)
            if bad_keys:
                self._delete_entries(bad_keys)
            num_hits = sum(hits)
            self._stats["hits"] += num_hits
            self._stats["misses"] += len(keys) - num_hits
            self._stats["bytes_read"] += num_hits * self.block_bytes
        return hits

    def put(self, items: Sequence[tuple[BlockHash, Any]], priorities: Sequence[int] | None = None) -> int:
        """Store ``(key, payload)`` pairs; returns how many are stored (or were already).

        A tier that is full, down or unable to take an item skips it and counts a skip.

        :param priorities: per item, the eviction priority of its block (the highest of the
            requests that cached or hit it on the device; ``None``: all 0). A tier that
            ``keeps_priorities`` records them for its eviction policy (``priority`` evicts the
            lowest first); the others ignore them.
        """
        if not isinstance(items, Sequence) or isinstance(items, (bytes, str)):
            raise TypeError(f"items must be a sequence of (key, payload) pairs, got {type(items).__name__}")
        self._check_keys([item[0] for item in items], "items[i][0]")
        if priorities is not None and len(priorities) != len(items):
            raise ValueError(f"priorities has {len(priorities)} values for {len(items)} items; pass "
                             "one int per item, or None")
        encoded = [(key, (self.codec.header(key, payload), payload)) for key, payload in items]
        if not encoded:
            return 0
        with self._lock:
            self._check_open()
            # NOTE: all-0 priorities (the default) take the plain call, so a store that keeps
            # them pays nothing for requests that carry none
            if self.keeps_priorities and priorities is not None and any(priorities):
                num_stored = self._write_entries(encoded, list(priorities))
            else:
                num_stored = self._write_entries(encoded)
            self._stats["skips"] += len(encoded) - num_stored
        return num_stored

    def delete(self, keys: Sequence[BlockHash]) -> None:
        """Remove ``keys``; absent keys are ignored."""
        keys = self._check_keys(keys, "keys")
        if keys:
            with self._lock:
                self._check_open()
                self._delete_entries(keys)

    # ---------------------------------------------------------------- single-key helpers
    def get_one(self, key: BlockHash) -> Payload | None:
        return self.get([key])[0]

    def put_one(self, key: BlockHash, payload) -> bool:
        return self.put([(key, payload)]) == 1

    def contains(self, key: BlockHash) -> bool:
        return self.exists([key]) == 1

    def delete_one(self, key: BlockHash) -> None:
        self.delete([key])

    # ---------------------------------------------------------------- usage, stats, lifetime
    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Bytes the tier may hold (``None``: unbounded or decided by the server)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes the tier holds now (best effort for remote stores)."""

    @property
    @abstractmethod
    def num_entries(self) -> int:
        """Entries the tier holds now (for shared stores: every process's entries of this model)."""

    def stats(self) -> dict[str, int]:
        """Counters since this tier object was created: ``STAT_NAMES``."""
        with self._lock:
            return dict(self._stats)

    def is_reachable(self) -> bool:
        """Whether the tier's store answered when it opened. In-process and local stores are
        reachable once open; a tier that connects lazily to a server (redis) says whether it
        reached it, so a ``required: true`` tier whose server is down refuses to start."""
        return True

    def describe(self) -> dict[str, Any]:
        """Name, type, capabilities, block layout and usage (for ``corekv store stats``)."""
        return {
            "name": self.name, "type": type(self).__name__, "model": self.fp12,
            "dtype": self.codec.dtype, "shape": self.codec.shape, "block_bytes": self.block_bytes,
            "capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
            "num_entries": self.num_entries,
            **{flag: getattr(self, flag) for flag in ("is_persistent", "is_shared", "supports_ttl",
                                                       "supports_listing", "supports_swap")},
        }

    def keys(self) -> Iterator[BlockHash]:
        """Every key of this model in the tier (only when ``supports_listing``)."""
        raise NotImplementedError(f"tier {self.name!r} cannot list its keys (supports_listing=False)")

    def close(self) -> None:
        with self._lock:
            if not self._is_closed:
                self._is_closed = True
                self._close()

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block_bytes={self.block_bytes}, model={self.fp12})"

    # ---------------------------------------------------------------- primitives to implement
    @abstractmethod
    def _read_entries(self, keys: list[BlockHash]) -> list[Any]:
        """Raw entries (bytes-like) or ``None`` per key; errors of a remote store are misses."""

    @abstractmethod
    def _write_entries(self, items: list[tuple[BlockHash, tuple[Any, ...]]]) -> int:
        """Store each key's entry, given as buffers to concatenate (header, payload); return
        the number stored or already present. Count what only the store knows in
        ``self._stats``: ``puts`` and ``bytes_written`` (entries newly written), ``evictions``,
        ``errors`` (the store failed; the item is then not counted as stored).

        A tier that ``keeps_priorities`` takes a second argument, ``priorities`` (one int per
        item, not all 0; omitted: all 0), and keeps per key the highest it was written with.
        """

    @abstractmethod
    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        """Presence of every key, in order (one answer per key: :meth:`contains_many` returns
        them as they are); errors of a remote store are ``False``."""

    @abstractmethod
    def _delete_entries(self, keys: list[BlockHash]) -> None:
        """Remove keys; absent keys are ignored."""

    def _close(self) -> None:
        """Release resources (called once)."""

    def _visit_entries(self, keys: list[BlockHash], visit) -> None:
        """Call ``visit(found)`` once, ``found`` = ``[(i, entry)]`` for each present key ``keys[i]``
        in order; entries need only stay valid during the call, so a tier may pass views of its
        own storage (override to avoid a copy)."""
        visit([(index, entry) for index, entry in enumerate(self._read_entries(keys)) if entry is not None])

    # ---------------------------------------------------------------- helpers
    def _record_fault(self, key: BlockHash, error: EntryError) -> None:
        self._stats["faults"] += 1
        # NOTE: a corrupt store yields a fault per block; one warning per reason is enough to act
        # on, the rest would flood the log on the step path.
        level = logging.DEBUG if error.reason in self._logged_faults else logging.WARNING
        self._logged_faults.add(error.reason)
        logger.log(level, "tier %s: rejected entry %s (%s); treated as a miss and deleted",
                   self.name, key.hex(), error)

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError(f"tier {self.name!r} is closed; create a new one to use it again")

    def _check_out(self, buffer, index: int) -> np.ndarray:
        try:
            view = memoryview(buffer)
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        except (TypeError, ValueError) as e:
            raise TypeError(f"out[{index}] must be a writable C-contiguous buffer (numpy array, "
                            f"bytearray), got {type(buffer).__name__}: {e}") from e
        if view.readonly or view.nbytes != self.block_bytes:
            raise ValueError(f"out[{index}] must be writable and hold {self.block_bytes} bytes; got "
                             f"{view.nbytes} bytes, readonly={view.readonly}")
        return np.frombuffer(view, dtype=np.uint8)

    @staticmethod
    def _check_keys(keys: Sequence[BlockHash], argument: str) -> list[BlockHash]:
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            raise TypeError(f"{argument} must be a sequence of block hashes (bytes), got "
                            f"{type(keys).__name__}; wrap a single key in a list")
        for key in keys:
            if not isinstance(key, bytes) or not key:
                raise TypeError(f"{argument} must hold non-empty bytes block hashes, got {key!r}; "
                                "use corekv.hashing.block_hashes() to make keys")
        return list(keys)
