"""Admission: which cached blocks may be written to the tiers. One question, :meth:`admitted`,
answered from what the policy is told: the device cache's hits and the blocks that left it.

The builtin rule is ``offload_min_hits`` (:class:`MinHits`): a block qualifies once the device
served it that often while resident, so blocks never re-used stay off the tiers (SSD wear); its
count leaves with it. With ``offload_min_hits: 0`` every block qualifies (:class:`AdmitAll`).
The planner (:class:`corekv.offload.planner.OffloadPlanner`) asks; corekv's engine and the vLLM
connector's scheduler side share it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from corekv.hashing import BlockHash

__all__ = ["AdmissionPolicy", "AdmitAll", "MinHits", "build_admission", "make_admission"]


class AdmissionPolicy(ABC):
    """Decides which cached blocks go to the tiers."""

    #: a short name for stats and errors
    name: str = ""

    @abstractmethod
    def admitted(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Positions of ``hashes`` that may go to the tiers now."""

    def hit(self, hashes: Sequence[BlockHash]) -> list[int]:
        """One more device hit for each of ``hashes``; the positions admitted *by this hit* (a
        write-back caller offers them now). Default: hits change nothing."""
        return []

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """``hashes`` left the device cache."""

    def reset(self) -> None:
        """Forget everything (the device cache was reset)."""


class AdmitAll(AdmissionPolicy):
    """Every cached block goes to the tiers (``offload_min_hits: 0``)."""

    name = "all"

    def admitted(self, hashes):
        return list(range(len(hashes)))


class MinHits(AdmissionPolicy):
    """A block goes to the tiers once the device cache served it ``min_hits`` times while resident.

    Invariant: ``hit_counts`` holds at most ``max_tracked`` blocks, in the order last counted
    (the least recently counted dropped first), and only blocks still on the device.
    """

    name = "min_hits"

    def __init__(self, min_hits: int, max_tracked: int = 1 << 16):
        if isinstance(min_hits, bool) or not isinstance(min_hits, int) or min_hits < 1:
            raise ValueError(f"min_hits must be an int >= 1, got {min_hits!r} (0 admits every block: AdmitAll)")
        self.min_hits = min_hits
        self.max_tracked = max_tracked
        #: device hits (and reloads) per resident block, in the order last counted
        self.hit_counts: dict[BlockHash, int] = {}

    def admitted(self, hashes):
        counts, need = self.hit_counts, self.min_hits
        return [i for i, h in enumerate(hashes) if counts.get(h, 0) >= need]

    def hit(self, hashes):
        counts, reached = self.hit_counts, []
        for index, h in enumerate(hashes):
            counts[h] = n = counts.pop(h, 0) + 1  # re-inserted: the dict stays in last-counted order
            if n == self.min_hits:
                reached.append(index)
        while len(counts) > self.max_tracked:
            del counts[next(iter(counts))]
        return reached

    def forget(self, hashes):
        if self.hit_counts:
            for h in hashes:
                self.hit_counts.pop(h, None)

    def reset(self):
        self.hit_counts.clear()


def build_admission(name: str, plugin_manager, *, offload_min_hits: int, max_tracked: int) -> AdmissionPolicy:
    """The admission policy registered as ``name`` (``cache.admission``), built for one planner."""
    specs = plugin_manager.admission_policies()
    if name not in specs:
        registered = ", ".join(sorted(specs)) or ("none, not even corekv's own min_hits: the installed "
                                                 "corekv's entry points are older than its code; "
                                                 "reinstall it (pip install -e . in a checkout)")
        raise ValueError(f"cache.admission {name!r} is not a registered admission policy ({registered})")
    return specs[name].factory(offload_min_hits=offload_min_hits, max_tracked=max_tracked)


def make_admission(offload_min_hits: int, max_tracked: int = 1 << 16) -> AdmissionPolicy:
    """The builtin rule for ``cache.offload_min_hits``."""
    if isinstance(offload_min_hits, bool) or not isinstance(offload_min_hits, int) or offload_min_hits < 0:
        raise ValueError(f"offload_min_hits must be an int >= 0, got {offload_min_hits!r}")
    return MinHits(offload_min_hits, max_tracked) if offload_min_hits else AdmitAll()
