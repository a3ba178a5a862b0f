"""Requests as the engine's public methods receive them: prompt shapes, per-prompt arguments,
the checks that reject a request that could never run, and the output a finished one becomes."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corekv.errors import CoreKVError
from corekv.engine.outputs import CompletionOutput, RequestOutput
from corekv.engine.sampling import SamplingParams
from corekv.engine.sequence import Sequence
from corekv.config.values import describe_value

__all__ = ["Request", "RequestRejectedError", "as_prompt_list", "per_prompt", "check_request_fits",
           "check_logit_bias", "check_prompt_chars", "max_prompt_chars", "num_prompt_chars", "make_output"]

#: characters a normalizer may compose into one: NFC/NFKC join a base character and its marks
#: (Greek: up to 3 marks; Hangul: 3 jamo into one syllable) into one code point
MAX_COMPOSED_CHARS = 4


class RequestRejectedError(CoreKVError, ValueError):
    """A request can never be served by this engine (too long for the pool, the model or a step).

    :ivar field: the ``SamplingParams`` field the request cannot be served with, where one is to
        blame alone (``logit_bias`` outside the vocabulary); else ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class Request:
    """One request and its sequences (one, or ``n`` after the fork). ``is_internal`` requests
    (made by ``engine.warm``) fire no ``corekv_on_request_finished`` and are not returned."""

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    num_finished: int = 0
    is_internal: bool = False
    #: False: the request's blocks are never written to a storage tier (reads still hit them)
    offload: bool = True
    #: why the engine aborted it (its sampling failed); None while it runs or ended normally
    error: str | None = None


def _is_single_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, (list, tuple)) and value:
        return (all(isinstance(t, int) and not isinstance(t, bool) for t in value)
                or all(isinstance(m, Mapping) for m in value))
    return False


def as_prompt_list(prompts: Any) -> list[Any]:
    """``prompts`` as a list of single prompts: a str, token ids (list[int]) or chat messages
    (list of ``{"role", "content"}`` dicts) is one prompt; any other list holds prompts."""
    if _is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        for i, prompt in enumerate(prompts):
            if not _is_single_prompt(prompt):
                raise TypeError(
                    f"prompts[{i}] must be a non-empty str, list of token ids, or list of chat messages "
                    f"({{'role': ..., 'content': ...}} dicts), got {_short(prompt)}")
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of token ids, chat messages, or a list of those, "
                    f"got {_short(prompts)}")


def per_prompt(name: str, value: Any, num_prompts: int, kind: type | tuple[type, ...]) -> list[Any]:
    """One ``value`` per prompt: a single value (or None) applies to all; a list must match."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"{name} is a list of {len(value)} but there are {num_prompts} prompts; "
                             f"pass one value for all prompts, or one per prompt")
        return list(value)
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} got {_short(value)}; expected {kind}, None, or a list with one per prompt")
    return [value] * num_prompts


def check_request_fits(num_prompt_tokens: int, params: SamplingParams, *, num_blocks: int,
                       num_pinned_blocks: int, block_size: int, max_model_len: int | None,
                       max_num_batched_tokens: int, enable_chunked_prefill: bool,
                       max_num_seqs: int) -> None:
    """Raise :class:`RequestRejectedError` if the request could never finish in this engine."""
    num_tokens = num_prompt_tokens + params.max_tokens - 1  # the last sampled token needs no KV
    capacity = num_blocks - num_pinned_blocks
    needed = -(-num_tokens // block_size)
    if needed > capacity:
        blame = "max_tokens" if -(-params.max_tokens // block_size) > capacity else None
        raise RequestRejectedError(
            f"a request of {num_prompt_tokens} prompt tokens + max_tokens={params.max_tokens} needs "
            f"{needed} KV blocks of {block_size} tokens, but the pool has {capacity} usable "
            f"({num_blocks} minus {num_pinned_blocks} pinned); raise engine.num_blocks or "
            "engine.kv_cache_memory, or lower max_tokens or the prompt length", field=blame)
    if max_model_len is not None and num_tokens + 1 > max_model_len:
        raise RequestRejectedError(
            f"a request of {num_prompt_tokens} prompt tokens + max_tokens={params.max_tokens} exceeds "
            f"the model's context of {max_model_len} tokens; shorten the prompt or lower max_tokens",
            field="max_tokens" if params.max_tokens >= max_model_len else None)
    if not enable_chunked_prefill and num_prompt_tokens > max_num_batched_tokens:
        raise RequestRejectedError(
            f"a prompt of {num_prompt_tokens} tokens exceeds engine.max_num_batched_tokens="
            f"{max_num_batched_tokens} and chunked prefill is off; enable chunked prefill or raise "
            "max_num_batched_tokens")
    if params.n > max_num_seqs:
        raise RequestRejectedError(f"SamplingParams.n={params.n} exceeds engine.max_num_seqs="
                                   f"{max_num_seqs}; lower n or raise engine.max_num_seqs", field="n")


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Raise :class:`RequestRejectedError` if ``params.logit_bias`` names a token id outside the
    model's vocabulary ``[0, vocab_size)`` (it could not be added to the logits)."""
    bad = [token_id for token_id, _ in params.logit_bias if token_id >= vocab_size]
    if bad:
        raise RequestRejectedError(
            f"SamplingParams.logit_bias names token ids {bad[:5]} outside the model's vocabulary "
            f"[0, {vocab_size}); bias only token ids the model has", field="logit_bias")


