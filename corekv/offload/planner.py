"""The offload planner: which cached blocks go to the tiers, and which writes are still under way.

One policy for every caller: corekv's engine (through :class:`~corekv.offload.Offload`) and the
vLLM connector's scheduler side, which plans for a worker in another process, ask the same
questions of the same object:

- **write policy**: ``write_through`` offers a block to the tiers when it is cached (filled);
  ``write_back`` when its device slot is about to be reused (corekv's engine) or when its request
  ends (vLLM, which never tells a connector when it reuses a slot);
- **admission**: an :class:`~corekv.admission.AdmissionPolicy` says which blocks qualify;
  the builtin rule (``offload_min_hits``) admits a block once the device cache served it that
  often while resident, so blocks never re-used stay off the tiers (SSD wear); its count leaves
  with it when it is evicted;
- **in flight**: a block queued for writing and not yet reported done (stored, skipped or
  failed, :data:`OUTCOMES`). A lookup that reaches such a block waits for the report instead of
  recomputing a block that is about to be there; every queued block gets a report, so there is
  no timer.

Invariants: ``in_flight`` holds at most ``max_tracked`` blocks (the oldest dropped first: a
lookup then recomputes, never waits forever); the admission policy keeps its own (the builtin's:
``hit_counts`` empty when ``offload_min_hits`` is 0, else at most ``max_tracked`` blocks).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from corekv.hashing import BlockHash
from corekv.admission import AdmissionPolicy, make_admission

__all__ = ["OUTCOMES", "OffloadPlanner"]

#: how a queued write ends: the block is in at least one tier; the queue was full; no tier took it
OUTCOMES = ("stored", "skipped", "failed")


class OffloadPlanner:
    """Write policy, admission (``offload_min_hits`` or an :class:`AdmissionPolicy`), and writes
    in flight."""

    def __init__(self, *, write_policy: str = "write_back", offload_min_hits: int = 0, max_tracked: int = 1 << 16,
                 admission: AdmissionPolicy | None = None):
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"write_policy must be 'write_back' or 'write_through', got {write_policy!r}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
        self.write_policy = write_policy
        self.offload_min_hits = offload_min_hits
        self.max_tracked = max_tracked
        #: which blocks may go to the tiers; by default the rule of ``offload_min_hits``
        self.admission = admission if admission is not None else make_admission(offload_min_hits, max_tracked)
        self.in_flight: OrderedDict[BlockHash, None] = OrderedDict()

    @property
    def is_write_through(self) -> bool:
        return self.write_policy == "write_through"

    # -- admission ---------------------------------------------------------------------------
    @property
    def hit_counts(self) -> dict[BlockHash, int]:
        """The builtin rule's counts (empty for a policy that keeps none)."""
        return getattr(self.admission, "hit_counts", {})

    def count_hits(self, hashes: Sequence[BlockHash]) -> list[int]:
        """One more device hit for each of ``hashes``; the positions that qualify by this hit."""
        return self.admission.hit(hashes)

    def qualifying(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Positions of ``hashes`` that may go to the tiers now."""
        return self.admission.admitted(hashes)

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """``hashes`` left the device: the admission policy forgets them."""
        self.admission.forget(hashes)

    # -- writes in flight --------------------------------------------------------------------
    def queued(self, hashes: Iterable[BlockHash]) -> None:
        """``hashes`` were handed to the writer; a report for each follows."""
        for h in hashes:
            self.in_flight[h] = None
            self.in_flight.move_to_end(h)
        while len(self.in_flight) > self.max_tracked:
            self.in_flight.popitem(last=False)

    def completed(self, hashes: Iterable[BlockHash]) -> None:
        """The writes of ``hashes`` ended (whatever the outcome)."""
        for h in hashes:
            self.in_flight.pop(h, None)

    def is_in_flight(self, block_hash: BlockHash) -> bool:
        return block_hash in self.in_flight

    def reset(self) -> None:
        """Forget every count and every write in flight (vLLM's ``reset_cache``)."""
        self.admission.reset()
        self.in_flight.clear()
