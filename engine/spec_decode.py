"""Speculative decoding: propose a few tokens per decoding sequence, verify them all in one forward.

One step with speculation (``engine.speculative``), as :class:`corekv.engine.llm_engine.Engine`
runs it:

1. :meth:`SpeculativeDecoder.propose` sets each decoding sequence's ``draft_token_ids``: up to
   ``num_speculative_tokens`` tokens from the proposer (:class:`NgramProposer`, or the draft model
   of :mod:`corekv.engine.draft_model`), never more than the request's ``max_tokens`` leaves room for.
2. The scheduler gives a sequence its drafts only when their KV slots come without preempting anyone
   (:meth:`corekv.engine.block_manager.BlockManager.append_slots`) and the step's token budget has
   room; the sequence's chunk is then its last token and the drafts, a prefill-like chunk over its
   blocks, with one logits row per token.
3. :meth:`SpeculativeDecoder.verify` samples the target's token at every verified position with
   the engine's own sampler (greedy: the argmax) and accepts the drafts while each equals the
   target's token before it; the target's token at the first disagreement (or after the last
   draft) comes with them. For deterministic drafts this is standard rejection sampling (draft ``d``
   accepted with probability ``p(d)``, else a token from ``p`` without ``d``), so every token keeps
   the target's distribution; and a seeded request draws the uniforms it would draw without
   drafts, so it gets the same tokens with or without speculation.
4. The scheduler appends the accepted tokens and the target's token one by one (stop strings,
   ``max_tokens`` and EOS are checked after each), counts the accepted drafts as computed, offers the
   blocks they filled to the prefix cache (and so to the tiers), and returns the blocks that only
   rejected drafts reached (:meth:`~corekv.engine.block_manager.BlockManager.release_lookahead`).

A block is cached, and so offloaded, only once all its tokens are accepted; a rejected draft's KV
stays in a slot past the sequence's computed tokens, which the next tokens overwrite.

Which sequences speculate, and how many drafts: requests without logits processors or
log-probabilities (their processed logits at a draft position would need the drafts as history),
each with as many drafts as pay for their verification given its recent acceptance rate
(:class:`AcceptanceTracker`) and what a step costs per token (:class:`StepCost`), see
:class:`SpeculativeDecoder`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from corekv.config.schema import SpeculativeConfig
from corekv.errors import ConfigError
from corekv.engine.models import LoadedModel, load_model
from corekv.engine.sampling import SamplingParams
from corekv.engine.sequence import Sequence, SequenceStatus

__all__ = ["NgramProposer", "SpeculativeDecoder", "can_speculate", "make_speculative_decoder"]


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method): find the longest n-gram ending the sequence
    (``prompt_lookup_min <= n <= prompt_lookup_max``) that also occurs earlier in its tokens, and
    propose the tokens that followed its last earlier occurrence with room for them all (else its
    earliest one).

    NOTE: vLLM takes the earliest occurrence of the longest n-gram; the latest one is taken here:
    in an edit of a text the latest copy is the one being followed.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: SequenceABC[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` proposed continuations of ``token_ids`` (``[]``: no match)."""
        if num_tokens < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids)
        last = len(tokens) - 1
        # NOTE: candidates are earlier positions holding the newest token; each extends its match
        # backwards one token at a time, so the cost is a few vector compares over the candidates.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if len(ends) == 0:
            return []
        lengths = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, self.max_n):
            alive &= ends >= back
            alive[alive] = tokens[ends[alive] - back] == tokens[last - back]
            if not alive.any():
                break
            lengths += alive
        best = int(lengths.max())
        if best < self.min_n:
            return []
        # NOTE: the latest occurrence followed by num_tokens tokens, else the earliest (the longest
        # continuation): in a repeating run the latest occurrence ends right before the newest token
        starts = ends[lengths == best] + 1
        full = starts[starts + num_tokens <= last + 1]
        start = int(full[-1] if len(full) else starts[0])
        return tokens[start:start + num_tokens].tolist()


