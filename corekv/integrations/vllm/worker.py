"""The connector's worker side: vLLM's KV tensors under corekv's offload facade.

The scheduler side plans by block hash; this side only calls the offload facade's verbs.
Loads run before the forward that needs them (``start_load_kv``): the facade reads each block's
entry from the first tier that holds it, checks it against its key and the model fingerprint,
and copies it into vLLM's block. A block that does not load (a damaged, moved or forged entry
is a miss; an entry gone since the lookup) is reported to vLLM with every block after it, and
vLLM recomputes them (``kv_load_failure_policy: recompute``). Saves run after the forward
(``wait_for_save``): the blocks are copied out on the step's thread and written to every tier that
lacks them by the facade's background writer, so the step never waits for a tier; each block's
write is reported back when it ends (stored, skipped or failed), so the scheduler knows what is
still in flight.

The worker also times what the scheduler's reload cost model needs (it sees neither the tiers'
reads nor vLLM's forward): every tier read the facade makes, and each step's forward, from the
plan's binding to ``wait_for_save`` less the step's loads, over the tokens the plan says it computes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from corekv.backend import EvictedBlock
from corekv.integrations.vllm.metadata import StepPlan, StepReport
from corekv.integrations.vllm.paged_kv import PagedKV
from corekv.integrations.vllm.settings import ConnectorSettings
from corekv.integrations.vllm.shared_tiers import local_schedulers, open_tiers, release_tiers
from corekv.offload import Offload
from corekv.offload.cost import ReloadCost

__all__ = ["WorkerSide"]
logger = logging.getLogger(__name__)


class _WriteReports:
    """What the next step report carries, collected from the step's thread and the writer's:
    what the tiers stored and which writes ended (the facade's hook relay and completion
    listener), and the timings of tier reads and forwards."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stored: dict[str, list[bytes]] = {}
        self._done: list[bytes] = []
        self._load_timings: list[tuple[str, int, float]] = []
        self._step_timings: list[tuple[int, float]] = []

    def corekv_on_blocks_offloaded(self, tier: str, block_hashes) -> None:
        with self._lock:
            self._stored.setdefault(tier, []).extend(block_hashes)

    def corekv_on_blocks_loaded(self, tier: str, block_hashes) -> None:
        pass

    def done(self, block_hashes: list[bytes], outcome: str) -> None:
        with self._lock:
            self._done.extend(block_hashes)

    def load_timed(self, tier: str, num_blocks: int, seconds: float) -> None:
        with self._lock:
            self._load_timings.append((tier, num_blocks, seconds))

    def step_timed(self, num_tokens: int, seconds: float) -> None:
        with self._lock:
            self._step_timings.append((num_tokens, seconds))

    def take(self) -> StepReport | None:
        with self._lock:
            stored, done, self._stored, self._done = self._stored, self._done, {}, []
            loads, steps, self._load_timings, self._step_timings = self._load_timings, self._step_timings, [], []
        if stored or done or loads or steps:
            return StepReport(stored=stored, done=done, load_timings=loads, step_timings=steps)
        return None


