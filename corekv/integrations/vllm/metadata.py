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
    worker reports it saved; ``priority``: the eviction priority the tiers keep for them
    (corekv's sense, higher is kept longer: vLLM's ``request.priority`` negated)."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    finished: bool = False
    priority: int = 0


@dataclass
class StepPlan(KVConnectorMetadata):
    """Scheduler -> worker: this step's loads and saves, and how many tokens its forward computes
    (for the worker's prefill timing)."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, since the last report: the blocks each tier stored (``{tier name:
    [block hash]}``, for the scheduler's KV events), the blocks whose writes ended, whatever
    the outcome (``done``: no lookup waits on them any more), the loads that failed, and the
    timings the scheduler's reload cost model learns from."""

    stored: dict[str, list[bytes]] = field(default_factory=dict)
    done: list[bytes] = field(default_factory=list)
    #: request id -> blocks of its planned load that did not load (vLLM recomputes them)
    load_failures: dict[str, int] = field(default_factory=dict)
    #: (tier name, blocks read, seconds) of each timed tier read
    load_timings: list[tuple[str, int, float]] = field(default_factory=list)
    #: (tokens computed, seconds) of each forward that computed at least a block's tokens
    step_timings: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: "StepReport") -> "StepReport":
        merged = {name: list(hashes) for name, hashes in self.stored.items()}
        for name, hashes in other.stored.items():
            merged.setdefault(name, []).extend(hashes)
        failures = dict(self.load_failures)
        for req_id, num in other.load_failures.items():
            failures[req_id] = failures.get(req_id, 0) + num
        return StepReport(stored=merged, done=self.done + other.done, load_failures=failures,
                          load_timings=self.load_timings + other.load_timings,
                          step_timings=self.step_timings + other.step_timings)


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
