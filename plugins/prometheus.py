"""``prometheus``: export an engine's cache events as Prometheus metrics.

Install the extra (``pip install 'corekv[metrics]'``) and every engine gets its own exporter: a
:class:`PrometheusExporter` with its own ``CollectorRegistry`` (no process-global metrics, so two
engines in one process never mix their numbers). It is fed only by corekv's event hooks::

    engine = corekv.Engine.from_config("cache.yaml")
    exporter = exporter_for(engine)            # None without prometheus-client
    print(exporter.exposition().decode())      # the text a scrape returns
    exporter.start_http_server(9400)           # or set COREKV_PROMETHEUS_PORT=9400
    exporter.close()                           # stops the server (also when the engine is collected)

Without ``prometheus-client`` installed this plugin does nothing: the builtin entry point must
never break corekv for users who did not ask for metrics.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import weakref
from typing import Any

from corekv.plugin import hookimpl

logger = logging.getLogger(__name__)

PORT_ENV = "COREKV_PROMETHEUS_PORT"
EXPORTER_NAME = "corekv.plugins.prometheus:exporter"
#: TTFT histogram buckets in seconds: CPU prefill of long prompts reaches seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def is_available() -> bool:
    """Whether ``prometheus-client`` is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):  # a broken install, or a module deliberately blocked
        return False


