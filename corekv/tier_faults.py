"""Faults of remote tiers: a cool-down per endpoint, so a dead or stalled server costs one deadline
per ``retry_interval``, not one per step.

A remote tier (a Redis server, each node of a Redis Cluster, an object store) asks
:meth:`Cooldowns.is_down` before it calls an endpoint and skips the call while the endpoint
cools down (its keys are misses, its writes skips); it reports each call's outcome with
:meth:`Cooldowns.failed` or :meth:`Cooldowns.succeeded`. Faults stay with the endpoint that
failed: the other nodes of a cluster keep serving their keys. Every failure counts one ``errors``
in the tier's statistics; the log gets one warning when an endpoint goes down and one when it
answers again, never one per call (the step path would flood it).
"""
from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)


class Cooldowns:
    """Down-until times of a tier's endpoints (names such as ``127.0.0.1:7001``).

    Invariants: an endpoint is down from a failure until ``retry_interval`` seconds later, then
    gets one call again (a failure restarts its cool-down); ``stats["errors"]`` grows by one per
    failure; one warning per outage and one per recovery. Not thread-safe: callers hold the
    tier's lock.
    """

    def __init__(self, tier_name: str, retry_interval: float, stats: MutableMapping[str, int],
                 kind: str = "server"):
        self.tier_name = tier_name
        self.retry_interval = retry_interval
        self.kind = kind
        self._stats = stats
        self._endpoint_to_down_until: dict[str, float] = {}

    def is_down(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is cooling down (calls to it must be skipped now)."""
        down_until = self._endpoint_to_down_until.get(endpoint)
        return down_until is not None and time.monotonic() < down_until

    def any_down(self) -> bool:
        """Whether some endpoint failed and has not answered since."""
        return bool(self._endpoint_to_down_until)

    def down_endpoints(self) -> list[str]:
        """Endpoints that failed and have not answered since (cooling down or due a retry)."""
        return list(self._endpoint_to_down_until)

    def failed(self, endpoint: str, what: str, error: BaseException | str) -> None:
        """Count a failed call to ``endpoint`` and start its cool-down; warn once per outage."""
        self._stats["errors"] += 1
        if endpoint not in self._endpoint_to_down_until:
            detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            logger.warning("tier %s: %s %s at %s failed (%s); its keys are misses and its writes "
                           "skipped, retrying every %ss", self.tier_name, self.kind, what, endpoint,
                           detail, self.retry_interval)
        self._endpoint_to_down_until[endpoint] = time.monotonic() + self.retry_interval

    def succeeded(self, endpoint: str) -> None:
        """Note a call to ``endpoint`` that answered; ends its outage."""
        if self._endpoint_to_down_until.pop(endpoint, None) is not None:
            logger.warning("tier %s: %s at %s answers again", self.tier_name, self.kind, endpoint)

    def forget(self, endpoint: str) -> None:
        """Drop ``endpoint`` without a message (it left the cluster: its slots moved)."""
        self._endpoint_to_down_until.pop(endpoint, None)
