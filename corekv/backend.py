"""The prefix-cache backend interface: the index that owns the device KV pool's residency.

The engine talks to a backend with these verbs only; the backends in ``corekv.plugins``
(``hash_blocks``, ``radix``) and third-party ones implement them, and
``corekv.testing.BackendTests`` checks that they do.

A request's life, as the engine drives it::

    key = PrefixKey(prompt_ids, block_size, namespace)      # corekv.hashing
    hit = backend.match(key, max_blocks=(len(prompt_ids) - 1) // block_size)
    backend.acquire(hit)                                     # take refs, touch recency
    fresh = backend.allocate(n)                              # None: not enough room now
    ...compute KV into the blocks...
    backend.cache(key, block_ids)                            # full blocks become hittable
    backend.free(block_ids)                                  # when the request finishes
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from corekv.errors import CoreKVError
from corekv.hashing import BlockHash, PrefixKey


class PinLimitError(CoreKVError, ValueError):
    """Pinning would take more of the pool than the backend's pin cap allows."""


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block whose device slot is about to be reused (offered for write-back), with its
    eviction priority (:meth:`PrefixCacheBackend.block_priority`), which the tiers it is written
    to keep for their ``priority`` policy."""

    block_hash: BlockHash
    block_id: int
    priority: int = 0


@dataclass(frozen=True)
class BlockEvent:
    """A change of the device cache's content; ``kind`` is ``"stored"`` or ``"removed"``.

    * ``"stored"``: ``block_hashes`` became hittable. They are one contiguous run of one hash
      chain: ``parent_block_hash`` is the hash of the block just before the run (``None`` when the
      run starts the chain), ``token_ids`` the run's tokens, ``block_size`` per block (builtin
      backends fill all three; ``None`` / ``()`` from a backend that does not know them), and
      ``cache_salt`` the tenant salt of the chain (``None``: no salt, or not known).
    * ``"removed"``: ``block_hashes`` left the cache. ``is_cleared`` marks a reset of the whole
      cache (:meth:`PrefixCacheBackend.reset`): ``block_hashes`` then lists every block that was
      cached, possibly none, and KV-event publishers send ``AllBlocksCleared``.
    """

    kind: str
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    is_cleared: bool = False
    cache_salt: str | None = None


def stored_event(key: PrefixKey, start: int, stop: int) -> BlockEvent:
    """The ``"stored"`` event of full blocks ``start .. stop - 1`` of ``key`` (a contiguous run)."""
    bs = key.block_size
    hashes = key.block_hashes
    return BlockEvent("stored", tuple(hashes[start:stop]), hashes[start - 1] if start else None,
                      tuple(key.token_ids[start * bs:stop * bs]), bs, cache_salt=key.cache_salt)


EvictCallback = Callable[[list[EvictedBlock]], None]


def check_count(name: str, value: object) -> None:
    """Argument check shared by backends: ``value`` must be an int >= 0 (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class PrefixCacheBackend(ABC):
    """Index of a device pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Invariants every backend keeps:

    * block ids are ``0 .. num_blocks - 1`` and each is exactly one of: *free* (no content),
      *cached and idle* (holds a known prefix, no reference: an eviction candidate), or *in use*
      (one or more references; cached or not);
    * only full blocks are cached, and a cached block is only hit as part of its whole prefix
      (same namespace, same tokens before it);
    * pinned blocks are never evicted; ``num_pinned_blocks <= max_pinned_blocks``;
    * before the slot of an evicted cached block is handed out again, ``on_evict`` (if set) is
      called with it, so its KV can be written back to a tier.
    """

    #: the name the backend is registered under (``cache.backend`` in the config)
    name: str = ""

    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_fraction: float = 0.2):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be within [0, 1], got {max_pinned_fraction}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_pinned_blocks = int(num_blocks * max_pinned_fraction)
        self.on_evict: EvictCallback | None = None

    # -- lookup ------------------------------------------------------------------------------
    @abstractmethod
    def match(self, key: PrefixKey, max_blocks: int | None = None) -> list[int]:
        """Device block ids holding the longest cached prefix of ``key``'s full blocks.

        Read-only: takes no reference and does not change recency.
        :param max_blocks: match at most this many blocks (the engine passes
            ``(num_prompt_tokens - 1) // block_size``: the last prompt token is always computed).
        """

    # -- ownership ---------------------------------------------------------------------------
    @abstractmethod
    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each block returned by ``match`` (and mark it recently used)."""

    @abstractmethod
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Hand out ``num_blocks`` empty blocks with one reference each, evicting idle cached
        blocks (least recently used first) as needed; ``None`` (and no change) if not possible."""

    @abstractmethod
    def cache(self, key: PrefixKey, block_ids: Sequence[int]) -> None:
        """Make the first ``len(block_ids)`` full blocks of ``key``, held in ``block_ids`` (by
        the caller), hittable. Blocks already cached are left as they are; a block whose prefix
        is cached elsewhere stays private to the caller and returns to the free pool when freed."""

    @abstractmethod
    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks in table order; the
        backend releases them tail first, so a prefix's last block is evicted before its first.
        A cached block at zero references stays hittable until evicted."""

    # -- pinning -----------------------------------------------------------------------------
    @abstractmethod
    def pin(self, key: PrefixKey) -> int:
        """Keep the cached full blocks of ``key``'s prefix resident until ``unpin``.

        :returns: the number of blocks pinned (the cached leading run of ``key``).
        :raises PinLimitError: if more than ``max_pinned_blocks`` would be pinned; nothing changes.
        """

    @abstractmethod
    def unpin(self, key: PrefixKey) -> int:
        """Undo ``pin`` for ``key``; returns the number of blocks unpinned."""

    # -- accounting --------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` could hand out now: free ones plus evictable cached ones."""

    @property
    def num_empty_blocks(self) -> int:
        """Blocks ``allocate`` could hand out now without evicting a cached one (speculative
        decoding takes its draft slots only from these, so it never displaces a cached prefix).

        NOTE: the default, ``num_free_blocks``, is right for a backend that caches nothing;
        a caching backend overrides it, else speculation may evict idle cached blocks.
        """
        return self.num_free_blocks

    @property
    @abstractmethod
    def num_pinned_blocks(self) -> int:
        """Blocks kept resident by ``pin``."""

    @abstractmethod
    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash of the prefix block ``block_id`` caches, or ``None`` if it caches none."""

    def block_priority(self, block_id: int) -> int:
        """The eviction priority of the prefix block ``block_id`` caches: the highest
        ``PrefixKey.priority`` of the requests that cached or hit it (0 by default, and for a
        backend that keeps none). Tiers take it with the block (``Tier.put``'s ``priorities``)
        and :class:`EvictedBlock` carries it, so a tier's ``priority`` policy keeps what
        high-priority requests used, as the backend's does."""
        return 0

    @abstractmethod
    def take_events(self) -> list[BlockEvent]:
        """Drain the stored/removed events since the last call, in order."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every cached prefix (only valid while no block is in use); records a
        ``"removed"`` event with ``is_cleared=True`` (when the backend records events)."""

    def stats(self) -> dict[str, int]:
        """Counters for ``engine.stats()``; backends may add their own."""
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_pinned_blocks": self.num_pinned_blocks,
        }


