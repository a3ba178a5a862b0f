"""Conformance suites that corekv's own and third-party backends and tiers subclass.

``from corekv.testing import BackendTests`` (prefix-cache backends) or ``TierTests`` (storage
tiers). The suites load on first use, so importing this package pulls in neither pytest nor torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "BackendTests": "corekv.testing.backend",
    "Request": "corekv.testing.backend",
    "make_key": "corekv.testing.backend",
    "TierTests": "corekv.testing.tier",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'corekv.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
