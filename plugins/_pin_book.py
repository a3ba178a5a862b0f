"""Pin bookkeeping shared by the builtin backends: pins are extra block references plus a cap.

A pin is one more reference on every block of the cached leading run of a key, taken through the
backend's own ``acquire`` and given back through its ``free``; the backend's reference counting
(free queue or radix lock refs) is therefore what keeps pinned blocks resident. This module only
remembers which run each pin took and enforces ``max_pinned_blocks``.
"""
from __future__ import annotations

from corekv.backend import PinLimitError, PrefixCacheBackend
from corekv.hashing import PrefixKey


class PinBook:
    """Which blocks are pinned, how often, and by which key.

    Invariants: ``block_to_pins[b] >= 1`` for every pinned block ``b`` (the backend holds exactly
    that many extra references on it); ``len(block_to_pins) <= max_pinned_blocks``; every run in
    ``key_to_runs`` is still referenced by the backend, so ``unpin`` frees exactly what ``pin`` took
    even if more of the key was cached in between.
    """

    def __init__(self, max_pinned_blocks: int):
        self.max_pinned_blocks = max_pinned_blocks
        self.block_to_pins: dict[int, int] = {}
        self.key_to_runs: dict[tuple, list[list[int]]] = {}

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.block_to_pins)

    def pin(self, backend: PrefixCacheBackend, key: PrefixKey) -> int:
        _check_key(key, backend)
        run = backend.match(key)
        num_new = len({b for b in run if b not in self.block_to_pins})
        if self.num_pinned_blocks + num_new > self.max_pinned_blocks:
            raise PinLimitError(
                f"pinning {key!r} would pin {num_new} more block(s) on top of "
                f"{self.num_pinned_blocks} already pinned, past the cap of "
                f"{self.max_pinned_blocks} of the pool's {backend.num_blocks} blocks (set by "
                "cache.max_pinned_fraction); raise cache.max_pinned_fraction or pin less"
            )
        backend.acquire(run)
        for b in run:
            self.block_to_pins[b] = self.block_to_pins.get(b, 0) + 1
        self.key_to_runs.setdefault(_identity(key), []).append(run)
        return len(run)

    def unpin(self, backend: PrefixCacheBackend, key: PrefixKey) -> int:
        _check_key(key, backend)
        runs = self.key_to_runs.get(_identity(key))
        if not runs:
            return 0
        run = runs.pop()
        if not runs:
            del self.key_to_runs[_identity(key)]
        for b in run:
            left = self.block_to_pins[b] - 1
            if left:
                self.block_to_pins[b] = left
            else:
                del self.block_to_pins[b]
        backend.free(run)
        return len(run)

    def clear(self) -> None:
        self.block_to_pins.clear()
        self.key_to_runs.clear()


def _identity(key: PrefixKey) -> tuple:
    # NOTE: only the full blocks identify a pin: a trailing partial block is never cached.
    return key.namespace, tuple(key.token_ids[:key.num_full_blocks * key.block_size])


def _check_key(key: object, backend: PrefixCacheBackend) -> None:
    if not isinstance(key, PrefixKey):
        raise TypeError(f"key must be a corekv.hashing.PrefixKey, got {type(key).__name__}; "
                        "build one with PrefixKey(token_ids, block_size, namespace)")
    if key.block_size != backend.block_size:
        raise ValueError(f"key.block_size is {key.block_size} but the backend's block_size is "
                         f"{backend.block_size}; build the PrefixKey with the backend's block size")
