"""The connector's scheduler side: which blocks of a request the tiers hold, which to load into
which vLLM blocks, which to offload and when, and the KV events of what the tiers stored.

Keys are corekv's chained hashes over the request's tokens, rooted in the model fingerprint and
the request's ``cache_salt`` (and LoRA name), so a tenant's blocks are found only by requests of
that tenant, in every tier and across restarts. The last prompt token is always computed (vLLM
samples from its logits), so at most ``(num_tokens - 1) // block_size`` blocks are loaded.

A prompt that ends inside a block leaves that partial block in the tiers too, keyed by its
parent block and exactly its tokens (:meth:`corekv.hashing.PrefixKey.partial_hashes`), once the
prompt's prefill is done: a later prompt that continues it (the next round of a chat) loads the
whole blocks and then the partial one, so only the tokens after the earlier prompt are
computed, not the rest of its last block too. A lookup asks for the longest partial block after
the whole ones it found: one batch of up to ``block_size - 1`` keys, of the tiers on this machine
only (``host``, ``shm``, ``lmdb``), since a remote store would answer each key with a request.

When blocks are offloaded (``cache.write_policy``):

- ``write_through``: each full block in the step that computes it, after the forward;
- ``write_back``: a request's computed blocks when it finishes, the last moment they are certain
  to be in vLLM's pool (vLLM frees them to its prefix cache then, and never tells a connector
  when it reuses them); vLLM keeps them until the worker reports them saved.

The policy is corekv's one offload planner (:class:`corekv.offload.planner.OffloadPlanner`), the
engine's too. With ``offload_min_hits: n`` a block is offloaded only once vLLM's own prefix cache
served it ``n`` times (it is resident then, so it is saved at that admission, or at that
request's end under ``write_back``). Writes in flight are tracked until the worker reports each
one done (stored, skipped or failed: every queued block is reported; no timer): a lookup that
reaches such a block counts it, and the worker loads it from its writer's snapshot of the block
if the tier does not hold it yet, so a request that follows another one at once reloads its
blocks instead of recomputing them, without waiting for the write. Only a block whose save is
still in the plan vLLM has not taken yet makes a lookup answer "not yet" (vLLM asks again next
step, when the worker has it). Plans carry block hashes: the worker never
hashes tokens. Requests whose KV depends on more than their token ids (images, prompt
embeddings) are neither looked up nor offloaded.

How many of the blocks found are offered is corekv's reload cost model
(:mod:`corekv.offload.cost`: ``cache.reload_policy``, ``cache.max_load_tokens``), fed with the
tier reads and forwards the worker times and reports with each step.

``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, e.g. after a weight update
in memory) starts a new key space for this process: nothing stored before it is found after it.
The entries themselves stay (other processes on the node may share them) and age out by LRU.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from corekv.admission import build_admission
from corekv.hashing import PrefixKey
from corekv.integrations.vllm.metadata import BlockLoad, BlockSave, StepPlan, StepReport
from corekv.integrations.vllm.settings import ConnectorSettings
from corekv.integrations.vllm.shared_tiers import open_tiers, release_tiers, scheduler_started
from corekv.offload import TierRun, lookup_runs
from corekv.offload.cost import ReloadCost
from corekv.offload.planner import OffloadPlanner
from corekv.offload.tier_calls import safe_tier_call

__all__ = ["SchedulerSide"]
logger = logging.getLogger(__name__)
#: most blocks whose KV-event fields wait for the worker's "stored" report, hit counts, writes in flight
_MAX_TRACKED = 1 << 16

#: the tier index of a run of blocks the worker still holds as writes in flight (its memory)
IN_FLIGHT_RUN = -1
#: tier types whose entries are in this machine's memory, or on its disk (vLLM's hit sources)
_SOURCES = {"host": CacheHitSource.HOST, "shm": CacheHitSource.HOST, "lmdb": CacheHitSource.DISK}


def _uncount_failed_load(request, num_tokens: int) -> None:
    """``num_tokens`` that vLLM counted as external hits at admission did not load and are
    recomputed: take them off the request's prefill statistics (its ``num_cached_tokens``).

    NOTE: vLLM 0.32 sets these statistics when it schedules a request and does not revise them
    when it recovers from a load failure; the request's output, skipped in the step that failed,
    takes them in a later step, after this report."""
    stats = getattr(request, "prefill_stats", None)
    if stats is None:
        return
    num_tokens = min(num_tokens, stats.num_external_cached_tokens)
    stats.num_external_cached_tokens -= num_tokens
    stats.num_cached_tokens -= num_tokens
    stats.num_computed_tokens += num_tokens


def _split_runs(runs, num_blocks: int, block_size: int) -> dict[int, int]:
    """``{tier index: tokens}`` of the first ``num_blocks`` blocks of a lookup's tier runs."""
    split: dict[int, int] = {}
    for run in runs:
        take = min(run.num_blocks, num_blocks)
        if take <= 0:
            break
        split[run.tier_index] = split.get(run.tier_index, 0) + take * block_size
        num_blocks -= take
    return split


