"""The tiers of one connector config, opened once per process and shared by its two sides.

vLLM runs the connector's scheduler side and worker side in one process (one GPU: the
``uni`` executor) or in two (vLLM's CPU build, ``mp``). In one process both sides must use the
same tier objects: an LMDB environment may be opened only once per process, and a ``host``
tier's entries exist only in the object that holds them.
"""
from __future__ import annotations

import threading

from corekv.integrations.vllm.settings import ConnectorSettings
from corekv.offload import make_tiers
from corekv.tier import Tier

__all__ = ["open_tiers", "release_tiers", "worker_started", "has_worker", "scheduler_started", "local_schedulers"]

_lock = threading.Lock()
#: (config path, fingerprint) -> [tiers, {name: why not started}, users]
_open: dict[tuple[str, str], list] = {}
_workers = 0


def worker_started() -> None:
    """A worker side runs in this process (vLLM builds it before the scheduler side when both
    share a process)."""
    global _workers
    _workers += 1


def has_worker() -> bool:
    return _workers > 0


_schedulers: list = []


def scheduler_started(side) -> None:
    """A scheduler side runs in this process: the worker side here takes its unsent saves when it
    shuts down (vLLM shuts the worker down first, and an offline ``LLM`` runs no step after the
    last request, so a finished request's write-back would be lost otherwise)."""
    _schedulers.append(side)


def local_schedulers() -> list:
    return list(_schedulers)


def open_tiers(settings: ConnectorSettings) -> tuple[list[Tier], dict[str, str]]:
    """This process's tiers for ``settings`` (built on first use): the started ones, in order,
    and ``{tier name: why it did not start}``."""
    key = settings.store_key
    with _lock:
        entry = _open.get(key)
        if entry is None:
            tiers, not_started = make_tiers(settings.cache, settings.plugin_manager,
                                            fingerprint=settings.fingerprint, dtype="uint8",
                                            block_bytes=settings.block_bytes, shape=settings.block_shape)
            entry = _open[key] = [tiers, not_started, 0]
        entry[2] += 1
        return list(entry[0]), dict(entry[1])


def release_tiers(settings: ConnectorSettings) -> None:
    """One user less; the last one closes the tiers (closing is idempotent, so a side that closed
    them already, the worker's offload at shutdown, does no harm)."""
    key = settings.store_key
    with _lock:
        entry = _open.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] > 0:
            return
        del _open[key]
    for tier in entry[0]:
        tier.close()
