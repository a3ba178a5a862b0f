"""``CoreKVConnector``: vLLM's KV connector interface (``KVConnectorBase_V1``) over corekv's tiers.

vLLM builds one instance per role: the scheduler side (:mod:`.scheduler`) in the engine-core
process, the worker side (:mod:`.worker`) beside the model; this class only routes vLLM's calls
to the side its role has and translates the shapes.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from corekv.integrations.vllm.metadata import CoreKVStats, StepPlan, StepReport
from corekv.integrations.vllm.scheduler import SchedulerSide
from corekv.integrations.vllm.settings import read_settings
from corekv.integrations.vllm.shared_tiers import has_worker, worker_started
from corekv.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["CoreKVConnector"]
logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """corekv's log records go where vLLM's go (vLLM configures only its own logger)."""
    corekv_logger, vllm_logger = logging.getLogger("corekv"), logging.getLogger("vllm")
    if not corekv_logger.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            corekv_logger.addHandler(handler)
        corekv_logger.setLevel(vllm_logger.level or logging.INFO)
        corekv_logger.propagate = False


class CoreKVConnector(KVConnectorBase_V1):
    """corekv's tiers (host, LMDB, Redis, fsspec, plugins') as vLLM's external KV cache.

    Load with ``KVTransferConfig(kv_connector="CoreKVConnector",
    kv_connector_module_path="corekv.integrations.vllm", kv_role="kv_both",
    kv_connector_extra_config={"config": "cache.yaml"})``; see :mod:`.settings` for the config.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        # NOTE: a block that failed to load is recomputed, never used: corekv reports it as a
        # load error, and vLLM's default for those ("fail") would end the request instead.
        vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        settings = read_settings(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            same_process = has_worker() or vllm_config.parallel_config.distributed_executor_backend == "uni"
            self._scheduler = SchedulerSide(settings, same_process=same_process)
        else:
            self._worker = WorkerSide(settings, num_blocks=kv_cache_config.num_blocks)
            worker_started()
        logger.info("corekv connector (%s): block size %d, fingerprint %s, config %s, executor %s", role.name,
                    settings.block_size, settings.fingerprint[:12], settings.config_path,
                    vllm_config.parallel_config.distributed_executor_backend)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss, not a lost hand-off

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        return self._scheduler.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepPlan:
        return self._scheduler.build_plan(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        self._scheduler.reported(report if isinstance(report, StepReport) else None)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids), None

    def take_events(self):
        return self._scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started()  # the step's forward follows

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are whole blocks of every layer, done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass  # saves are whole blocks of every layer, taken in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished_saving() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def build_connector_worker_meta(self) -> StepReport | None:
        return self._worker.report()

    def get_kv_connector_stats(self) -> CoreKVStats | None:
        counters = self._worker.take_counters() if self._worker is not None else {}
        return CoreKVStats(data=counters) if counters else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CoreKVStats:
        return CoreKVStats(data=dict(data or {}))

    def shutdown(self) -> None:
        for side in (self._worker, self._scheduler):
            if side is not None:
                side.close()