def max_prompt_chars(max_tokens: int, tokenizer: Any) -> int | None:
    """The most characters a prompt of at most ``max_tokens`` tokens of ``tokenizer`` can have
    (None when the tokenizer's vocabulary cannot be read): longer prompts are refused without
    tokenizing them, which for a huge prompt costs far more than the refusal.

    NOTE: the bound is sound, not a guess: every character of a prompt lies in some token, and a
    token covers at most as many characters as its vocabulary entry has (byte-level BPE spells
    each byte as one character and a character is at least one byte; SentencePiece spells
    characters as themselves, its byte fallbacks cover less than one), times
    MAX_COMPOSED_CHARS for normalizers that compose characters. A tokenizer whose normalizer
    deletes characters (control-character cleanup) may see a prompt made mostly of those refused.
    """
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):  # NOTE: no vocabulary: no bound
        return None
    return max_tokens * longest * MAX_COMPOSED_CHARS


def num_prompt_chars(prompt: Any) -> int:
    """The characters of a prompt that tokenizing would read: a string's, or chat messages'
    contents (token ids: 0, they are not tokenized)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, (list, tuple)):
        return sum(len(m["content"]) for m in prompt
                   if isinstance(m, Mapping) and isinstance(m.get("content"), str))
    return 0


def check_prompt_chars(prompt: Any, max_chars: int | None) -> None:
    """Raise :class:`RequestRejectedError` if ``prompt`` has more than ``max_chars`` characters."""
    num_chars = num_prompt_chars(prompt)
    if max_chars is not None and num_chars > max_chars:
        raise RequestRejectedError(
            f"a prompt of {num_chars} characters cannot fit: its tokens would exceed the "
            f"model's context or the KV pool (no prompt over {max_chars} "
            "characters fits, whatever its text); shorten the prompt")


def make_output(request: Request) -> RequestOutput:
    """The :class:`RequestOutput` of a request whose sequences have all finished."""
    completions = []
    for seq in sorted(request.seqs, key=lambda s: s.index):
        seq.update_text(final=True)
        logprobs = None if request.params.logprobs is None else list(seq.output_logprobs)
        completions.append(CompletionOutput(seq.index, seq.text, list(seq.output_token_ids),
                                            seq.finish_reason, seq.tpot_s, logprobs))
    head = request.seqs[0]
    num_cached = head.num_cached_tokens or 0
    by_tier = dict(head.cached_tokens_by_tier) or {"device": num_cached}
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids), num_cached_tokens=num_cached,
        cached_tokens_by_tier=by_tier, ttft_s=head.ttft_s, outputs=completions,
        num_preemptions=sum(s.num_preemptions for s in request.seqs), error=request.error)


def _short(value: Any) -> str:
    return f"{type(value).__name__} {describe_value(value)}"