class AcceptanceTracker:
    """One sequence's recent acceptance rate ``rate``: the chance that a draft token is accepted
    given the ones before it were (the geometric model: accepted drafts per draft that ended a
    verification by a rejection, or per accepted one), over exponentially decaying counts.

    Invariant: ``accepted, rejected >= 0`` and ``accepted + rejected > 0``; a new tracker starts from
    the rate it is given, worth ``PRIOR`` drafts.
    """

    #: weight of the history at each new verification
    DECAY = 0.7
    PRIOR = 2.0

    def __init__(self, rate: float):
        self.accepted, self.rejected = self.PRIOR * rate, self.PRIOR * (1.0 - rate)
        #: ``(num_tokens, token)``: an unverified one-token proposal, checked against the next token
        self.shadow: tuple[int, int] | None = None

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = self.DECAY * self.accepted + num_accepted
        self.rejected = self.DECAY * self.rejected + (num_accepted < num_proposed)

    def drift(self, rate: float, weight: float = 0.05) -> None:
        """A step without evidence: move a little towards ``rate`` (so a sequence that stopped
        proposing tries again after a while)."""
        self.accepted += weight * (self.PRIOR * rate - self.accepted)
        self.rejected += weight * (self.PRIOR * (1.0 - rate) - self.rejected)


class StepCost:
    """A step's time as ``fixed + per_token * tokens``, fitted online by exponentially weighted
    least squares over the steps seen, plus a weak prior (so one step shape alone still gives a
    fit). On a CPU the fixed part is reading the weights once; each token adds its arithmetic.
    """

    FORGET = 0.98
    #: the prior: 30 ms a step and 1 ms a token (a small model on a CPU), worth two steps
    PRIOR_FIXED_S, PRIOR_PER_TOKEN_S, PRIOR_WEIGHT = 0.03, 0.001, 1.0

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weight, n, t, n*n, n*t

    def observe(self, num_tokens: int, seconds: float) -> None:
        f = self.FORGET
        w, n, t, nn, nt = self._sums
        self._sums = [f * w + 1, f * n + num_tokens, f * t + seconds, f * nn + num_tokens ** 2,
                      f * nt + num_tokens * seconds]

    def fit(self) -> tuple[float, float]:
        """``(fixed seconds, seconds per token)``, both > 0."""
        w, n, t, nn, nt = self._sums
        for tokens in (1, 64):  # the prior: two weak observations on its line
            seconds = self.PRIOR_FIXED_S + self.PRIOR_PER_TOKEN_S * tokens
            pw = self.PRIOR_WEIGHT / 2
            w, n, t, nn, nt = w + pw, n + pw * tokens, t + pw * seconds, nn + pw * tokens ** 2, nt + pw * tokens * seconds
        variance = nn / w - (n / w) ** 2
        per_token = max((nt / w - (n / w) * (t / w)) / variance, 1e-7)
        return max(t / w - per_token * n / w, 1e-6), per_token


@dataclass
class _Stats:
    num_speculations: int = 0  # verifications of at least one draft token (per sequence and step)
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0