@dataclass
class _Request:
    request: Any                 # vLLM's Request (live in this process)
    key: PrefixKey
    block_ids: list[int]
    num_done: int                # leading blocks loaded, hit on the device, or queued for saving
    partial_saved: bool = False  # the prompt's partial last block is queued for saving (or not wanted)
    pending: list[int] = field(default_factory=list)  # block indices to save (write_back: at the end)


class SchedulerSide:
    """Lookups, the step plan and events, for one vLLM scheduler."""

    def __init__(self, settings: ConnectorSettings, *, same_process: bool):
        self.settings = settings
        self.block_size = settings.block_size
        admission = build_admission(settings.cache.admission, settings.plugin_manager,
                                    offload_min_hits=settings.cache.offload_min_hits, max_tracked=_MAX_TRACKED)
        self.planner = OffloadPlanner(write_policy=settings.cache.write_policy, admission=admission,
                                      offload_min_hits=settings.cache.offload_min_hits, max_tracked=_MAX_TRACKED)
        self._epoch = 0  # reset_cache() calls so far: part of every key (see the module docstring)
        tiers, not_started = open_tiers(settings)
        self.not_started = not_started
        if not same_process:
            unseen = [t.name for t in tiers if not t.is_shared]
            if unseen:
                logger.warning("corekv connector: tier(s) %s hold entries in vLLM's worker process only, and "
                               "vLLM schedules in another process, so lookups cannot see them; they are "
                               "left out (use the shm tier, which every process on the node shares, or "
                               "lmdb, redis or fsspec tiers with vLLM's multiprocess executor)", unseen)
            tiers = [t for t in tiers if t.is_shared]
        self.tiers = tiers
        self._tier_index = {tier.name: i for i, tier in enumerate(tiers)}  # the worker's timings name tiers
        #: corekv's reload cost model (``cache.reload_policy``, ``cache.max_load_tokens``), fed with
        #: the timings the worker reports
        self.cost = ReloadCost([t.name for t in tiers], self.block_size, policy=settings.cache.reload_policy,
                               max_load_tokens=settings.cache.max_load_tokens)
        self.requests: dict[str, _Request] = {}
        #: request id -> (key, device tokens, tier runs, partial block found: (hash, tokens, tier
        #: index) or None) of its last lookup, until its allocation
        self._lookups: dict[str, tuple[PrefixKey, int, list, tuple | None]] = {}
        #: request id -> {tier index: tokens} of its planned load, until vLLM asks where they came from
        self._load_sources: dict[str, dict[int, int]] = {}
        #: per tier: the source vLLM's metrics name for it (memory on the node, disk, else unspecified)
        types = {t.name: t.type for t in settings.cache.tiers}
        self._tier_sources = [_SOURCES.get(types.get(t.name), CacheHitSource.EXTERNAL_UNSPECIFIED) for t in tiers]
        #: the tiers asked for partial blocks: this machine's memory and disk, where asking for up
        #: to ``block_size - 1`` keys costs no request per key (see :meth:`_find_partial`)
        self._partial_tiers = [i for i, t in enumerate(tiers) if types.get(t.name) in _SOURCES]
        self._plan = StepPlan()
        self._unsent: set[bytes] = set()  # blocks whose save is in the plan not yet handed to vLLM
        self._saving: set[str] = set()   # finished requests whose blocks vLLM keeps until saved
        self._event_fields: OrderedDict[bytes, dict] = OrderedDict()
        self._events: list = []
        scheduler_started(self)

    # ---------------------------------------------------------------- lookups and admission
    def _key(self, request) -> PrefixKey | None:
        if request.mm_features or request.prompt_embeds is not None:
            return None  # NOTE: their KV depends on more than token ids, which corekv's keys cover
        lora = request.lora_request
        extra = ((f"lora:{lora.lora_name}",) if lora else ()) + ((f"reset:{self._epoch}",) if self._epoch else ())
        namespace = self.settings.namespace(request.cache_salt, extra)
        return PrefixKey(list(request.all_token_ids), self.block_size, namespace,
                         self.settings.cache.hash, cache_salt=request.cache_salt)

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond vLLM's device match that the tiers (or the worker's writes in flight)
        can give: whole blocks, then the longest partial block stored after them; ``None``: the
        next block's write is not sent yet, ask again."""
        key = self._key(request)
        if key is None or not self.tiers:
            return 0
        hashes = key.block_hashes
        first = num_computed_tokens // self.block_size
        limit = self.cost.limit(first, (request.num_tokens - 1) // self.block_size)
        runs, pos = [], first
        while pos < limit:
            found_runs = lookup_runs(self.tiers, hashes, pos, limit, ask=self.cost.worth_asking)
            runs += found_runs
            pos += sum(run.num_blocks for run in found_runs)
            if pos >= limit or not self.planner.is_in_flight(hashes[pos]):
                break
            if hashes[pos] in self._unsent:
                return None  # its save reaches the worker with the next step: ask then
            # NOTE: a write the worker received and has not finished: it loads the block from
            # the writer's snapshot (or from the tier, once written), so nothing waits for it
            num = 1
            while pos + num < limit and self.planner.is_in_flight(hashes[pos + num]) \
                    and hashes[pos + num] not in self._unsent:
                num += 1
            runs.append(TierRun(IN_FLIGHT_RUN, num))
            pos += num
        found = self.cost.num_blocks_to_load(runs)  # the runs' leading blocks that beat recompute
        # NOTE: a partial block only right after the whole ones found, and only where neither the
        # cost model nor max_load_tokens stopped them short of it
        index = first + found
        tail = min(self.block_size - 1, request.num_tokens - 1 - index * self.block_size)
        whole = found == sum(run.num_blocks for run in runs) and \
            (index < limit or limit == (request.num_tokens - 1) // self.block_size)
        partial = self._find_partial(key, index, tail) if whole and tail > 0 else None
        self._lookups[request.request_id] = (key, num_computed_tokens, runs, partial)
        logger.debug("lookup %s: device %d tokens, tiers %d blocks from block %d, partial %s", request.request_id,
                     num_computed_tokens, found, first, partial[1] if partial else 0)
        if not found and partial is None:
            return 0
        return (first + found) * self.block_size + (partial[1] if partial else 0) - num_computed_tokens

    def _find_partial(self, key: PrefixKey, index: int, max_tokens: int) -> tuple[bytes, int, int] | None:
        """The longest partial block ``index`` (at most ``max_tokens`` tokens) of ``key`` that a
        write in flight or a tier holds: (its hash, its tokens, the tier's index), or None."""
        hashes = key.partial_hashes(index, max_tokens)  # longest first
        for n, h in enumerate(hashes):
            if self.planner.is_in_flight(h) and h not in self._unsent:
                return h, max_tokens - n, IN_FLIGHT_RUN
        for tier_index in self._partial_tiers:
            tier = self.tiers[tier_index]
            flags = safe_tier_call(lambda: tier.contains_many(hashes), [], tier, "contains_many")
            n = next((i for i, held in enumerate(flags) if held), None)
            if n is not None:
                return hashes[n], max_tokens - n, tier_index
        return None

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave ``request`` its blocks; plan the load of the external tokens."""
        looked = self._lookups.pop(request.request_id, None)
        key = looked[0] if looked is not None else self._key(request)
        if key is None:
            self.requests.pop(request.request_id, None)
            return
        num_device = (looked[1] if looked is not None else request.num_computed_tokens) // self.block_size
        num_loaded, tail = divmod(num_external_tokens, self.block_size)
        if (num_loaded or tail) and looked is not None:
            sources = _split_runs(looked[2], num_loaded, self.block_size)
            if tail and looked[3] is not None:
                sources[looked[3][2]] = sources.get(looked[3][2], 0) + tail
            self._load_sources[request.request_id] = sources
        state = _Request(request, key, list(block_ids), num_done=num_device + num_loaded)
        self.requests[request.request_id] = state
        if num_loaded or tail:
            stop = num_device + num_loaded
            hashes, ids = key.block_hashes[num_device:stop], state.block_ids[num_device:stop]
            if tail:
                # NOTE: the key of exactly the ``tail`` tokens vLLM counts as loaded: the entry
                # is their KV, or it is missing and the block is reported and recomputed
                hashes, ids = hashes + key.partial_hashes(stop, tail, tail), ids + [state.block_ids[stop]]
            self._plan.loads.append(BlockLoad(request.request_id, hashes, ids))
        if num_device:
            state.pending.extend(self.planner.count_hits(key.block_hashes[:num_device]))

    def hit_sources(self, request, num_external_tokens: int) -> dict:
        """Where the tokens of ``request``'s planned load come from (vLLM's ``CacheHitSource``)."""
        by_tier = self._load_sources.pop(request.request_id, None)
        if not by_tier or sum(by_tier.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens} if num_external_tokens else {}
        sources: dict = {}
        for index, tokens in by_tier.items():
            source = CacheHitSource.HOST if index == IN_FLIGHT_RUN else self._tier_sources[index]
            sources[source] = sources.get(source, 0) + tokens
        return sources

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
                new = range(state.num_done, num_full)
                state.pending.extend(new[i] for i in self.planner.qualifying(state.key.block_hashes[new.start:new.stop]))
                state.num_done = num_full
            if self.planner.is_write_through and state.pending:
                self._queue_save(state, finished=False)
            if not state.partial_saved and request.num_computed_tokens + num_scheduled >= request.num_prompt_tokens:
                # NOTE: the prompt's partial block, once its prefill ends, under either write
                # policy: the tokens after it are generated, so the block as the request leaves
                # it is stored, if ever, under a key that only the same answer reaches
                state.partial_saved = True
                self._plan_save(state, [], self._partial(state, request.num_prompt_tokens), finished=False)
        plan, self._plan = self._plan, StepPlan()
        plan.num_tokens = sum(scheduler_output.num_scheduled_tokens.values())
        self._unsent.clear()
        return plan

    def finished(self, request, block_ids: list[int]) -> bool:
        """``request`` ended; True when vLLM must keep its blocks until the worker saved them."""
        state = self.requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._load_sources.pop(request.request_id, None)
        if state is None:
            return False
        state.block_ids = list(block_ids)
        # NOTE: a chat's next prompt continues the generated tokens too: the block they end in
        # is offloaded as a partial block (the last sampled token has no KV yet)
        final = []
        if request.num_computed_tokens > request.num_prompt_tokens:
            if len(state.key.token_ids) < request.num_computed_tokens:
                state.key.extend(request.all_token_ids[len(state.key.token_ids):])
            final = self._partial(state, request.num_computed_tokens)
        if not state.pending and not final:
            return False
        self._queue_save(state, finished=True, partials=final)
        self._saving.add(request.request_id)
        return True

    def _partial(self, state: _Request, num_tokens: int) -> list[tuple[bytes, int]]:
        """``[(hash, block id)]`` of the partial block that the request's first ``num_tokens``
        end in, where it is to be offloaded: empty where they end on a block boundary, the block
        is not the request's, the admission policy declines it or it is being written."""
        index, tail = divmod(num_tokens, self.block_size)
        if not tail or index >= len(state.block_ids):
            return []
        (h,) = state.key.partial_hashes(index, tail, tail)
        if not self.planner.qualifying([h]) or self.planner.is_in_flight(h):
            return []
        return [(h, state.block_ids[index])]

    def _queue_save(self, state: _Request, *, finished: bool, partials: list[tuple[bytes, int]] = ()) -> None:
        """Plan the save of ``state``'s pending whole blocks and of ``partials``."""
        indices = sorted(set(i for i in state.pending if i < len(state.block_ids)))
        state.pending = []
        self._plan_save(state, indices, partials, finished=finished)

    def _plan_save(self, state: _Request, indices: list[int], partials: list[tuple[bytes, int]], *,
                   finished: bool) -> None:
        hashes = [state.key.block_hashes[i] for i in indices] + [h for h, _ in partials]
        if not hashes:
            return
        self._unsent.update(hashes)
        # NOTE: vLLM's priority scheduling runs the smaller request.priority first, corekv's
        # priority eviction keeps the larger longer: the tiers take it negated, so the requests
        # vLLM serves first are the ones whose blocks stay
        self._plan.saves.append(BlockSave(state.request.request_id, hashes,
                                          [state.block_ids[i] for i in indices] + [b for _, b in partials],
                                          finished=finished, priority=-state.request.priority))
        self.planner.queued(hashes)
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
        self.planner.completed(report.done)
        for name, num_blocks, seconds in report.load_timings:
            if name in self._tier_index:
                self.cost.observe_load(self._tier_index[name], num_blocks, seconds)
        for num_tokens, seconds in report.step_timings:
            self.cost.observe_step(num_tokens, seconds)
        for req_id, num_blocks in report.load_failures.items():
            state = self.requests.get(req_id)
            if state is not None:
                _uncount_failed_load(state.request, num_blocks * self.block_size)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: a new key space for this process,
        no counts, no writes waited on (see the module docstring)."""
        self._epoch += 1
        self.planner.reset()
        self._lookups.clear()
        logger.info("corekv connector: cache reset; entries stored before it are not looked up again")
        return True

    def unsent_saves(self) -> StepPlan:
        """The saves planned for a step that has not been built (for the worker's shutdown)."""
        plan = StepPlan(saves=self._plan.saves)
        self._plan.saves = []
        self._unsent.clear()
        return plan

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        release_tiers(self.settings)
