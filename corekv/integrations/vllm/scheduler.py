"""The connector's scheduler side: which blocks of a request the tiers hold, which to load into
which vLLM blocks, which to offload and when, and the KV events of what the tiers stored.

Keys are corekv's chained hashes over the request's tokens, rooted in the model fingerprint and
the request's ``cache_salt`` (and LoRA name), so a tenant's blocks are found only by requests of
that tenant, in every tier and across restarts. The last prompt token is always computed (vLLM
samples from its logits), so at most ``(num_tokens - 1) // block_size`` blocks are loaded.

When blocks are offloaded (``cache.write_policy``):

- ``write_through``: each full block in the step that computes it, after the forward;
- ``write_back``: a request's computed blocks when it finishes, the last moment they are certain
  to be in vLLM's pool (vLLM frees them to its prefix cache then, and never tells a connector
  when it reuses them); vLLM keeps them until the worker reports them saved.

With ``offload_min_hits: n`` a block is offloaded only once vLLM's own prefix cache served it
``n`` times (it is resident then, so it is saved at that admission, or at that request's end
under ``write_back``). A lookup that stops at a block whose write is still in flight answers
"not yet" (vLLM asks again next step) for up to :data:`_IN_FLIGHT_SECONDS`, so a request that
follows another one at once reloads its blocks instead of recomputing them. Requests whose KV depends on more than their token ids (images, prompt
embeddings) are neither looked up nor offloaded.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from corekv.hashing import PrefixKey
from corekv.integrations.vllm.metadata import BlockLoad, BlockSave, StepPlan, StepReport
from corekv.integrations.vllm.settings import ConnectorSettings
from corekv.integrations.vllm.shared_tiers import open_tiers, release_tiers, scheduler_started
from corekv.offload import lookup_runs

__all__ = ["SchedulerSide"]
logger = logging.getLogger(__name__)
#: most blocks whose KV-event fields wait for the worker's "stored" report, and most hit counts
_MAX_TRACKED = 1 << 16
#: longest a lookup waits for a block queued for writing (a write the tier skipped never reports)
_IN_FLIGHT_SECONDS = 2.0


@dataclass
class _Request:
    request: Any                 # vLLM's Request (live in this process)
    key: PrefixKey
    block_ids: list[int]
    num_done: int                # leading blocks loaded, hit on the device, or queued for saving
    pending: list[int] = field(default_factory=list)  # block indices to save (write_back: at the end)


class SchedulerSide:
    """Lookups, the step plan and events, for one vLLM scheduler."""

    def __init__(self, settings: ConnectorSettings, *, same_process: bool):
        self.settings = settings
        self.block_size = settings.block_size
        self.write_back = settings.cache.write_policy == "write_back"
        self.min_hits = settings.cache.offload_min_hits
        tiers, not_started = open_tiers(settings)
        self.not_started = not_started
        if not same_process:
            unseen = [t.name for t in tiers if not t.is_shared]
            if unseen:
                logger.warning("corekv connector: tier(s) %s hold entries in vLLM's worker process only, and "
                               "vLLM schedules in another process, so lookups cannot see them; they are "
                               "left out (use lmdb, redis or fsspec tiers with vLLM's multiprocess executor)",
                               unseen)
            tiers = [t for t in tiers if t.is_shared]
        self.tiers = tiers
        self.requests: dict[str, _Request] = {}
        self._lookups: dict[str, tuple[PrefixKey, int, int]] = {}
        self._plan = StepPlan()
        self._saving: set[str] = set()   # finished requests whose blocks vLLM keeps until saved
        self._hit_counts: OrderedDict[bytes, int] = OrderedDict()
        self._event_fields: OrderedDict[bytes, dict] = OrderedDict()
        #: blocks queued for writing and not yet reported stored: when they were queued
        self._in_flight: OrderedDict[bytes, float] = OrderedDict()
        self._events: list = []
        scheduler_started(self)

    # ---------------------------------------------------------------- lookups and admission
    def _key(self, request) -> PrefixKey | None:
        if request.mm_features or request.prompt_embeds is not None:
            return None  # NOTE: their KV depends on more than token ids, which corekv's keys cover
        lora = request.lora_request
        namespace = self.settings.namespace(request.cache_salt, (f"lora:{lora.lora_name}",) if lora else ())
        return PrefixKey(list(request.all_token_ids), self.block_size, namespace,
                         self.settings.cache.hash, cache_salt=request.cache_salt)

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond vLLM's device match that the tiers can give (whole blocks); ``None``:
        the next block is being written, ask again."""
        key = self._key(request)
        if key is None or not self.tiers:
            return 0
        first = num_computed_tokens // self.block_size
        limit = (request.num_tokens - 1) // self.block_size
        runs = lookup_runs(self.tiers, key.block_hashes, first, limit) if first < limit else []
        found = sum(run.num_blocks for run in runs)
        if first + found < limit and self._is_in_flight(key.block_hashes[first + found]):
            return None
        self._lookups[request.request_id] = (key, num_computed_tokens, found)
        logger.debug("lookup %s: device %d tokens, tiers %d blocks from block %d", request.request_id,
                     num_computed_tokens, found, first)
        return (first + found) * self.block_size - num_computed_tokens if found else 0

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave ``request`` its blocks; plan the load of the external tokens."""
        looked = self._lookups.pop(request.request_id, None)
        key = looked[0] if looked is not None else self._key(request)
        if key is None:
            self.requests.pop(request.request_id, None)
            return
        num_device = (looked[1] if looked is not None else request.num_computed_tokens) // self.block_size
        num_loaded = num_external_tokens // self.block_size
        state = _Request(request, key, list(block_ids), num_done=num_device + num_loaded)
        self.requests[request.request_id] = state
        if num_loaded:
            stop = num_device + num_loaded
            self._plan.loads.append(BlockLoad(request.request_id, key.token_ids[:stop * self.block_size],
                                              key.namespace, num_device, state.block_ids[num_device:stop]))
        if self.min_hits and num_device:
            self._count_device_hits(state, num_device)

    def _is_in_flight(self, block_hash: bytes) -> bool:
        queued = self._in_flight.get(block_hash)
        if queued is None:
            return False
        if time.monotonic() - queued < _IN_FLIGHT_SECONDS:
            return True
        del self._in_flight[block_hash]
        return False

    def _count_device_hits(self, state: _Request, num_device: int) -> None:
        counts = self._hit_counts
        for index, h in enumerate(state.key.block_hashes[:num_device]):
            counts[h] = n = counts.pop(h, 0) + 1
            if n == self.min_hits:
                state.pending.append(index)
        while len(counts) > _MAX_TRACKED:
            counts.popitem(last=False)

    # ---------------------------------------------------------------- the step plan
    def build_plan(self, scheduler_output) -> StepPlan:
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is not None and new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_ids[0])
                else:
                    state.block_ids.extend(new_ids[0])
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None:
                continue
            request = state.request
            if len(state.key.token_ids) < request.num_tokens:
                state.key.extend(request.all_token_ids[len(state.key.token_ids):])
            if request.num_computed_tokens < state.num_done * self.block_size:
                # vLLM rolled the request back to recompute blocks that did not load: save them again
                state.num_done = request.num_computed_tokens // self.block_size
            num_full = min((request.num_computed_tokens + num_scheduled) // self.block_size, len(state.block_ids))
            if num_full > state.num_done:
                if not self.min_hits:
                    state.pending.extend(range(state.num_done, num_full))
                state.num_done = num_full
            if not self.write_back and state.pending:
                self._queue_save(state, finished=False)
        plan, self._plan = self._plan, StepPlan()
        return plan

    def finished(self, request, block_ids: list[int]) -> bool:
        """``request`` ended; True when vLLM must keep its blocks until the worker saved them."""
        state = self.requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        if state is None or not state.pending:
            return False
        state.block_ids = list(block_ids)
        self._queue_save(state, finished=True)
        self._saving.add(request.request_id)
        return True

    def _queue_save(self, state: _Request, *, finished: bool) -> None:
        indices = sorted(set(i for i in state.pending if i < len(state.block_ids)))
        state.pending = []
        if not indices:
            return
        tokens = state.key.token_ids[:(indices[-1] + 1) * self.block_size]
        self._plan.saves.append(BlockSave(state.request.request_id, tokens, state.key.namespace, indices,
                                          [state.block_ids[i] for i in indices], finished=finished))
        now, hashes = time.monotonic(), state.key.block_hashes
        for i in indices:
            self._in_flight[hashes[i]] = now
        while len(self._in_flight) > _MAX_TRACKED:
            self._in_flight.popitem(last=False)
        self._remember_event_fields(state, indices)

    # ---------------------------------------------------------------- events
    def _remember_event_fields(self, state: _Request, indices: list[int]) -> None:
        request, size = state.request, self.block_size
        vllm_hashes, hashes = request.block_hashes, state.key.block_hashes
        lora = request.lora_request
        for i in indices:
            if i >= len(vllm_hashes):
                continue
            extra, _ = generate_block_hash_extra_keys(request, i * size, (i + 1) * size, 0)
            self._event_fields[hashes[i]] = dict(
                block_hashes=[maybe_convert_block_hash(vllm_hashes[i])],
                parent_block_hash=maybe_convert_block_hash(vllm_hashes[i - 1]) if i else None,
                token_ids=list(state.key.token_ids[i * size:(i + 1) * size]), block_size=size,
                lora_id=lora.adapter_id if lora else None, lora_name=lora.lora_name if lora else None,
                extra_keys=to_event_extra_keys([extra]))
        while len(self._event_fields) > _MAX_TRACKED:
            self._event_fields.popitem(last=False)

    def reported(self, report: StepReport | None) -> None:
        """The worker's report: one ``BlockStored`` per block a tier stored (medium: the tier's name)."""
        if report is None:
            return
        for tier_name, hashes in report.stored.items():
            for h in hashes:
                fields = self._event_fields.get(h)
                if fields is not None:
                    self._events.append(BlockStored(medium=tier_name, **fields))
        for hashes in report.stored.values():
            for h in hashes:
                self._event_fields.pop(h, None)
                self._in_flight.pop(h, None)

    def unsent_saves(self) -> StepPlan:
        """The saves planned for a step that has not been built (for the worker's shutdown)."""
        plan = StepPlan(saves=self._plan.saves)
        self._plan.saves = []
        return plan

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        release_tiers(self.settings)
