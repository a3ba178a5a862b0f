"""``NullOffload``: the offload facade of an engine without storage tiers.

Like vLLM's ``null_block``, a pool without tiers still has an offload object: it answers every
verb of :class:`~corekv.offload.Offload` that the engine calls, and does nothing, so the engine's
hot paths carry no ``if offload is not None``.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

__all__ = ["NullOffload"]


class _NullCost:
    """The reload cost model of no tiers: steps are not worth timing, and nothing is reported."""

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


class NullOffload:
    """No tier holds anything: nothing is prefetched, loaded, offloaded or parked.

    Invariants: :meth:`load` finds nothing (``{}``), ``can_swap`` is False (so :meth:`park` is
    never called), and every report (:meth:`stats`, :meth:`prefetch_stats`, ``cost.stats()``) is
    empty, as an engine without ``cache.tiers`` has always reported.
    """

    tiers: tuple = ()
    can_swap = False
    num_queued_blocks = 0

    def __init__(self) -> None:
        self.cost = _NullCost()

    # -- the verbs the engine calls, doing nothing -----------------------------------------------
    def arrived(self, request: Hashable, key: Any, num_device_blocks: int, max_blocks: int) -> None:
        pass

    def load(self, request: Hashable, key: Any, num_device_blocks: int, max_blocks: int,
             block_ids: Sequence[int]) -> dict[str, int]:
        return {}

    def left(self, request: Hashable, parked: Any = None) -> None:
        pass

    def cached(self, key: Any, block_ids: Sequence[int], start: int, *, offload: bool = True) -> None:
        pass

    def evicted(self, evicted: list) -> None:
        pass

    def park(self, owner: str, key: Any, block_table: Sequence[int], num_computed: int) -> Any:
        raise AssertionError("park() without a tier that holds swapped blocks (can_swap is False); "
                             "this indicates a bug in the caller")

    def unpark(self, parked: Any, block_table: Sequence[int], num_full_loaded: int) -> int | None:
        return None

    def flush(self, hashes_and_ids: Sequence[tuple[bytes, int]] = (), **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    # -- reports ---------------------------------------------------------------------------------
    def prefetch_stats(self) -> dict[str, float]:
        return {}

    def stats(self) -> dict[str, dict[str, int]]:
        return {}
