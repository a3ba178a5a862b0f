"""Hook specifications: everything a corekv plugin can provide or observe.

Builtin plugins (``corekv.plugins.*``, ``corekv.tiers.*``) implement these exactly as third-party
plugins do, and are found through the same ``corekv`` entry-point group. Every hook is named
``corekv_*``; ``corekv_register_*`` hooks return lists, ``corekv_on_*`` hooks observe events and
return nothing, and selection hooks are ``firstresult`` and return ``None`` when they don't apply.

Each hook has a heading with its exact signature in ``docs/plugins.md``; ``tests/test_hooks.py``
fails when one is missing or has no test.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from corekv.backend import BlockEvent
    from corekv.specs import AdmissionPolicySpec, BackendSpec, ConfigSectionSpec, EvictionPolicySpec, TierSpec

hookspec = pluggy.HookspecMarker("corekv")


# -------------------------------------------------------------------------------------------
# Registration hooks (collected from every plugin)
# -------------------------------------------------------------------------------------------
@hookspec
def corekv_register_backends() -> list[BackendSpec]:
    """Register prefix-cache backends.

    :returns: a list of :class:`corekv.plugin.BackendSpec`, each naming a backend
        (``cache.backend`` in the config), its factory and its options schema.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_register_tiers() -> list[TierSpec]:
    """Register storage tiers.

    :returns: a list of :class:`corekv.plugin.TierSpec`, each naming a tier type
        (``cache.tiers[i].type`` in the config), its factory and its options schema, and, for a
        tier whose entries outlive the process, an ``admin`` factory (a
        :class:`corekv.tier_admin.StoreAdmin` over the same options) through which
        ``corekv store stats|ls|verify|clear`` lists, checks and deletes its entries.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_register_eviction_policies() -> list[EvictionPolicySpec]:
    """Register eviction policies: which cached entry a backend or a tier evicts first.

    A backend or tier that lets the config choose declares an option of kind ``eviction``
    (``Option("eviction", default="lru")``); ``load_config`` checks the name against the
    policies registered here, and the factory receives a fresh policy. corekv's ``lru``, ``lfu``
    and ``priority`` are registered through this hook too (:mod:`corekv.plugins.eviction`).

    :returns: a list of :class:`corekv.plugin.EvictionPolicySpec`, each naming a policy and its
        factory (no arguments; returns a :class:`corekv.eviction.EvictionPolicy`).

    .. versionadded:: 0.2
    """


@hookspec
def corekv_register_admission_policies() -> list[AdmissionPolicySpec]:
    """Register admission policies: which cached blocks are written to the storage tiers.

    ``cache.admission`` names one (``load_config`` checks the name against the policies
    registered here); the engine builds it with ``factory(offload_min_hits=..., max_tracked=...)``
    and its offload planner asks it. corekv's ``min_hits`` (the rule of
    ``cache.offload_min_hits``, the default) is registered through this hook too
    (:mod:`corekv.plugins.admission`).

    :returns: a list of :class:`corekv.plugin.AdmissionPolicySpec`, each naming a policy and its
        factory (returns a :class:`corekv.admission.AdmissionPolicy`).

    .. versionadded:: 0.2
    """


@hookspec
def corekv_register_config_sections() -> list[ConfigSectionSpec]:
    """Register the top-level config sections a plugin reads (``kv_events:``).

    ``corekv.load_config`` validates each section as it validates its own fields and a tier's
    options: unknown keys are errors with a "did you mean", values are checked against the
    :class:`corekv.plugin.Option` schema, defaults are filled in, ``COREKV_<SECTION>__<KEY>``
    variables override them, and the spec's ``check`` runs once on the result for rules between
    fields. The plugin reads the validated values from ``config.sections[name]`` (also
    ``config.<name>``) and does not check them again.

    :returns: a list of :class:`corekv.plugin.ConfigSectionSpec`, each naming a section (a
        top-level key that is not one of corekv's own), its options schema and an optional check.

    .. versionadded:: 0.1
    """


# -------------------------------------------------------------------------------------------
# Selection hooks (first non-None answer wins)
# -------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def corekv_resolve_model(name: str) -> str | None:
    """Turn a model alias from the config (e.g. ``smollm2-135m-instruct``) into a local path.

    This hook is ``firstresult``: the first plugin that returns a path wins.

    :param name: the ``model`` field of the config.
    :returns: a local Hugging Face model folder or ``.gguf`` file, or ``None`` if the plugin does
        not know this name.

    .. versionadded:: 0.1
    """


# -------------------------------------------------------------------------------------------
# Serving hooks (the HTTP server asks these; it names no plugin)
# -------------------------------------------------------------------------------------------
@hookspec
def corekv_collect_metrics(engine: Any) -> bytes | None:
    """Metrics of ``engine`` in the Prometheus text format, for the server's ``GET /metrics``.

    Every plugin's answer is served, in registration order, one after the other; ``/metrics``
    answers 404 when no plugin has any (without per-tenant keys). The builtin ``prometheus``
    plugin answers here.

    :param engine: the :class:`corekv.Engine` the server serves.
    :returns: the exposition text (ending with a newline), or ``None`` when the plugin has no
        metrics for this engine.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def corekv_describe_kv_events(engine: Any) -> dict[str, Any] | None:
    """Where ``engine``'s KV events are published, for the server's ``GET /admin/info``
    (``kv_events``), which routers read to subscribe.

    This hook is ``firstresult``: the first plugin that publishes this engine's events answers. The
    builtin ``kv_events`` plugin answers here.

    :param engine: the :class:`corekv.Engine` the server serves.
    :returns: ``{"endpoint", "replay_endpoint", "topic"}`` (the addresses actually bound), or
        ``None`` when the plugin publishes no events for this engine.

    .. versionadded:: 0.1
    """


# -------------------------------------------------------------------------------------------
# Lifecycle and event hooks (observers; return values are ignored)
# -------------------------------------------------------------------------------------------
@hookspec
def corekv_on_engine_started(engine: Any) -> None:
    """Called once when an engine has loaded its model and pool and is ready to serve.

    The builtin ``pinned`` plugin warms and pins ``cache.pinned`` here.

    :param engine: the :class:`corekv.Engine`.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_on_engine_closed(engine: Any) -> None:
    """Called once when ``engine.close()`` has finished the tiers' writes, before the KV pool is
    released: stop the servers, sockets and threads a plugin started for this engine.

    :param engine: the :class:`corekv.Engine` (no longer serving requests).

    .. versionadded:: 0.1
    """


@hookspec
def corekv_on_blocks_stored(events: list[BlockEvent]) -> None:
    """Full blocks became hittable in the device cache.

    :param events: ``BlockEvent(kind="stored", ...)``, in order. Each is one contiguous run of one
        hash chain: ``block_hashes``, ``parent_block_hash`` (the block before the run; ``None``
        at the chain's start), ``token_ids`` (the run's tokens) and ``block_size``. A request
        whose blocks are partly cached already gives one event per run of new blocks.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_on_blocks_removed(events: list[BlockEvent]) -> None:
    """Cached blocks left the device cache (evicted or cleared).

    :param events: ``BlockEvent(kind="removed", block_hashes=...)``, in order. An event with
        ``is_cleared=True`` is a reset of the whole cache: its ``block_hashes`` are every block
        that was cached (possibly none), and nothing cached before it remains.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_on_blocks_offloaded(tier: str, block_hashes: list[bytes]) -> None:
    """Blocks were written to a storage tier.

    Called from the offload writer's background thread, not the step's thread: an
    implementation that shares state with other hooks must be thread-safe.

    :param tier: the tier's name (its ``type``, or ``name`` when the config sets one).
    :param block_hashes: the keys written.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_on_blocks_loaded(tier: str, block_hashes: list[bytes]) -> None:
    """Blocks were reloaded from a storage tier into the device pool.

    :param tier: the tier's name.
    :param block_hashes: the keys loaded.

    .. versionadded:: 0.1
    """


@hookspec
def corekv_on_request_finished(output: Any) -> None:
    """A request finished (stopped, hit its length limit, or was aborted).

    :param output: its final :class:`corekv.RequestOutput`.

    .. versionadded:: 0.1
    """
