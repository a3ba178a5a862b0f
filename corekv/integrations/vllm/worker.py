"""The connector's worker side: vLLM's KV tensors under corekv's offload facade.

Loads run before the forward that needs them (``start_load_kv``): the facade reads each block's
entry from the first tier that holds it, checks it against its key and the model fingerprint,
and copies it into vLLM's block. A block that does not load (a damaged, moved or forged entry
is a miss; an entry gone since the lookup) is reported to vLLM with every block after it, and
vLLM recomputes them (``kv_load_failure_policy: recompute``). Saves run after the forward
(``wait_for_save``): the blocks are copied out on the step's thread and written to every tier that
lacks them by the facade's background writer, so the step never waits for a tier.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

from corekv.backend import EvictedBlock
from corekv.hashing import PrefixKey
from corekv.integrations.vllm.metadata import StepPlan, StepReport
from corekv.integrations.vllm.paged_kv import PagedKV
from corekv.integrations.vllm.settings import ConnectorSettings
from corekv.integrations.vllm.shared_tiers import local_schedulers, open_tiers, release_tiers
from corekv.offload import Offload
from corekv.offload.tier_calls import safe_tier_call

__all__ = ["WorkerSide"]
logger = logging.getLogger(__name__)


class _StoredBlocks:
    """The facade's hook relay: collects what the tiers stored, from the writer thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stored: dict[str, list[bytes]] = {}

    def corekv_on_blocks_offloaded(self, tier: str, block_hashes) -> None:
        with self._lock:
            self._stored.setdefault(tier, []).extend(block_hashes)

    def corekv_on_blocks_loaded(self, tier: str, block_hashes) -> None:
        pass

    def take(self) -> dict[str, list[bytes]]:
        with self._lock:
            stored, self._stored = self._stored, {}
        return stored


class WorkerSide:
    """Loads and saves of one vLLM worker."""

    def __init__(self, settings: ConnectorSettings, *, num_blocks: int):
        self.settings = settings
        self.num_blocks = num_blocks
        self.offload: Offload | None = None
        self._stored = _StoredBlocks()
        self._load_errors: set[int] = set()
        self._saved_requests: set[str] = set()
        self.counters: Counter[str] = Counter()

    def register(self, kv_caches) -> None:
        pool = PagedKV(kv_caches, num_blocks=self.num_blocks, page_bytes=self.settings.page_bytes)
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
                               queue_blocks=cache.offload_queue_blocks, hooks=self._stored, prefetch_blocks=0)

    def _key(self, token_ids, namespace) -> PrefixKey:
        return PrefixKey(token_ids, self.settings.block_size, namespace, self.settings.cache.hash)

    def load(self, plan: StepPlan) -> None:
        if self.offload is None:
            for load in plan.loads:
                self._load_errors.update(load.block_ids)
            return
        for load in plan.loads:
            stop = load.start + len(load.block_ids)
            key = self._key(load.token_ids, load.namespace)
            loaded = self.offload.load(load.req_id, key, load.start, stop, load.block_ids)
            num = sum(loaded.values())
            self.counters["loaded_blocks"] += num
            if num < len(load.block_ids):
                failed = load.block_ids[num:]
                self._load_errors.update(failed)
                self.counters["load_errors"] += len(failed)
                # NOTE: vLLM recomputes these blocks and the scheduler saves them again; their
                # entries go first, since a damaged entry after the first would otherwise stay
                # (a write skips keys a tier holds) and fail the next load too.
                stale = key.block_hashes[load.start + num:stop]
                for tier in self.offload.tiers:
                    safe_tier_call(lambda: tier.delete(stale), None, tier, "delete")
                logger.warning("corekv connector: %d of %d blocks of request %s did not load (entry rejected "
                               "or gone); vLLM recomputes them", len(failed), len(load.block_ids), load.req_id)

    def save(self, plan: StepPlan, *, wait: bool = False) -> None:
        """Offer ``plan``'s blocks to the tiers; ``wait``: write them all now (the queue bound
        kept by batches, none skipped), as at shutdown."""
        for save in plan.saves:
            if self.offload is not None:
                hashes = self._key(save.token_ids, save.namespace).block_hashes
                pairs = [(hashes[i], b) for i, b in zip(save.indices, save.block_ids)]
                if wait:
                    self.offload.flush(pairs)
                else:
                    self.offload.evicted([EvictedBlock(h, b) for h, b in pairs])
                self.counters["saved_blocks"] += len(save.indices)
            if save.finished:
                self._saved_requests.add(save.req_id)

    def finished_saving(self) -> set[str]:
        done, self._saved_requests = self._saved_requests, set()
        return done

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def report(self) -> StepReport | None:
        stored = self._stored.take()
        return StepReport(stored=stored) if stored else None

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