class _TimedLoads(ReloadCost):
    """The facade's cost model, relaying each timed tier read to the step report (the decisions
    are the scheduler's: the worker loads what the plan says)."""

    def __init__(self, tier_names, block_size: int, reports: _WriteReports):
        super().__init__(tier_names, block_size)
        self._reports = reports

    def observe_load(self, tier_index: int, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self._reports.load_timed(self.tier_names[tier_index], num_blocks, seconds)


class WorkerSide:
    """Loads and saves of one vLLM worker."""

    def __init__(self, settings: ConnectorSettings, *, num_blocks: int):
        self.settings = settings
        self.num_blocks = num_blocks
        self.offload: Offload | None = None
        self._reports = _WriteReports()
        self._load_errors: set[int] = set()
        self._load_failures: dict[str, int] = {}  # request id -> blocks that did not load
        self._saved_requests: set[str] = set()
        self._step_started: float | None = None  # when this step's plan was bound
        self._step_load_s = 0.0                   # of it, spent loading
        self.counters: Counter[str] = Counter()

    def register(self, kv_caches) -> None:
        pool = PagedKV(kv_caches, num_blocks=self.num_blocks, page_bytes=self.settings.page_bytes,
                       block_size=self.settings.block_size)
        if pool.bytes_per_block != self.settings.block_bytes:
            raise ValueError(f"vLLM registered {len(pool.layers)} KV layers, the KV cache config named "
                             f"{self.settings.num_layers}")
        tiers, _ = open_tiers(self.settings)
        if not tiers:
            release_tiers(self.settings)
            return
        cache = self.settings.cache
        # NOTE: the scheduler side decides when a block is offloaded; here every save is offered
        # as the facade's write-back ("the slot may be reused now"), with no hit filter.
        timed = _TimedLoads([t.name for t in tiers], pool.block_size, self._reports)
        self.offload = Offload(tiers, pool, write_policy="write_back", offload_min_hits=0,
                               queue_blocks=cache.offload_queue_blocks, hooks=self._reports, prefetch_blocks=0,
                               on_done=self._reports.done, reload_cost=timed)

    def step_started(self) -> None:
        """vLLM bound this step's plan: its forward follows (loads first, where it has any)."""
        self._step_started, self._step_load_s = time.perf_counter(), 0.0

    def load(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        try:
            self._load(plan)
        finally:
            self._step_load_s += time.perf_counter() - started

    def _load(self, plan: StepPlan) -> None:
        if self.offload is None:
            for load in plan.loads:
                self._load_errors.update(load.block_ids)
                self._load_failures[load.req_id] = len(load.block_ids)
            return
        for load in plan.loads:
            loaded = self.offload.load_blocks(load.block_hashes, load.block_ids)
            num = sum(loaded.values())
            self.counters["loaded_blocks"] += num
            if num < len(load.block_ids):
                failed = load.block_ids[num:]
                self._load_errors.update(failed)
                self._load_failures[load.req_id] = self._load_failures.get(load.req_id, 0) + len(failed)
                self.counters["load_errors"] += len(failed)
                # NOTE: vLLM recomputes these blocks and the scheduler saves them again; their
                # entries go first, since a damaged entry after the first would otherwise stay
                # (a write skips keys a tier holds) and fail the next load too.
                self.offload.discard(load.block_hashes[num:])
                logger.warning("corekv connector: %d of %d blocks of request %s did not load (entry rejected "
                               "or gone); vLLM recomputes them", len(failed), len(load.block_ids), load.req_id)

    def save(self, plan: StepPlan, *, wait: bool = False) -> None:
        """Offer ``plan``'s blocks to the tiers; ``wait``: write them all now (the queue bound
        kept by batches, none skipped), as at shutdown. Ends the step's forward timing."""
        if self._step_started is not None and plan.num_tokens >= self.settings.block_size:
            forward_s = time.perf_counter() - self._step_started - self._step_load_s
            self._reports.step_timed(plan.num_tokens, forward_s)
        self._step_started = None
        for save in plan.saves:
            if self.offload is not None:
                pairs = list(zip(save.block_hashes, save.block_ids))
                if wait:
                    self.offload.flush(pairs, priorities=[save.priority] * len(pairs))
                else:
                    self.offload.evicted([EvictedBlock(h, b, save.priority) for h, b in pairs])
                self.counters["saved_blocks"] += len(pairs)
            else:
                self._reports.done(list(save.block_hashes), "failed")  # no tier: nothing to wait for
            if save.finished:
                self._saved_requests.add(save.req_id)

    def finished_saving(self) -> set[str]:
        done, self._saved_requests = self._saved_requests, set()
        return done

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def report(self) -> StepReport | None:
        report, failures = self._reports.take(), self._load_failures
        if failures:
            self._load_failures = {}
            report = report or StepReport()
            report.load_failures = failures
        return report

    def take_counters(self) -> dict[str, int]:
        """The counters since the last call (for vLLM's stats)."""
        counters, self.counters = dict(self.counters), Counter()
        return counters

    def close(self) -> None:
        if self.offload is not None:
            for scheduler in local_schedulers():
                if scheduler.settings.store_key == self.settings.store_key:
                    self.save(scheduler.unsent_saves(), wait=True)
            self.offload.close()
            self.offload = None
            release_tiers(self.settings)