@dataclass(frozen=True)
class Admission:
    """The blocks a request was admitted with: ``table`` is the matched ``hit`` (one reference
    each, taken by :func:`admit`) followed by the fresh blocks allocated for the rest."""

    hit: list[int]
    table: list[int]

    @property
    def fresh(self) -> list[int]:
        return self.table[len(self.hit):]


def admit(backend: PrefixCacheBackend, key: PrefixKey, num_tokens: int, *,
          max_hit_blocks: int | None = None, cache: bool = False) -> Admission | None:
    """Give a request of ``num_tokens`` tokens under ``key`` its blocks, the one way the engine,
    the index-only simulator (:mod:`corekv.bench`) and the conformance suite do it: match,
    acquire the hit, allocate the rest, and on failure give the hit back.

    :param max_hit_blocks: match at most this many blocks; default ``(num_tokens - 1) //
        block_size`` (the last token is always computed); ``0`` when prefix caching is off.
    :param cache: also make the full blocks of ``key`` hittable at once (a simulation, whose KV
        counts as computed on admission); the engine caches blocks only once computed.
    :returns: the admission, or ``None`` (and no reference held) when the pool cannot supply
        the fresh blocks now.
    """
    bs = backend.block_size
    if max_hit_blocks is None:
        max_hit_blocks = (num_tokens - 1) // bs
    # NOTE: a match of at most 0 blocks is empty; skipping it spares hashing the key
    hit = backend.match(key, max_blocks=max_hit_blocks) if max_hit_blocks > 0 else []
    backend.acquire(hit)  # NOTE: first, so allocate() cannot evict the blocks just hit
    fresh = backend.allocate(-(-num_tokens // bs) - len(hit))
    if fresh is None:
        backend.free(hit)
        return None
    table = hit + fresh
    if cache:
        backend.cache(key, table[:key.num_full_blocks])
    return Admission(hit, table)
