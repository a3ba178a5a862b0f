"""``shm``: KV blocks in shared memory that every process on the node sees (``/dev/shm``).

An LMDB environment on a memory file system (tmpfs): the scheduler and worker processes of a
vLLM instance, several vLLM instances and corekv engines on one machine open the same store and
read entries straight out of the shared mapping into their KV pools, with no server between
them. What LMDB gives is what a node-shared tier needs:

- a reader never sees a half-written entry (a write is visible only when its transaction
  commits, and a reader reads one snapshot);
- a process killed at any point (kill -9) leaves the store consistent: an uncommitted write is
  simply gone, the writer lock is a robust mutex the next writer takes over, and stale reader
  slots are cleared (at open and before every eviction);
- capacity is bounded (the map size) with eviction across processes in the order of the
  ``lmdb`` tier's policy (LRU by default; ``eviction: lfu`` keeps the most hit entries);
- the store outlives every process that uses it (until the machine restarts or it is cleared),
  as LMCache's server keeps its cache across vLLM restarts.

Entries are the ``lmdb`` tier's, so the integrity rules are every tier's (the key-bound checksum,
the model fingerprint, the optional MAC), and ``corekv store`` reads it like an ``lmdb`` store.
The comparison against the in-process ``host`` tier and a plain memcpy is in BENCHMARKS.md,
"The shared memory tier".
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from corekv.errors import ConfigError
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tiers.lmdb import LMDBAdmin, LMDBTier

logger = logging.getLogger(__name__)
DEFAULT_PATH = "/dev/shm/corekv"
#: file systems whose pages live in memory
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def file_system_type(path: str) -> str | None:
    """The type of the file system ``path`` is on (``/proc/mounts``; ``None`` where unknown)."""
    path = os.path.realpath(path)
    best, best_type = "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, best_type = mount, fields[2]
    except OSError:
        return None
    return best_type


def check_shm_path(path: str, size: int) -> None:
    """Refuse a store that could never hold ``size`` bytes; warn when it is not in memory.

    NOTE: a tmpfs smaller than the map would fail writes late and far from the cause (a
    container's ``/dev/shm`` is 64 MiB unless ``--shm-size`` says otherwise), so it is a
    config error at start, naming both numbers.
    """
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    kind = file_system_type(probe)
    if kind is not None and kind not in _MEMORY_FILE_SYSTEMS:
        logger.warning("shm tier: %s is on a %s file system, not in memory; it works (as an lmdb "
                       "tier would), but reads and writes go to that device", path, kind)
    try:
        stat = os.statvfs(probe)
    except OSError as e:
        raise ConfigError(f"path {path!r}: cannot inspect its file system ({e}); point path at a "
                          f"folder on a memory file system, e.g. {DEFAULT_PATH}", path="path") from e
    total = stat.f_blocks * stat.f_frsize
    if kind in _MEMORY_FILE_SYSTEMS and total < size:
        raise ConfigError(f"size {size} bytes is more than the {total} bytes of the {kind} at {probe}; "
                          "lower cache.tiers[].size or enlarge that file system (a container's /dev/shm: "
                          "docker run --shm-size)", path="size")


class ShmTier(LMDBTier):
    """The ``lmdb`` tier on a memory file system, with what only a node-shared memory store needs:
    no fsync (the pages are memory), the file system's size checked at start, stale readers of
    killed processes cleared before each eviction.

    Invariants: those of :class:`~corekv.tiers.lmdb.LMDBTier`.
    """

    # NOTE: a node-shared memory store can hold swapped blocks: entries are the exact bytes put
    # (checksummed, bound to their key), writes are memory copies (no fsync), and ``delete``
    # works. Full blocks go under their chain hashes, which other processes may share like any
    # offloaded block; a partial block's private key carries a per-process random nonce
    # (corekv.offload.swap), so no other process can hit, overwrite or delete it. A parked entry
    # evicted by another process's writes is a miss: recomputed, never wrong (and a killed
    # process's private entries stay until evicted like any other). The ``lmdb`` tier
    # (SSD) does not qualify: parking writes on the step's thread, and a disk write stalls it.
    supports_swap = True

    def __init__(self, *, size: int, block_bytes: int, fingerprint: bytes, path: str = DEFAULT_PATH,
                 dtype: str = "uint8", shape: Sequence[int] | None = None, name: str | None = None,
                 max_readers: int = 510, evict_high: float = 0.9, evict_low: float = 0.8,
                 eviction=None):
        if isinstance(path, (str, os.PathLike)) and str(path) and isinstance(size, int):
            check_shm_path(os.fspath(path), size)
        super().__init__(path=path, size=size, block_bytes=block_bytes, fingerprint=fingerprint,
                         dtype=dtype, shape=shape, name=name or "shm", max_readers=max_readers,
                         sync=False, evict_high=evict_high, evict_low=evict_low, eviction=eviction)

    def _evict(self, target_bytes: int) -> None:
        # NOTE: a reader slot of a process killed mid-read pins the pages of its snapshot, and
        # evicted pages would never be reused; on a node-shared store that is routine, not rare.
        self.env.reader_check()
        super()._evict(target_bytes)


class ShmAdmin(LMDBAdmin):
    """The shared memory store seen whole (``corekv store``); the ``lmdb`` tier's view."""

    def __init__(self, *, size: int, path: str = DEFAULT_PATH, max_readers: int = 510,
                 evict_high: float = 0.9, evict_low: float = 0.8, eviction: str | None = None):
        super().__init__(path=path, size=size, max_readers=max_readers, sync=False,
                         evict_high=evict_high, evict_low=evict_low)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="shm",
        factory=ShmTier,
        admin=ShmAdmin,
        options={
            "path": Option("str", default=DEFAULT_PATH, help="folder of the store on a memory file "
                           "system; every process naming it shares the entries"),
            "size": Option("size", default=4 * 1024**3, help="memory the store may use (its map size)",
                           minimum=1),
            "max_readers": Option("int", default=510, help="reader slots (threads x processes on the node)",
                                  minimum=1),
            "evict_high": Option("float", default=0.9, help="evict when this full", minimum=0),
            "evict_low": Option("float", default=0.8, help="evict down to this fraction", minimum=0),
            "eviction": Option("eviction", default="lru", help=(
                "which entries a full store deletes first: lru, lfu, priority (the lowest priority "
                "of the requests that used a block first, ties lru), a plugin's policy")),
        },
        description="KV blocks in shared memory (/dev/shm) that every process on the node sees, LRU by default",
    )]
