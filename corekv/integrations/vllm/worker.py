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
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

from corekv.backend import EvictedBlock
from corekv.integrations.vllm.metadata import StepPlan, StepReport
from corekv.integrations.vllm.paged_kv import PagedKV
from corekv.integrations.vllm.settings import ConnectorSettings
from corekv.integrations.vllm.shared_tiers import local_schedulers, open_tiers, release_tiers
from corekv.offload import Offload

__all__ = ["WorkerSide"]
logger = logging.getLogger(__name__)


class _WriteReports:
    """The facade's hook relay and completion listener: what the tiers stored and which writes
    ended, collected from the writer thread until the next step report."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stored: dict[str, list[bytes]] = {}
        self._done: list[bytes] = []

    def corekv_on_blocks_offloaded(self, tier: str, block_hashes) -> None:
        with self._lock:
            self._stored.setdefault(tier, []).extend(block_hashes)

    def corekv_on_blocks_loaded(self, tier: str, block_hashes) -> None:
        pass

    def done(self, block_hashes: list[bytes], outcome: str) -> None:
        with self._lock:
            self._done.extend(block_hashes)

    def take(self) -> StepReport | None:
        with self._lock:
            stored, done, self._stored, self._done = self._stored, self._done, {}, []
        return StepReport(stored=stored, done=done) if stored or done else None


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
        self.offload = Offload(tiers, pool, write_policy="write_back", offload_min_hits=0,
                               queue_blocks=cache.offload_queue_blocks, hooks=self._reports, prefetch_blocks=0,
                               on_done=self._reports.done)

    def load(self, plan: StepPlan) -> None:
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
        kept by batches, none skipped), as at shutdown."""
        for save in plan.saves:
            if self.offload is not None:
                pairs = list(zip(save.block_hashes, save.block_ids))
                if wait:
                    self.offload.flush(pairs)
                else:
                    self.offload.evicted([EvictedBlock(h, b) for h, b in pairs])
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
