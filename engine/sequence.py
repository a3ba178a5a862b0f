"""One sequence's state as the scheduler moves it through the engine: tokens, blocks, progress.

A request with ``SamplingParams.n == 1`` is one :class:`Sequence`; with ``n > 1`` it starts as one
sequence that is forked into ``n`` after its prompt is prefilled (``Scheduler`` does the fork, the
``BlockManager`` shares the blocks copy-on-write).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence as SequenceABC

import torch

from corekv.hashing import PrefixKey
from corekv.offload import Parked
from corekv.engine.detokenizer import IncrementalDetokenizer, find_stop
from corekv.engine.outputs import TokenLogprobs
from corekv.engine.sampling import SamplingParams

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted): holds no blocks
    RUNNING = "running"  # admitted: holds blocks for at least its computed tokens
    FINISHED = "finished"  # done: its blocks went back to the backend


class Sequence:
    """The tokens, KV blocks and progress of one completion.

    Invariants:

    * ``key.token_ids == prompt_token_ids + output_token_ids`` (the key *is* the token store, so
      the backend hashes exactly the tokens whose KV the blocks hold);
    * ``0 <= num_computed_tokens <= num_tokens``: the first ``num_computed_tokens`` tokens have
      their KV in ``block_table`` (the last sampled token never has, until the next step);
    * ``block_table`` is empty unless ``status is RUNNING``; while running it has at least
      ``ceil(num_computed_tokens / block_size)`` blocks, in token order;
    * ``num_cached_blocks`` counts leading blocks of ``block_table`` already passed to
      ``backend.cache`` (or matched from it), so each block is offered once per admission.
    """

    def __init__(self, request_id: str, prompt_token_ids: SequenceABC[int], params: SamplingParams,
                 key: PrefixKey, *, index: int = 0, generator: torch.Generator | None = None,
                 detokenizer: IncrementalDetokenizer | None = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.index = index
        self.params = params
        self.key = key
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        #: with ``params.logprobs``, one per output token (appended by the engine as it samples)
        self.output_logprobs: list[TokenLogprobs] = []
        self.generator = generator
        self.detokenizer = detokenizer
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        #: prompt tokens reused at the first admission (what the output reports)
        self.num_cached_tokens: int | None = None
        #: those tokens by where they came from: ``{"device": n, "<tier name>": m, ...}``
        self.cached_tokens_by_tier: dict[str, int] = {}
        #: False: this request's blocks are never written to a storage tier (per-request opt-out)
        self.offload = True
        #: set while swap-preempted (what the swap tier holds of it); cleared at re-admission
        self.swap: Parked | None = None
        self.num_preemptions = 0
        #: the scheduler's count of queue entries when this one last entered the waiting queue
        #: (added or requeued): its place in the queue, for engine.prefill_first
        self.queued_at = 0
        #: completions still to fork off this one once its prompt is computed (``n - 1``, then 0)
        self.num_pending_forks = params.n - 1
        #: tokens proposed to follow this one's, verified in the next step (corekv.engine.spec_decode)
        self.draft_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.text = ""
        self._num_detokenized = 0
        self._is_text_final = False  # a stop string cut the text: later tokens add none
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}#{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")

    # -- tokens ------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.key.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.key.token_ids[:self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.key.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model; 1 for a decoding sequence."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.key.extend((token_id,))
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    # -- stopping ----------------------------------------------------------------------------
    def check_stop(self, eos_token_ids: SequenceABC[int]) -> str | None:
        """After ``append_token``: the finish reason the newest token causes, or ``None``."""
        params = self.params
        token_id = self.output_token_ids[-1]
        if params.stop:
            # NOTE: stop strings need the text as it grows; otherwise detokenizing waits for the end.
            # Before min_tokens the text still grows (so later searches start past it) unsearched.
            delta = self.update_text()
            cut = None
            if self.num_output_tokens >= params.min_tokens:
                cut = find_stop(self.text, params.stop, len(delta), params.include_stop_str_in_output)
            if cut is not None:
                self.text = self.text[:cut]
                self._is_text_final = True
                return "stop"
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    def update_text(self, final: bool = False) -> str:
        """Detokenize the tokens not yet seen into ``text``; returns the new text. ``final`` also
        flushes characters the detokenizer held back (an incomplete UTF-8 sequence)."""
        if self.detokenizer is None or self._is_text_final:
            return ""
        pending = self.output_token_ids[self._num_detokenized:]
        self._num_detokenized = len(self.output_token_ids)
        delta = self.detokenizer.add(pending) if pending else ""
        if final:
            delta += self.detokenizer.flush()
        self.text += delta
        return delta

    # -- timing ------------------------------------------------------------------------------
    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    # -- forking -----------------------------------------------------------------------------
    def fork(self, index: int, generator: torch.Generator | None,
             detokenizer: IncrementalDetokenizer | None) -> Sequence:
        """A sibling with the same tokens and progress; the caller shares the blocks."""
        key = PrefixKey(self.key.token_ids, self.key.block_size, self.key.namespace, self.key.algorithm,
                        cache_salt=self.key.cache_salt, priority=self.key.priority)
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, key, index=index,
                         generator=generator, detokenizer=detokenizer, arrival_time=self.arrival_time)
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.status = self.status
        child.block_table = list(self.block_table)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_blocks = self.num_cached_blocks
        child.num_cached_tokens = self.num_cached_tokens
        child.cached_tokens_by_tier = dict(self.cached_tokens_by_tier)
        child.offload = self.offload
        child.num_pending_forks = 0
        child.first_token_time = self.first_token_time
        return child
