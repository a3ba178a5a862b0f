"""Calling a tier from the offload code: a tier that raises anyway is a miss, never the engine's error.

Tiers count their own failures (a store that is down or full) and return misses; this guards
against a tier that breaks that contract (a plugin's bug), on the step thread and the writer's.
"""
from __future__ import annotations

import logging

from corekv.tier import Tier

__all__ = ["safe_tier_call"]
logger = logging.getLogger(__name__)


def safe_tier_call(call, default, tier: Tier, what: str):
    """Run a tier call; a tier that raises anyway (a plugin's bug) is logged and read as a miss."""
    try:
        return call()
    except Exception as e:
        logger.warning("tier %s: %s failed (%s: %s); treated as a miss", tier.name, what, type(e).__name__, e)
        return default
