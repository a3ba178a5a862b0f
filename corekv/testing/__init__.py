"""Conformance suites that corekv's own and third-party backends and tiers subclass.

``from corekv.testing import BackendTests`` (prefix-cache backends), ``TierTests`` (storage
tiers) or ``StoreAdminTests`` (a persistent tier's admin view). The suites load on first use, so
importing this package pulls in neither pytest nor torch.
"""
from __future__ import annotations

from corekv._lazy import lazy_getattr

_LAZY = {
    "BackendTests": "corekv.testing.backend",
    "Request": "corekv.testing.backend",
    "make_key": "corekv.testing.backend",
    "TierTests": "corekv.testing.tier",
    "StoreAdminTests": "corekv.testing.tier_admin",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = sorted(_LAZY)
