"""The draft model of ``engine.speculative.method: draft``: a second, smaller model with the
target's tokenizer proposes tokens greedily, over a paged KV pool of its own.

NOTE: why a pool of its own, and not a share of the target's. The target's blocks are shared by
prefix caching, reloaded from tiers and swapped, and none of that knows a second model's KV, so the
draft's KV for a block could never be trusted to be there. A pool of its own keeps every target
invariant as it is; the draft's KV is simply recomputed where it is missing: a sequence the draft
has not seen (new, preempted, forked) gets one prefill-like chunk of its tokens first. Recomputing
the draft's whole context with Hugging Face's own cache each step would be simpler still, but costs
a prefill per step, and batching sequences of different lengths through it needs padding; the
paged runner batches them as the target's does.

Per sequence the proposer keeps a :class:`DraftState`: its blocks in the draft pool and the tokens
whose KV they hold. Before proposing, it keeps the longest prefix of those tokens the sequence
still has (drafts the target rejected are dropped there: the draft's rollback), then runs, for all
proposing sequences in one batch, the tokens it has not seen, and then one token per draft.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from corekv.engine.block_manager import blocks_for
from corekv.engine.kv_pool import KVPool
from corekv.engine.model_runner import ModelRunner, ScheduledChunk
from corekv.engine.models import LoadedModel
from corekv.engine.sequence import Sequence, SequenceStatus

__all__ = ["DraftModelProposer", "DraftState"]


@dataclass
class DraftState:
    """One sequence in the draft pool. Invariant: ``block_table`` covers, and holds the draft's KV
    of, the first ``num_computed`` positions: the sequence's own tokens, then ``fed_drafts`` (the
    drafts it was fed last, which the target may since have rejected)."""

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    fed_drafts: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts from ``loaded`` over its own pool of ``num_blocks`` blocks.

    Invariants: a block of the draft pool is either in ``_free`` or in exactly one state's table;
    states exist only for sequences still running (the others' blocks go back at the next
    proposal). A sequence whose draft blocks the pool cannot supply proposes nothing that step.
    """

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int):
        self.loaded = loaded
        self.block_size = block_size
        self.kv_pool = KVPool(loaded.num_layers, num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim,
                              loaded.dtype, loaded.device)
        self.runner = ModelRunner(loaded, self.kv_pool, native=False)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._states: dict[Sequence, DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __call__(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to ``limits[i]`` greedy drafts for each of ``seqs`` (all decoding)."""
        self._release_gone()
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, (seq, limit) in enumerate(zip(seqs, limits)) if self._prepare(seq, limit)]
        if not active:
            return drafts
        # the tokens the draft has not seen (at least the newest), then one draft token at a time
        chunks = []
        for i in active:
            state, tokens = self._states[seqs[i]], seqs[i].token_ids
            chunks.append(ScheduledChunk(tokens[state.num_computed:], state.num_computed, state.block_table))
            state.num_computed = len(tokens)
        while active:
            picked = torch.argmax(self.runner.execute(chunks), dim=-1).tolist()
            for i, token_id in zip(active, picked):
                drafts[i].append(token_id)
            active = [i for i in active if len(drafts[i]) < limits[i]]
            chunks = []
            for i in active:
                state = self._states[seqs[i]]
                chunks.append(ScheduledChunk([drafts[i][-1]], state.num_computed, state.block_table))
                state.num_computed += 1
                state.fed_drafts.append(drafts[i][-1])
        return drafts

    def _prepare(self, seq: Sequence, limit: int) -> bool:
        """Roll ``seq``'s draft state back to the tokens it still has, and give it the blocks of
        its tokens and ``limit - 1`` drafts; False (its state dropped) if the pool cannot."""
        state = self._states.setdefault(seq, DraftState())
        tokens = seq.token_ids
        # NOTE: a running sequence's tokens only grow, so only the drafts fed last can disagree
        base = state.num_computed - len(state.fed_drafts)
        num_kept = 0
        while num_kept < len(state.fed_drafts) and base + num_kept < len(tokens) \
                and state.fed_drafts[num_kept] == tokens[base + num_kept]:
            num_kept += 1
        # the newest token always runs again: its logits give the first draft
        state.num_computed = min(base + num_kept, len(tokens) - 1)
        state.fed_drafts = []
        needed = blocks_for(len(tokens) + limit - 1, self.block_size) - len(state.block_table)
        if needed > len(self._free):
            self._release(seq)
            return False
        for _ in range(needed):
            state.block_table.append(self._free.pop())
        return True

    def _release_gone(self) -> None:
        for seq in [s for s in self._states if s.status is not SequenceStatus.RUNNING]:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        state = self._states.pop(seq)
        self._free.extend(reversed(state.block_table))
