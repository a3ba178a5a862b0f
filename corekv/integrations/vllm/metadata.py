"""What the connector's two sides tell each other once per step (vLLM pickles these between
processes, so they are module-level dataclasses of plain values)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["BlockLoad", "BlockSave", "CoreKVStats", "StepPlan", "StepReport"]


@dataclass
class BlockLoad:
    """Read the blocks ``block_hashes`` (consecutive blocks of a request's chain) from the tiers
    into vLLM blocks ``block_ids`` (one each), before this step's forward."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]


@dataclass
class BlockSave:
    """Offload the blocks ``block_hashes`` from vLLM blocks ``block_ids`` (one each) after this
    step's forward; ``finished``: the request has ended and vLLM keeps its blocks until the
    worker reports it saved."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    finished: bool = False


@dataclass
class StepPlan(KVConnectorMetadata):
    """Scheduler -> worker: this step's loads and saves."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, since the last report: the blocks each tier stored (``{tier name:
    [block hash]}``, for the scheduler's KV events), the blocks whose writes ended, whatever
    the outcome (``done``: no lookup waits on them any more), and the loads that failed."""

    stored: dict[str, list[bytes]] = field(default_factory=dict)
    done: list[bytes] = field(default_factory=list)
    #: request id -> blocks of its planned load that did not load (vLLM recomputes them)
    load_failures: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: "StepReport") -> "StepReport":
        merged = {name: list(hashes) for name, hashes in self.stored.items()}
        for name, hashes in other.stored.items():
            merged.setdefault(name, []).extend(hashes)
        failures = dict(self.load_failures)
        for req_id, num in other.load_failures.items():
            failures[req_id] = failures.get(req_id, 0) + num
        return StepReport(stored=merged, done=self.done + other.done, load_failures=failures)


@dataclass
class CoreKVStats(KVConnectorStats):
    """The worker's counters since the last report (blocks loaded, blocks that failed to load,
    blocks offered for saving), summed by vLLM's stats logger and shown in its KV-transfer log
    lines and metrics."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "CoreKVStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
