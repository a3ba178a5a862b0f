"""Building the offload side from ``cache.tiers``: the tiers through their plugins, the swap tier.

Each ``cache.tiers`` entry names a tier type a plugin registers (the config reader checked the
type and options); the tiers are built in order with the block geometry of the KV pool and the
model's fingerprint, so a tier never serves another model's or another layout's blocks.
"""
from __future__ import annotations

import logging

from corekv.admission import build_admission
from corekv.config import CacheConfig
from corekv.errors import ConfigError, PluginError
from corekv.eviction import resolve_policy_options
from corekv.offload.cost import ReloadCost
from corekv.offload.facade import Offload
from corekv.offload.null import NullOffload
from corekv.tier import Tier
from corekv.tier_factory import make_tier

__all__ = ["make_offload", "make_tiers", "fingerprint_bytes"]
logger = logging.getLogger(__name__)


def fingerprint_bytes(fingerprint: str) -> bytes:
    """The tier fingerprint of a model: its hex digest as bytes (any other string, UTF-8)."""
    try:
        return bytes.fromhex(fingerprint)
    except ValueError:
        return fingerprint.encode()


def make_tiers(cache: CacheConfig, plugin_manager, *, fingerprint: str, dtype: str, block_bytes: int,
               shape) -> tuple[list[Tier], dict[str, str]]:
    """The tiers of ``cache.tiers`` that started, in order, for blocks of ``block_bytes`` bytes
    (``dtype`` elements of ``shape``) of the model ``fingerprint``, and ``{tier name: why it did
    not start}``.

    A tier that fails to start is left out with one warning, unless it says ``required: true``;
    then, as for every configuration error, nothing starts: tiers already built are closed again,
    so a bad config leaks no open LMDB environment or connection.

    :raises ConfigError: a required tier that failed, or a missing integrity secret.
    """
    specs = plugin_manager.tiers()
    secret = cache.integrity.secret()
    tiers, not_started = [], {}
    try:
        for i, tier_cfg in enumerate(cache.tiers):
            try:
                # NOTE: eviction policies by name from this manager (a config's plugins: included)
                options = resolve_policy_options(specs[tier_cfg.type].options, tier_cfg.options,
                                                 plugin_manager)
                tier = make_tier(specs[tier_cfg.type], options, block_bytes=block_bytes,
                                 fingerprint=fingerprint_bytes(fingerprint), dtype=dtype,
                                 shape=shape, name=tier_cfg.name, secret=secret, where=f"cache.tiers[{i}]")
                tiers.append(tier)
                if tier_cfg.required and not tier.is_reachable():
                    raise ConfigError(f"cache.tiers[{i}] ({tier_cfg.name}): required: true, and its store did "
                                      "not answer at start; start the server (or fix the url), or set "
                                      "required: false to run without it until it answers",
                                      path=f"cache.tiers[{i}].required")
            except (ConfigError, PluginError) as e:
                if tier_cfg.required:
                    raise
                not_started[tier_cfg.name] = str(e)
                logger.warning("tier %s did not start and is left out (set required: true to refuse "
                               "to run without it): %s", tier_cfg.name, e)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers, not_started


def make_offload(cache: CacheConfig, plugin_manager, *, fingerprint: str, dtype: str, kv_pool, backend,
                 swap: bool = False) -> tuple[Offload | NullOffload, dict[str, str]]:
    """The tiers of ``cache.tiers`` (:func:`make_tiers`), in order, under one :class:`Offload`
    wired to ``backend``'s evictions (a :class:`NullOffload`, whose verbs do
    nothing, when no tier is configured or none started), and
    ``{tier name: why it did not start}``. With ``swap``, preempted sequences are parked in the
    first started tier that ``supports_swap``.

    :raises ConfigError: as :func:`make_tiers`; also swap without such a tier started, or a
        backend that cannot report evicted blocks' hashes (radix with ``track_hashes: false``).
    """
    if not cache.tiers:
        return NullOffload(), {}
    tiers, not_started = make_tiers(cache, plugin_manager, fingerprint=fingerprint, dtype=dtype,
                                    block_bytes=kv_pool.bytes_per_block, shape=kv_pool.block_shape)
    swap_tier = None
    if swap:
        swap_tier = next((i for i, t in enumerate(tiers) if t.supports_swap), None)
        if swap_tier is None:
            for tier in tiers:
                tier.close()
            raise ConfigError(f"engine.preemption: 'swap' needs a tier that can hold swapped blocks "
                              f"(supports_swap: host, shm), and none started ({not_started}); fix "
                              "the tier or use preemption: recompute", path="engine.preemption")
    if not tiers:
        return NullOffload(), not_started
    # NOTE: the config reader checked the admission policy's name against this manager's
    admission = build_admission(cache.admission, plugin_manager, offload_min_hits=cache.offload_min_hits,
                                max_tracked=kv_pool.num_blocks)
    try:
        offload = Offload(tiers, kv_pool, write_policy=cache.write_policy, offload_min_hits=cache.offload_min_hits,
                          admission=admission,
                          queue_blocks=cache.offload_queue_blocks, hooks=plugin_manager.hook,
                          prefetch_blocks=cache.prefetch_blocks, swap_tier=swap_tier, backend=backend,
                          reload_cost=ReloadCost([t.name for t in tiers], kv_pool.block_size,
                                                 policy=cache.reload_policy, max_load_tokens=cache.max_load_tokens))
    except ValueError as e:
        raise ConfigError(f"cache.tiers needs a backend that reports evicted blocks' hashes: {e} "
                          "(for radix: set cache.backend_options.track_hashes: true)") from e
    if cache.reload_policy == "cost":
        offload.measure_tiers()  # NOTE: the cost model's seed; bounded, and it never fails a start
    return offload, not_started
