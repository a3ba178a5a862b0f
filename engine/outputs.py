"""What a finished request hands back: its completions, its timing, and where its prefix came from.

A request asks for ``SamplingParams.n`` completions of one prompt. :class:`RequestOutput` always
carries all of them in ``outputs`` (``len(outputs) == n``, ordered by ``index``); for the common
``n == 1`` case its top-level ``text``, ``token_ids``, ``finish_reason`` and ``tpot_s`` are those
of ``outputs[0]``, so ``out.text`` just works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CompletionOutput", "RequestOutput", "TokenLogprobs", "FINISH_REASONS"]

#: ``stop``: an EOS token, a stop token id or a stop string; ``length``: ``max_tokens`` reached;
#: ``abort``: the engine gave the request up (aborted by the caller, or it could no longer fit).
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities of one generated token (``SamplingParams.logprobs``).

    They are of the model's raw distribution, ``log_softmax`` of its logits before logit_bias,
    min_tokens, penalties, temperature and the filters (vLLM's default): what the model thinks,
    whatever picked the token.

    :param token_id: the generated token.
    :param logprob: its log-probability.
    :param top: the ``SamplingParams.logprobs`` most likely ``(token_id, logprob)`` pairs, most
        likely first; it may or may not contain ``token_id``.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt.

    :param index: the completion's number, ``0 .. n - 1`` (completion ``i`` of a seeded request
        samples with ``seed + i``).
    :param text: the generated text (a stop string is cut off unless
        ``SamplingParams.include_stop_str_in_output``).
    :param token_ids: the generated token ids, including an EOS or stop token that ended it.
    :param finish_reason: one of :data:`FINISH_REASONS`.
    :param tpot_s: mean seconds per output token after the first (``None`` with one token).
    :param logprobs: with ``SamplingParams.logprobs``, one :class:`TokenLogprobs` per token of
        ``token_ids``, in order; ``None`` when not asked for.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    tpot_s: float | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The final result of one request (``engine.generate`` returns one per prompt, in order).

    Invariants: ``outputs`` is non-empty and ordered by index; ``num_cached_tokens`` equals
    ``sum(cached_tokens_by_tier.values())`` and is a whole number of blocks smaller than
    ``len(prompt_token_ids)`` (the last prompt token is always computed).

    :param request_id: the id ``engine.add_request`` returned (or the caller chose).
    :param prompt: the prompt as given: a string, token ids, or chat messages.
    :param prompt_token_ids: the prompt after tokenization (and chat templating).
    :param num_cached_tokens: prompt tokens whose KV was reused, not computed, at admission.
    :param cached_tokens_by_tier: where the reused tokens came from: ``{"device": n}`` for the
        device pool; storage tiers add their own names.
    :param ttft_s: seconds from arrival to the first output token.
    :param outputs: every completion (``n`` of them).
    :param num_preemptions: how many times the request was preempted and recomputed.
    :param error: why the engine ended this request (``finish_reason="abort"``) when sampling its
        next token failed; None otherwise. The other requests of that step went on.
    """

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    ttft_s: float | None
    outputs: list[CompletionOutput]
    num_preemptions: int = 0
    error: str | None = None

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first completion's generated token ids."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        """The first completion's finish reason (``stop``, ``length`` or ``abort``)."""
        return self.outputs[0].finish_reason

    @property
    def tpot_s(self) -> float | None:
        """The first completion's mean seconds per output token after the first."""
        return self.outputs[0].tpot_s
