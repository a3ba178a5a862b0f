"""The engine's storage tiers: built from ``cache.tiers`` through the plugins, under one manager.

Each ``cache.tiers`` entry names a tier type a plugin registers; :func:`make_cache_manager` builds
them in order with the block geometry of the engine's KV pool and the model's fingerprint (so a
tier never serves another model's or another layout's blocks), puts them under a
:class:`CacheManager` (which prefetches arriving requests' tier hits into host staging), and hooks
it to the backend's evictions (write-back).
"""
from __future__ import annotations

import logging

from corekv.cache_manager import CacheManager
from corekv.config import CacheConfig
from corekv.errors import ConfigError, PluginError
from corekv.tier import make_tier

__all__ = ["make_cache_manager", "fingerprint_bytes"]
logger = logging.getLogger(__name__)


def fingerprint_bytes(fingerprint: str) -> bytes:
    """The tier fingerprint of a model: its hex digest as bytes (any other string, UTF-8)."""
    try:
        return bytes.fromhex(fingerprint)
    except ValueError:
        return fingerprint.encode()


def make_cache_manager(cache: CacheConfig, plugin_manager, model, kv_pool, backend,
                       ) -> tuple[CacheManager | None, dict[str, str]]:
    """The tiers of ``cache.tiers``, in order, under one :class:`CacheManager` (``None`` when no
    tier is configured or none started), and ``{tier name: why it did not start}``.

    A tier that fails to start is left out with one warning, unless it says ``required: true``;
    then, as for every configuration error, the engine does not start. Sets ``backend.on_evict``
    to the manager's write-back. Tiers already built are closed again if a later one fails, so a
    bad config leaks no open LMDB environment or connection.

    :raises ConfigError: an unknown tier type, bad tier options, a required tier that failed, a
        missing integrity secret, or a backend that cannot report evicted blocks' hashes (radix
        with ``track_hashes: false``).
    """
    if not cache.tiers:
        return None, {}
    specs = plugin_manager.tiers()
    secret = cache.integrity.secret()
    tiers, failed = [], {}
    try:
        for i, tier_cfg in enumerate(cache.tiers):
            spec = specs.get(tier_cfg.type)
            if spec is None:
                raise ConfigError(f"cache.tiers[{i}].type: no tier named {tier_cfg.type!r} is registered "
                                  f"(known: {sorted(specs)}); install the plugin that provides it")
            try:
                tiers.append(make_tier(spec, tier_cfg.options, block_bytes=kv_pool.bytes_per_block,
                                       fingerprint=fingerprint_bytes(model.fingerprint),
                                       dtype=str(model.dtype).removeprefix("torch."),
                                       shape=kv_pool.block_shape, name=tier_cfg.name or tier_cfg.type,
                                       secret=secret, where=f"cache.tiers[{i}]"))
            except (ConfigError, PluginError) as e:
                if tier_cfg.required:
                    raise
                failed[tier_cfg.name] = str(e)
                logger.warning("tier %s did not start and is left out (set required: true to refuse "
                               "to run without it): %s", tier_cfg.name, e)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    if not tiers:
        return None, failed
    manager = CacheManager(tiers, kv_pool, write_policy=cache.write_policy,
                           offload_min_hits=cache.offload_min_hits,
                           queue_blocks=cache.offload_queue_blocks, hooks=plugin_manager.hook,
                           prefetch_blocks=cache.prefetch_blocks)
    try:
        backend.on_evict = manager.on_evict
    except ValueError as e:
        manager.close()
        raise ConfigError(f"cache.tiers needs a backend that reports evicted blocks' hashes: {e} "
                          "(for radix: set cache.backend_options.track_hashes: true)") from e
    return manager, failed