class SpeculativeDecoder:
    """Proposes drafts before a step and verifies them after it (see the module docstring).

    How many drafts a sequence proposes: draft ``j`` (accepted with probability ``rate ** j``) is
    worth its verification when it saves more time than it costs. A step of ``n`` tokens takes
    ``fixed + per_token * n`` (:class:`StepCost`) and yields one token per decoding sequence
    (``D`` of them), so an output token costs ``(fixed + per_token * n) / D``; a draft token costs
    ``per_token``. Draft ``j`` pays when ``rate ** j > per_token * D / (fixed + per_token * n)``: on a
    CPU with one sequence nearly any acceptance pays, with 32 decoding sequences only a high one
    does, so speculation switches itself off where it cannot help (``engine.speculative`` caps the
    count at ``num_speculative_tokens``; with ``adaptive: false`` every sequence proposes that many).

    Invariant: every sequence the scheduler gave drafts to is verified exactly once, in the same
    step; the counters only grow.
    """

    def __init__(self, config: SpeculativeConfig, propose: Callable[[list[Sequence], list[int]], list[list[int]]],
                 *, is_cheap: bool = False):
        """:param propose: ``(sequences, most drafts each) -> drafts each`` (the proposer).
        :param is_cheap: proposing costs next to nothing (n-gram lookup): sequences that do not
            speculate still propose one token, checked against the token they get, so their rate
            follows the text."""
        self.config = config
        self._propose = propose
        self._is_cheap = is_cheap
        self._trackers: dict[Sequence, AcceptanceTracker] = {}
        self._rate = AcceptanceTracker(0.5)  # every sequence's verifications: a new one's prior
        self.cost = StepCost()
        self._stats = _Stats()

    def propose(self, running: SequenceABC[Sequence], max_num_batched_tokens: int | None = None) -> None:
        """Set ``draft_token_ids`` of every running sequence that decodes next step (empty for
        those whose drafts would not pay)."""
        decoding, num_prefill_tokens = [], 0
        for seq in running:
            seq.draft_token_ids = []
            if seq.status is SequenceStatus.RUNNING:
                if seq.num_uncomputed_tokens == 1:
                    decoding.append(seq)
                else:
                    num_prefill_tokens += seq.num_uncomputed_tokens
        for seq in [s for s in self._trackers if s.is_finished or s.status is SequenceStatus.WAITING]:
            del self._trackers[seq]
        if not decoding:
            return
        num_tokens = len(decoding) + num_prefill_tokens
        if max_num_batched_tokens is not None:
            num_tokens = min(num_tokens, max_num_batched_tokens)
        fixed, per_token = self.cost.fit()
        threshold = per_token * len(decoding) / (fixed + per_token * num_tokens) if self.config.adaptive else 0.0
        seqs, limits, shadows = [], [], []
        for seq in decoding:
            tracker = self._trackers.get(seq)
            if tracker is None:
                tracker = self._trackers[seq] = AcceptanceTracker(self._rate.rate)
            self._check_shadow(seq, tracker)
            # NOTE: the target's own token follows the drafts, so max_tokens leaves one fewer
            room = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
            if room < 1 or not can_speculate(seq.params):
                continue
            limit = _num_paying_drafts(tracker.rate, threshold, room) if self.config.adaptive else room
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
            elif self._is_cheap:
                shadows.append(seq)
            else:
                tracker.drift(self._rate.rate)
        if seqs or shadows:
            proposals = self._propose(seqs + shadows, limits + [1] * len(shadows))
            for seq, drafts in zip(seqs, proposals):
                seq.draft_token_ids = drafts
            for seq, drafts in zip(shadows, proposals[len(seqs):]):
                if drafts:
                    self._trackers[seq].shadow = (seq.num_tokens, drafts[0])

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens (drafts included) took ``seconds``."""
        self.cost.observe(num_tokens, seconds)

    def verify(self, logits: torch.Tensor, draft_token_ids: SequenceABC[SequenceABC[int]],
               seqs: SequenceABC[Sequence], rows: SequenceABC[int],
               sample: Callable[[torch.Tensor, list[Sequence], list[int]], list[int]]) -> list:
        """The tokens each of ``seqs`` appends this step.

        The target's token at every verified position is sampled by the engine's own sampler, in
        one call for the whole step (each sequence's rows in position order, so a seeded one draws
        its uniforms in the order it would without drafts); a draft is accepted while it equals the
        target's token before it. Then each seeded generator is set to where it would be without
        drafts: one uniform drawn per token appended.

        NOTE: for a deterministic proposer this *is* standard rejection sampling (accept draft ``d``
        with probability ``min(1, p(d) / q(d)) = p(d)``, else sample from ``max(p - q, 0)``
        normalised, i.e. ``p`` without ``d``), and every token keeps the target's distribution ``p``;
        sampling the target's token first gives the same tokens a seeded request gets without
        speculation, however many drafts it verified.

        :param logits: the step's logits, ``1 + len(draft_token_ids[i])`` rows for chunk ``i``.
        :param draft_token_ids: per chunk of the step, the drafts it verified (empty: none).
        :param rows: per sequence, its chunk (``Scheduler.advance``'s rows).
        :param sample: the engine's sampler over ``(logits, sequences, logits rows)``.
        :returns: per sequence, an int (no drafts: the sampled token) or a list (the accepted
            drafts, then the target's token).
        """
        ends = np.cumsum([1 + len(d) for d in draft_token_ids]).tolist()
        sample_seqs, sample_rows, states = [], [], {}
        for seq, row in zip(seqs, rows):
            num_drafts = len(draft_token_ids[row])
            sample_seqs += [seq] * (1 + num_drafts)
            sample_rows += range(ends[row] - 1 - num_drafts, ends[row])
            if num_drafts and seq.generator is not None and not seq.params.is_greedy:
                states[seq] = seq.generator.get_state()
        sampled = sample(logits, sample_seqs, sample_rows)
        results: list = []
        at = 0
        for seq, row in zip(seqs, rows):
            drafts = draft_token_ids[row]
            targets, at = sampled[at:at + 1 + len(drafts)], at + 1 + len(drafts)
            if not drafts:
                results.append(targets[0])
                continue
            tokens = accept_greedy(drafts, targets)
            results.append(tokens)
            if seq in states:
                _replay_uniforms(seq.generator, states[seq], len(tokens))
            self._record(seq, len(drafts), len(tokens) - 1)
        return results

    def _record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        self._stats.num_speculations += 1
        self._stats.num_proposed_tokens += num_proposed
        self._stats.num_accepted_tokens += num_accepted
        self._rate.record(num_proposed, num_accepted)
        tracker = self._trackers.get(seq)
        if tracker is not None:
            tracker.record(num_proposed, num_accepted)

    def _check_shadow(self, seq: Sequence, tracker: AcceptanceTracker) -> None:
        """Score the one-token proposal ``seq`` made without verifying it, now that its next token is known."""
        if tracker.shadow is not None:
            num_tokens, token_id = tracker.shadow
            tracker.shadow = None
            if seq.num_tokens > num_tokens:
                tracker.record(1, int(seq.token_ids[num_tokens] == token_id))

    def stats(self) -> dict:
        s = self._stats
        return {
            "method": self.config.method,
            "num_speculations": s.num_speculations,
            "num_proposed_tokens": s.num_proposed_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.num_accepted_tokens / s.num_proposed_tokens if s.num_proposed_tokens else 0.0,
            # NOTE: vLLM's definition: tokens a verification emits, the target's own one included
            "mean_acceptance_length": (1 + s.num_accepted_tokens / s.num_speculations) if s.num_speculations else 0.0,
        }


def make_speculative_decoder(config: SpeculativeConfig, target: LoadedModel, *, target_name: str, num_blocks: int,
                             block_size: int, max_num_seqs: int, plugin_manager: Any = None) -> SpeculativeDecoder | None:
    """The engine's speculative decoder for ``engine.speculative`` (None while ``method`` is unset).

    A draft model named like the engine's ``model`` is the target itself (its weights are not
    loaded twice); any other is loaded with the target's dtype and device, and must share its
    tokenizer. Its pool has as many blocks as the target's and one more per sequence: it never
    holds more tokens than the target, plus each sequence's drafts.
    """
    if config.method is None:
        return None
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        return SpeculativeDecoder(config, lambda seqs, limits: [proposer.propose(s.token_ids, n)
                                                                for s, n in zip(seqs, limits)], is_cheap=True)
    from corekv.engine.draft_model import DraftModelProposer

    draft = target
    if config.model != target_name:
        draft = load_model(config.model, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device),
                           plugin_manager=plugin_manager)
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ConfigError(f"engine.speculative.model: {config.model!r} has another tokenizer than the model "
                              f"{target_name!r}; expected a draft model with the same tokenizer (e.g. a smaller "
                              "model of the same family)", path="engine.speculative.model")
    num_draft_blocks = num_blocks + max_num_seqs * -(-config.num_speculative_tokens // block_size)
    return SpeculativeDecoder(config, DraftModelProposer(draft, num_blocks=num_draft_blocks, block_size=block_size))


def _num_paying_drafts(rate: float, threshold: float, limit: int) -> int:
    """The most drafts ``j <= limit`` with ``rate ** j > threshold`` (see :class:`SpeculativeDecoder`)."""
    if rate <= threshold or rate <= 0.0:
        return 0
    if rate >= 1.0 or threshold <= 0.0:
        return limit
    return min(limit, math.ceil(math.log(threshold) / math.log(rate)) - 1 or 1)


#: engine.stats()["speculative"] while speculation is off
STATS_OFF = {"method": None, "num_speculations": 0, "num_proposed_tokens": 0, "num_accepted_tokens": 0,
             "acceptance_rate": 0.0, "mean_acceptance_length": 0.0}


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's tokens may come from verified drafts: not with logits processors
    (penalties, logit_bias, min_tokens: a draft position's logits would need the drafts before it as
    history) nor with log-probabilities (reported per sampled token by the engine's sampler)."""
    return not params.has_logits_processors and params.logprobs is None


def accept_greedy(draft_token_ids: SequenceABC[int], target_token_ids: SequenceABC[int]) -> list[int]:
    """The drafts up to the first the target's token disagrees with, then the target's token there
    (or, all accepted, its token after the last draft). ``len(target) == len(drafts) + 1``."""
    for i, draft in enumerate(draft_token_ids):
        if target_token_ids[i] != draft:
            return [*draft_token_ids[:i], target_token_ids[i]]
    return [*draft_token_ids, target_token_ids[len(draft_token_ids)]]


def _replay_uniforms(generator: torch.Generator, state: torch.Tensor, num_tokens: int) -> None:
    """Set ``generator`` to ``state`` advanced by ``num_tokens`` of the sampler's draws (one
    float64 uniform per sampled token, as :class:`corekv.engine.sampling.Sampler` draws them)."""
    generator.set_state(state)
    for _ in range(num_tokens):
        torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
