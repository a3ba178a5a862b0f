"""A tier's cost measured when it opens, to seed the reload cost model (:mod:`.cost`).

Without a seed the cost model knows nothing of a tier until ``min_samples`` real loads, and an
unmeasured tier counts as free (the prior: reload), so a tier slower than recompute costs its
first requests the difference. :func:`measure_tier` writes one probe entry (a block of zeros under
a key no prompt hashes to, the same in every process, so a shared store holds one per model) and
times ``num_calls`` membership calls (the latency: one round trip, no payload) and ``num_calls``
reads of the entry (the latency and one block's bytes). The latency is the fastest membership
call; the seconds per block the median read less that latency.

Bounds, so it never costs a start more than about one deadline and never fails it: every call is
an ordinary tier call, with the tier's own deadline and fault handling (a store that fails once is
skipped, in its cool-down, by the calls after); the measurement stops at the first call that
fails or misses, and once ``budget_s`` has passed; it raises nothing. A tier that could not be
measured is left to the prior and to its real loads.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
import time
from dataclasses import dataclass

from corekv.tier import Tier

__all__ = ["PROBE_KEY", "TierMeasurement", "measure_tier"]

logger = logging.getLogger(__name__)

#: the probe entry's block hash (16 bytes, as xxh3-128's; no prompt's chained hash equals it)
PROBE_KEY = hashlib.blake2b(b"corekv reload-cost probe entry", digest_size=16).digest()


@dataclass(frozen=True)
class TierMeasurement:
    """What :func:`measure_tier` found: ``latency_s`` per call, ``s_per_block`` beyond it, and
    the bandwidth that implies (``None`` where a block read took no measurable time)."""

    latency_s: float
    s_per_block: float
    bytes_per_s: float | None


def measure_tier(tier: Tier, *, num_calls: int = 3, budget_s: float = 1.0) -> TierMeasurement | None:
    """Time ``tier`` (see the module docstring); ``None`` when it did not answer every call."""
    started = time.perf_counter()
    try:
        if not tier.put([(PROBE_KEY, bytes(tier.block_bytes))]):
            return None
        latencies, reads = [], []
        for _ in range(num_calls):
            t0 = time.perf_counter()
            if not tier.contains_many([PROBE_KEY])[0]:
                return None
            t1 = time.perf_counter()
            if tier.get([PROBE_KEY])[0] is None:
                return None
            latencies.append(t1 - t0)
            reads.append(time.perf_counter() - t1)
            if time.perf_counter() - started > budget_s:
                break
    except Exception as e:  # noqa: BLE001 - a measurement must never fail the start
        logger.warning("tier %s: measuring its reload cost failed (%s: %s); it is left to the prior "
                       "and to its real loads", tier.name, type(e).__name__, e)
        return None
    latency = min(latencies)
    per_block = max(0.0, statistics.median(reads) - latency)
    return TierMeasurement(latency, per_block, tier.block_bytes / per_block if per_block > 0 else None)