class PrometheusExporter:
    """The metrics of one engine, registered as a plugin on that engine's plugin manager.

    Invariants: every metric lives in ``self.registry`` only; counters only grow; the exporter
    holds the engine weakly, so it never keeps a closed engine's KV pool alive.
    """

    def __init__(self, engine: Any = None):
        import prometheus_client as prom  # NOTE: lazy: only engines that export pay the import

        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.blocks_stored = prom.Counter("corekv_blocks_stored", "KV blocks that became hittable, per tier",
                                          ["tier"], registry=r)
        self.blocks_removed = prom.Counter("corekv_blocks_removed", "Cached KV blocks that left a tier",
                                           ["tier"], registry=r)
        self.blocks_offloaded = prom.Counter("corekv_blocks_offloaded", "KV blocks written to a storage tier",
                                             ["tier"], registry=r)
        self.blocks_loaded = prom.Counter("corekv_blocks_loaded", "KV blocks reloaded from a storage tier",
                                          ["tier"], registry=r)
        self.requests_finished = prom.Counter("corekv_requests_finished", "Requests finished, by reason",
                                              ["finish_reason"], registry=r)
        self.prompt_tokens_cached = prom.Counter(
            "corekv_prompt_tokens_cached", "Prompt tokens whose KV was reused, by where it came from",
            ["tier"], registry=r)
        self.prompt_tokens_computed = prom.Counter("corekv_prompt_tokens_computed",
                                                   "Prompt tokens whose KV was computed", registry=r)
        self.ttft = prom.Histogram("corekv_time_to_first_token_seconds", "Seconds from arrival to first token",
                                   buckets=TTFT_BUCKETS, registry=r)
        self._server = None
        self._engine = weakref.ref(engine) if engine is not None else None
        if engine is not None:
            self._add_pool_gauges(prom)
            self.registry.register(_SpeculativeCollector(self._engine))
            self.registry.register(_ReloadCollector(self._engine))

    # -- hook implementations (registered per engine) ----------------------------------------
    @hookimpl
    def corekv_on_blocks_stored(self, events: list) -> None:
        self.blocks_stored.labels(tier="device").inc(sum(len(e.block_hashes) for e in events))

    @hookimpl
    def corekv_on_blocks_removed(self, events: list) -> None:
        self.blocks_removed.labels(tier="device").inc(sum(len(e.block_hashes) for e in events))

    @hookimpl
    def corekv_on_blocks_offloaded(self, tier: str, block_hashes: list) -> None:
        self.blocks_offloaded.labels(tier=tier).inc(len(block_hashes))

    @hookimpl
    def corekv_on_blocks_loaded(self, tier: str, block_hashes: list) -> None:
        self.blocks_loaded.labels(tier=tier).inc(len(block_hashes))

    @hookimpl
    def corekv_on_request_finished(self, output: Any) -> None:
        self.requests_finished.labels(finish_reason=output.finish_reason).inc()
        for tier, num_tokens in output.cached_tokens_by_tier.items():
            self.prompt_tokens_cached.labels(tier=tier).inc(num_tokens)
        self.prompt_tokens_computed.inc(len(output.prompt_token_ids) - output.num_cached_tokens)
        if output.ttft_s is not None:
            self.ttft.observe(output.ttft_s)

    @hookimpl
    def corekv_collect_metrics(self, engine: Any) -> bytes:
        # NOTE: registered on this engine's plugin manager only, so the engine is this one's
        return self.exposition()

    # -- exposition --------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The Prometheus text format of this engine's metrics (what a scrape returns)."""
        import prometheus_client as prom

        return prom.generate_latest(self.registry)

    def start_http_server(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` for this engine on ``addr:port`` (a daemon thread); returns the port
        bound (pass ``port=0`` for a free one). Call :meth:`close` to stop it."""
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}; pass e.g. 9400 "
                             f"(or set {PORT_ENV})")
        if self._server is not None:
            raise RuntimeError(f"this exporter already serves on port {self._server.server_port}; "
                               "call close() first")
        import prometheus_client as prom

        self._server, _thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        logger.info("prometheus metrics on http://%s:%d/metrics", addr, self._server.server_port)
        return self._server.server_port

    @hookimpl
    def corekv_on_engine_closed(self, engine: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the HTTP server, if one runs. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _add_pool_gauges(self, prom) -> None:
        engine_ref = self._engine

        def read(attribute: str):
            def value() -> float:
                engine = engine_ref()
                backend = getattr(engine, "backend", None)
                return float(getattr(backend, attribute)) if backend is not None else 0.0
            return value

        gauge = prom.Gauge("corekv_kv_blocks", "Device KV pool blocks, by state", ["state"], registry=self.registry)
        gauge.labels(state="total").set_function(read("num_blocks"))
        gauge.labels(state="free").set_function(read("num_free_blocks"))
        gauge.labels(state="pinned").set_function(read("num_pinned_blocks"))


class _SpeculativeCollector:
    """Speculative decoding's counters (``engine.stats()["speculative"]``), read at each scrape:
    ``corekv_spec_decode_verifications_total`` (a sequence's drafts verified in one step),
    ``corekv_spec_decode_draft_tokens_total``, ``corekv_spec_decode_accepted_tokens_total`` and the
    gauge ``corekv_spec_decode_mean_acceptance_length`` (tokens per verification, the target's own
    included). All 0 while speculation is off."""

    def __init__(self, engine_ref: Any):
        self._engine = engine_ref

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self._engine()
        decoder = getattr(engine, "speculative", None)
        stats = decoder.stats() if decoder is not None else {}
        for name, key, about in (
                ("verifications", "num_speculations", "Decoding sequences' drafts verified (one per sequence and step)"),
                ("draft_tokens", "num_proposed_tokens", "Draft tokens verified"),
                ("accepted_tokens", "num_accepted_tokens", "Draft tokens accepted")):
            yield CounterMetricFamily(f"corekv_spec_decode_{name}", about, value=stats.get(key, 0))
        yield GaugeMetricFamily("corekv_spec_decode_mean_acceptance_length",
                                "Tokens per verification, the target's own included (0 before any)",
                                value=stats.get("mean_acceptance_length", 0.0))


class _ReloadCollector:
    """Reload or recompute (``engine.stats()["reload"]``), read at each scrape:
    ``corekv_reload_skipped_blocks_total`` (tier hits recomputed because that was cheaper),
    ``corekv_reload_skipped_blocks_by_tier_total{tier}`` and
    ``corekv_reload_skipped_blocks_by_reason_total{reason}`` (the same blocks by the tier that held
    them, and by why: ``slower_than_recompute`` or ``after_a_skipped_run``),
    ``corekv_reload_skipped_lookups_total`` (tiers not asked: even a full hit could not beat
    recompute), ``corekv_reload_probes_total`` (skipped tiers loaded again to re-measure them), and the gauges
    ``corekv_reload_load_seconds_per_block{tier}``, ``corekv_reload_load_latency_seconds{tier}``
    (per call, measured when the tier opened) and ``corekv_reload_prefill_seconds_per_token`` once
    measured. Counters are 0 without tiers."""

    def __init__(self, engine_ref: Any):
        self._engine = engine_ref

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        offload = getattr(self._engine(), "offload", None)
        stats = offload.cost.stats() if offload is not None else {}
        yield CounterMetricFamily("corekv_reload_skipped_blocks", "Tier hits recomputed because that was cheaper",
                                  value=stats.get("skipped_blocks", 0))
        by_reason = CounterMetricFamily("corekv_reload_skipped_blocks_by_reason",
                                        "Tier hits recomputed, by why the cost model skipped them",
                                        labels=["reason"])
        for reason, num in stats.get("skipped_by_reason", {}).items():
            by_reason.add_metric([reason], num)
        yield by_reason
        by_tier = CounterMetricFamily("corekv_reload_skipped_blocks_by_tier",
                                      "Tier hits recomputed, by the tier that held them", labels=["tier"])
        for tier, num in stats.get("skipped_blocks_by_tier", {}).items():
            by_tier.add_metric([tier], num)
        yield by_tier
        yield CounterMetricFamily("corekv_reload_skipped_lookups",
                                  "Tier lookups left out because even a full hit could not beat recompute",
                                  value=stats.get("skipped_lookups", 0))
        yield CounterMetricFamily("corekv_reload_probes", "Skipped tiers loaded again to re-measure them",
                                  value=stats.get("probes", 0))
        per_block = GaugeMetricFamily("corekv_reload_load_seconds_per_block",
                                      "Measured seconds to load one block, per tier", labels=["tier"])
        for tier, seconds in stats.get("load_s_per_block", {}).items():
            if seconds is not None:
                per_block.add_metric([tier], seconds)
        yield per_block
        latency = GaugeMetricFamily("corekv_reload_load_latency_seconds",
                                    "Seconds per call to a tier, measured when it opened", labels=["tier"])
        for tier in stats.get("seeded", []):
            latency.add_metric([tier], stats["load_latency_s"][tier])
        yield latency
        if stats.get("prefill_s_per_token") is not None:
            yield GaugeMetricFamily("corekv_reload_prefill_seconds_per_token",
                                    "Measured prefill seconds per token", value=stats["prefill_s_per_token"])


def exporter_for(engine: Any) -> PrometheusExporter | None:
    """The exporter attached to ``engine``, or ``None`` (no ``prometheus-client``, or the plugin
    was not loaded)."""
    manager = getattr(engine, "plugin_manager", None)
    if manager is None:
        raise TypeError(f"exporter_for(engine=...) got {type(engine).__name__}; expected a corekv.Engine")
    return manager.pm.get_plugin(EXPORTER_NAME)


@hookimpl
def corekv_on_engine_started(engine: Any) -> None:
    if not is_available():
        logger.debug("prometheus-client is not installed; no metrics (pip install 'corekv[metrics]')")
        return
    # NOTE: the exporter is registered on *this engine's* plugin manager, so the event hooks of
    # each engine reach its own exporter only: no module-level registry, nothing shared.
    exporter = PrometheusExporter(engine)
    engine.plugin_manager.register(exporter, name=EXPORTER_NAME)
    # NOTE: engine.close() stops the HTTP server (corekv_on_engine_closed); an engine that is
    # never closed stops it when it is garbage-collected.
    weakref.finalize(engine, exporter.close)
    port = os.environ.get(PORT_ENV)
    if port:
        try:
            exporter.start_http_server(int(port))
        except (ValueError, OSError) as e:
            # NOTE: metrics are an observer: a taken port must not stop the engine from serving.
            logger.warning("%s=%r: cannot serve metrics (%s); the engine runs without an HTTP "
                           "endpoint", PORT_ENV, port, e)
