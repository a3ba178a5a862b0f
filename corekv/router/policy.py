"""Routing policies: which healthy worker gets a request.

``cache_aware`` (after SGLang's router): balance load first when it is badly skewed, else follow the
longest cached prefix when it covers enough of the prompt, else send the prompt where the most cache
is free. ``round_robin`` is the cache-blind baseline.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

POLICY_NAMES = ("cache_aware", "round_robin")


class Candidate(Protocol):
    """What a policy reads of a worker (:class:`corekv.router.workers.Worker` is one)."""

    index: int        # the worker's position in --workers (stable across health changes)
    load: int         # requests the router has in flight on it

    @property
    def num_tree_blocks(self) -> int: ...

    def match(self, token_ids: Sequence[int], cache_salt: Hashable) -> int: ...


@dataclass(frozen=True)
class Choice:
    """A routing decision: the worker, why (``balance``, ``cache``, ``free_cache``, ``round_robin``,
    ``least_loaded``), and the prompt tokens the router believes are cached there."""

    worker: Candidate
    reason: str
    matched_tokens: int = 0


@dataclass(frozen=True)
class CacheAwareConfig:
    """The ``cache_aware`` thresholds (checked here; the CLI checks its flags the same way).

    Load counts as imbalanced when ``max - min > balance_abs_threshold`` *and*
    ``max > min * balance_rel_threshold``; a prefix is followed when the longest match covers at
    least ``cache_threshold`` of the prompt's tokens."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5

    def __post_init__(self):
        if not (isinstance(self.cache_threshold, (int, float)) and 0.0 <= self.cache_threshold <= 1.0):
            raise ValueError(f"cache_threshold: got {self.cache_threshold!r}; expected a number in "
                             "[0, 1] (the fraction of the prompt a cached prefix must cover)")
        if (not isinstance(self.balance_abs_threshold, int) or isinstance(self.balance_abs_threshold, bool)
                or self.balance_abs_threshold < 0):
            raise ValueError(f"balance_abs_threshold: got {self.balance_abs_threshold!r}; expected an "
                             "integer >= 0 (in-flight requests)")
        if not (isinstance(self.balance_rel_threshold, (int, float))
                and math.isfinite(self.balance_rel_threshold) and self.balance_rel_threshold >= 1.0):
            raise ValueError(f"balance_rel_threshold: got {self.balance_rel_threshold!r}; expected a "
                             "finite number >= 1 (a ratio of the most to the least loaded worker)")


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None):
        self.config = config or CacheAwareConfig()

    def choose(self, candidates: Sequence[Candidate], token_ids: Sequence[int],
               cache_salt: Hashable = None) -> Choice:
        _check_candidates(candidates)
        cfg = self.config
        loads = [c.load for c in candidates]
        low, high = min(loads), max(loads)
        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            return Choice(_least_loaded(candidates), "balance")
        if not token_ids:  # NOTE: the prompt could not be tokenized; the worker will say why
            return Choice(_least_loaded(candidates), "least_loaded")
        matches = [c.match(token_ids, cache_salt) for c in candidates]
        best = max(matches)
        if best > 0 and best / len(token_ids) >= cfg.cache_threshold:
            tied = [c for c, m in zip(candidates, matches) if m == best]
            return Choice(_least_loaded(tied), "cache", best)
        # NOTE: no worker holds enough of it: put it where the least is cached (the most cache is
        # free, and the tree it grows there is the one least likely to be needed elsewhere).
        worker = min(candidates, key=lambda c: (c.num_tree_blocks, c.load, c.index))
        return Choice(worker, "free_cache", matches[candidates.index(worker)])


class RoundRobinPolicy:
    """Each worker in turn (by ``index``), skipping those not among the candidates."""

    name = "round_robin"

    def __init__(self):
        self._next_index = 0

    def choose(self, candidates: Sequence[Candidate], token_ids: Sequence[int],
               cache_salt: Hashable = None) -> Choice:
        _check_candidates(candidates)
        ordered = sorted(candidates, key=lambda c: c.index)
        worker = next((c for c in ordered if c.index >= self._next_index), ordered[0])
        self._next_index = worker.index + 1
        return Choice(worker, "round_robin")


def make_policy(name: str, config: CacheAwareConfig | None = None) -> CacheAwarePolicy | RoundRobinPolicy:
    if name == "cache_aware":
        return CacheAwarePolicy(config)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"policy: got {name!r}; expected one of {', '.join(POLICY_NAMES)}")


def _least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.load, c.index))


def _check_candidates(candidates: Sequence[Candidate]) -> None:
    assert candidates, "a policy was asked to choose among no workers; this indicates a bug in the router"
