"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step is a fresh decision under two limits, ``max_num_batched_tokens`` (the token budget of
one forward) and ``max_num_seqs`` (running sequences). Decodes go first (one token each), then
prompts already being prefilled, then new admissions; with chunked prefill a prompt takes what is
left of the budget and continues next step, so a long prompt never stalls the decodes.

With ``prefill_first`` (``engine.prefill_first``) a prompt that has produced no token yet and finds
the pool full preempts running decodes for its blocks, newest first (swap preemption parks their
KV in the host tier, so they resume where they were): first tokens come before the rest of other
requests' outputs, the order that lowers mean TTFT when the pool cannot hold every request at
once. Preempted sequences requeue behind the prompts already waiting, and prompts that arrive
later wait behind them and never preempt them, so under steady arrivals nothing starves.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass

from corekv.engine.block_manager import BlockManager
from corekv.engine.scheduling import ORDER_BY_POLICY
from corekv.engine.sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "ScheduledSeq", "SCHEDULING_POLICIES"]

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = tuple(ORDER_BY_POLICY)
#: ``lpm`` orders by longest prefix match only while the queue is at most this long: beyond it,
#: matching every waiting prompt each step costs more than the reuse it finds (and FCFS is fair).
#: (``dfs-weight`` bounds its own cost, see corekv.engine.scheduling; ``lof`` reads no backend.)
LPM_QUEUE_LIMIT = 128


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq``, starting at ``start_pos``, run in this step (a decode
    may verify ``draft_token_ids`` after its token, see corekv.engine.spec_decode)."""

    seq: Sequence
    start_pos: int
    num_tokens: int
    draft_token_ids: tuple[int, ...] = ()


class Scheduler:
    """Owns the waiting queue and the running list.

    Invariants:

    * every unfinished sequence is in exactly one of ``waiting`` (holding no blocks) and
      ``running`` (holding blocks for all its tokens but, while decoding, maybe the newest);
    * ``running`` is in admission order, so its tail is the newest (the first preemption victim);
    * with ``prefill_first``, only sequences that have produced a token are preempted for a prompt,
      only for one that has produced none, and never for one queued after they were requeued;
    * one step's scheduled tokens never exceed ``max_num_batched_tokens``, except a sequence
      that can only run whole (chunked prefill off) and is then alone in its step;
    * ``len(running) + pending forks <= max_num_seqs``.
    """

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 scheduling: str = "lpm", enable_chunked_prefill: bool = True, prefill_first: bool = False,
                 eos_token_ids: SequenceABC[int] = (),
                 make_fork: Callable[[Sequence, int], Sequence] | None = None):
        if scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"engine.scheduling must be one of {SCHEDULING_POLICIES}, got {scheduling!r}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduling = scheduling
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefill_first = prefill_first
        self.eos_token_ids = frozenset(eos_token_ids)
        self.make_fork = make_fork or (lambda parent, index: parent.fork(index, None, None))
        self.waiting: deque[Sequence] = deque()
        self._num_queued = 0  # entries into the waiting queue so far (Sequence.queued_at)
        self.running: list[Sequence] = []
        self._finished_unstepped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_computed_tokens = 0
        self.num_output_tokens = 0

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._num_queued += 1
        seq.queued_at = self._num_queued
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_unstepped)

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work; may preempt running sequences to make room for decodes."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in list(self.running):  # decodes first, oldest first
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            drafts = self._lookahead(seq, budget)
            if drafts or self._make_room_for_decode(seq):
                batch.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, drafts))
                budget -= 1 + len(drafts)
        for seq in self.running:  # then prompts already being prefilled
            if budget > 0 and seq.num_uncomputed_tokens > 1:
                num_tokens = min(seq.num_uncomputed_tokens, budget)
                batch.append(ScheduledSeq(seq, seq.num_computed_tokens, num_tokens))
                budget -= num_tokens
        # NOTE: a parent still prefilling will become 1 + num_pending_forks running sequences.
        num_seqs = len(self.running) + sum(s.num_pending_forks for s in self.running)
        in_flight = self._in_flight_blocks()
        for seq in self._admission_order():  # then new (or preempted) sequences
            if budget == 0 or num_seqs + 1 + seq.num_pending_forks > self.max_num_seqs:
                break
            if in_flight and self._waits_for_in_flight(seq, in_flight):
                continue
            if not self.enable_chunked_prefill and (batch or self.running):
                # NOTE: unchunked, a prompt runs whole: in a step with room for it, or alone.
                if seq.num_tokens - len(self.blocks.match(seq)) * self.blocks.block_size > budget:
                    break
            if not self.blocks.allocate(seq):
                if not (self.prefill_first and seq.num_output_tokens == 0
                        and self._preempt_decodes_for(seq, batch)):
                    break
                # NOTE: the victims left the step and the running list: what is left of both limits
                used = sum(item.num_tokens + len(item.draft_token_ids) for item in batch)
                budget = max(0, self.max_num_batched_tokens - used)
                num_seqs = len(self.running) + sum(s.num_pending_forks for s in self.running)
            self._admit(seq)
            num_seqs += 1 + seq.num_pending_forks
            num_tokens = seq.num_uncomputed_tokens
            if self.enable_chunked_prefill:
                num_tokens = min(num_tokens, budget)
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, num_tokens))
            budget -= min(num_tokens, budget)
            if self.blocks.enable_prefix_caching:
                in_flight.update(self._uncomputed_prompt_blocks(seq))
        if not batch and self.waiting and not self.running:
            # NOTE: nothing runs, so every unpinned block is free: the head can never fit (e.g.
            # pins grew after it was added). Abort it rather than spin forever.
            head = self._admission_order()[0]
            logger.error("request %r needs %d blocks for its %d tokens but the pool can never supply "
                         "them (pinned blocks grew since it was added?); aborting it", head.request_id,
                         self.blocks.num_blocks_needed(head.num_tokens), head.num_tokens)
            self.abort(head)
        return batch

    def advance(self, batch: SequenceABC[ScheduledSeq]) -> tuple[list[Sequence], list[int]]:
        """After the forward: record computed tokens, cache filled blocks, fork ``n > 1``.

        :returns: the sequences that now sample a token, and the logits row each samples from
            (forks of one prompt share their parent's row).
        """
        seqs: list[Sequence] = []
        rows: list[int] = []
        for row, item in enumerate(batch):
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            self.num_computed_tokens += item.num_tokens
            self.blocks.cache_full_blocks(seq)
            if seq.num_uncomputed_tokens > 0:
                continue  # a prefill chunk with more to come: its logits are not used
            seqs.append(seq)
            rows.append(row)
            for index in range(1, seq.num_pending_forks + 1):
                child = self.make_fork(seq, index)
                self.blocks.fork(seq, child)
                self.running.append(child)
                seqs.append(child)
                rows.append(row)
            seq.num_pending_forks = 0
        return seqs, rows

    def postprocess(self, seqs: SequenceABC[Sequence], token_ids: SequenceABC[int | list[int]]) -> list[Sequence]:
        """Append each sampled token (after a speculative verification: each accepted draft, then
        the target's token); finish the sequences that stop. Returns the finished ones."""
        finished, self._finished_unstepped = self._finished_unstepped, []
        for seq, new in zip(seqs, token_ids, strict=True):
            reason = None
            for num_appended, token_id in enumerate((new,) if isinstance(new, int) else new, 1):
                seq.append_token(token_id)
                self.num_output_tokens += 1
                reason = seq.check_stop(self.eos_token_ids)
                if reason is not None:
                    break
            if not isinstance(new, int):  # NOTE: before _finish frees the blocks they fill
                self._accept_drafts(seq, num_appended - 1)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` now with ``finish_reason="abort"`` (returned by the next postprocess)."""
        if not seq.is_finished:
            self._finish(seq, "abort")
            self._finished_unstepped.append(seq)

    # -- helpers -----------------------------------------------------------------------------
    def _admission_order(self) -> list[Sequence]:
        """The waiting queue in the order ``scheduling`` admits it (see corekv.engine.scheduling);
        with ``prefill_first``, the prompts queued before the first preempted sequence go first
        (each part in the policy's order)."""
        if not self.prefill_first:
            return self._ordered(self.waiting)
        queue = list(self.waiting)
        first = next((i for i, s in enumerate(queue) if s.num_output_tokens), len(queue))
        return self._ordered(queue[:first]) + self._ordered(queue[first:])

    def _ordered(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        if self.scheduling == "lpm" and len(waiting) > LPM_QUEUE_LIMIT:
            return list(waiting)
        return ORDER_BY_POLICY[self.scheduling](waiting, lambda s: len(self.blocks.match(s)))

    def _in_flight_blocks(self) -> set:
        """Hashes of the full prompt blocks that running prefills have yet to compute."""
        if not self.waiting or not self.blocks.enable_prefix_caching:  # NOTE: nobody to hold back
            return set()
        return {h for seq in self.running if seq.num_uncomputed_tokens > 1
                for h in self._uncomputed_prompt_blocks(seq)}

    def _uncomputed_prompt_blocks(self, seq: Sequence) -> list:
        bs = self.blocks.block_size
        return seq.key.block_hashes[seq.num_computed_tokens // bs:seq.num_prompt_tokens // bs]

    def _waits_for_in_flight(self, seq: Sequence, in_flight: set) -> bool:
        """Whether ``seq``'s first uncached block is one a running prefill is computing.

        NOTE: admitted now, ``seq`` would compute its own copy of those blocks (they are not
        cached yet) and its block table would share nothing with the producer's, so decode
        attention could not share them either (cascade, see corekv.engine.attention). Held
        back, it matches them once the producer caches them. No deadlock or starvation: the
        producer is running, so it keeps computing (or is preempted, and then nothing is in
        flight), and a later request with the same prefix is held back behind the same producer.
        """
        num_hit = len(self.blocks.match(seq))
        if num_hit >= (seq.num_tokens - 1) // self.blocks.block_size:
            return False  # nothing more it could match
        return seq.key.block_hashes[num_hit] in in_flight

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.num_cached_tokens is None:  # first admission: count the prompt's reuse once
            seq.num_cached_tokens = seq.num_computed_tokens
            self.num_prompt_tokens += seq.num_prompt_tokens
            self.num_cached_prompt_tokens += seq.num_computed_tokens

    def _lookahead(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The drafts ``seq`` verifies this step: its proposals that fit the budget, when their
        slots come from empty blocks while one stays free per running sequence (speculation never
        preempts, evicts a cached prefix, nor takes a block another sequence's next token needs);
        else none."""
        drafts, seq.draft_token_ids = tuple(seq.draft_token_ids[:budget - 1]), []
        if drafts and self.blocks.append_slots(seq, 1 + len(drafts), num_reserved_blocks=len(self.running)):
            return drafts
        return ()

    def _accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a verification: the KV of the accepted drafts appended before the last token is
        computed (their full blocks become cached), the slots of the others are not, and blocks only
        they reached go back."""
        seq.num_computed_tokens += num_accepted
        self.num_computed_tokens += num_accepted
        self.blocks.cache_full_blocks(seq)
        self.blocks.release_lookahead(seq)

    def _make_room_for_decode(self, seq: Sequence) -> bool:
        """Get ``seq`` a writable slot, preempting the newest running sequences if needed."""
        while not self.blocks.append_slot(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt_decodes_for(self, seq: Sequence, batch: list[ScheduledSeq]) -> bool:
        """``prefill_first``: preempt the running sequences that have produced a token, newest
        first (their items leave this step's ``batch``), until waiting ``seq`` gets its blocks;
        none when even all of them could not make room.

        NOTE: a sequence requeued before ``seq`` was queued is ahead of it, so ``seq`` may not
        preempt it once it is back in: else a stream of later prompts would swap it out every step.
        """
        victims = [s for s in reversed(self.running) if s.num_output_tokens
                   and (s.num_preemptions == 0 or s.queued_at > seq.queued_at)]
        needed = self.blocks.num_blocks_needed(seq.num_tokens) - len(self.blocks.match(seq))
        # NOTE: an upper bound of what they free (blocks they share with others stay held)
        if self.blocks.backend.num_free_blocks + sum(len(v.block_table) for v in victims) < needed:
            return False
        for victim in victims:
            batch[:] = [item for item in batch if item.seq is not victim]
            self._preempt(victim)
            if self.blocks.allocate(seq):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks (cached full ones stay hittable) and requeue first (last with
        ``prefill_first``); with swap preemption the blocks' KV is parked in the swap tier first
        and reloaded at re-admission."""
        self.blocks.swap_out(seq)
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.prefill_first:  # NOTE: behind the prompts waiting now, ahead of later ones
            self.add(seq)
        else:
            self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.blocks.free(seq)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.blocks.release_waiting(seq)  # aborted: its prefetch, its swapped-out partial block
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
