"""Incremental detokenization (token ids to text deltas) and stop-string search over the new tail.

Decoding the whole sequence after every token costs O(length) per token. Instead the detokenizer
decodes a small window: the tokens from ``prefix_offset`` (a little context already emitted) to the
end, and emits what that window's text has beyond the text of its context part. Byte-level BPE
tokenizers split one character across tokens (an emoji is often three or four byte tokens); while
the window's text ends with the replacement character "\ufffd" its last character is incomplete:
the characters before it are streamed, and the tokens stay pending until a later token completes it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corekv.config.values import describe_value

__all__ = ["IncrementalDetokenizer", "find_stop"]

_REPLACEMENT_CHAR = "\ufffd"
# NOTE: a few prompt tokens of context let tokenizers that drop a word's leading space at the start
# of a decode (SentencePiece) decode the first generated token as it reads inside the sentence.
_NUM_CONTEXT_TOKENS = 5
# NOTE: in a run of emoji, byte tokens can straddle every character boundary, so the window may
# legitimately stay incomplete for many tokens (its complete part is still streamed). Only a model
# emitting invalid bytes keeps it incomplete for ever; past this many pending tokens they are
# retired (emitted as "\ufffd") so the window, and the work per token, stays bounded.
_MAX_PENDING_TOKENS = 64


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, one ``add`` at a time.

    Invariants: ``token_ids`` holds the generated ids only (not the prompt); over the kept ids
    (a few prompt tokens of context, then the generated ones), ``prefix_offset <= read_offset <=
    len(ids)``; the text of every id before ``read_offset`` has been emitted, the ids after it are
    pending (the first ``num_pending_chars_emitted`` characters of their text, which end before an
    incomplete character, have been emitted too), and ``ids[prefix_offset:read_offset]`` is
    decoded again only as context;
    ``text`` is the concatenation of every delta returned.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"IncrementalDetokenizer: tokenizer must have a decode() method (a "
                            f"transformers tokenizer), got {type(tokenizer).__name__}; pass the "
                            f"model's tokenizer")
        _check_ids("prompt_token_ids", prompt_token_ids)
        if not isinstance(skip_special_tokens, bool):
            raise TypeError(f"IncrementalDetokenizer: skip_special_tokens must be a bool, got "
                            f"{skip_special_tokens!r}; pass True or False")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # NOTE: only the context tail of the prompt is kept: the window never reaches further back.
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._num_context = len(context)
        self._ids = context  # the context, then the generated ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_pending_chars_emitted = 0  # already streamed part of the pending ids' text
        self._pieces: list[str] = []
        self._text_cache = ""

    @property
    def text(self) -> str:
        """All text emitted so far (the generated part only)."""
        if self._pieces:
            self._text_cache += "".join(self._pieces)
            self._pieces.clear()
        return self._text_cache

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids added so far."""
        return self._ids[self._num_context:]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ``token_ids``; returns the newly completed text ("" while held back)."""
        _check_ids("token_ids", token_ids)
        self._ids.extend(token_ids)
        pending_text = self._pending_text()
        is_overlong = len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS
        if pending_text.endswith(_REPLACEMENT_CHAR) and not is_overlong:
            # NOTE: the tokens ending in an incomplete character stay pending (decoded again next
            # time, so the bytes can join up), but the characters before it are final: stream them.
            complete = pending_text.rstrip(_REPLACEMENT_CHAR)
            delta = complete[self._num_pending_chars_emitted:]
            self._num_pending_chars_emitted += len(delta)
        else:
            # NOTE: tokens with no text at all (skipped special tokens) are retired too, so a run of
            # them becomes context one add at a time instead of widening the window.
            delta = pending_text[self._num_pending_chars_emitted:]
            self._retire_pending()
        if delta:
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the sequence, emit any held-back text (an incomplete character as "\ufffd")."""
        if self._read_offset == len(self._ids):
            return ""
        delta = self._pending_text()[self._num_pending_chars_emitted:]
        self._retire_pending()
        if delta:
            self._pieces.append(delta)
        return delta

    def _pending_text(self) -> str:
        """The text the pending ids add to their context (decoding only the window)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._decode(self._prefix_offset, len(self._ids))[len(prefix_text):]

    def _retire_pending(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._num_pending_chars_emitted = 0

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end],
                                      skip_special_tokens=self._skip_special_tokens)


def find_stop(text: str, stops: Sequence[str], new_text_len: int,
              include_stop: bool = False) -> int | None:
    """Where to cut ``text`` because a stop string appeared in its newest part; None if none did.

    Only the tail that could contain a new match is searched: the last ``new_text_len`` characters
    plus ``len(stop) - 1`` before them (a stop spanning the previous and the new delta). When several
    stops match, the one that completes first wins (as if the text had streamed in character by
    character); of stops completing together, the longest. Returns the index where that stop starts, or where it ends if ``include_stop``.
    """
    if not isinstance(text, str):
        raise TypeError(f"find_stop: text must be a str, got {type(text).__name__}; pass the "
                        f"sequence's detokenized text")
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise TypeError(f"find_stop: stops must be a sequence of non-empty strings, got {stops!r}; "
                        f"pass SamplingParams.stop")
    if not isinstance(new_text_len, int) or not 0 <= new_text_len <= len(text):
        raise ValueError(f"find_stop: new_text_len must be an integer in [0, len(text)={len(text)}], "
                         f"got {new_text_len!r}; pass the length of the delta just appended")
    if not stops or new_text_len == 0:
        return None
    best: tuple[int, int] | None = None  # (end, start) of the stop that completes first
    for stop in stops:
        search_from = max(0, len(text) - new_text_len - len(stop) + 1)
        start = text.find(stop, search_from)
        if start >= 0:
            candidate = (start + len(stop), start)
            best = candidate if best is None else min(best, candidate)
    if best is None:
        return None
    end, start = best
    return end if include_stop else start


def _check_ids(name: str, ids: Any) -> None:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TypeError(f"IncrementalDetokenizer: {name} must be a sequence of token ids (integers "
                        f">= 0), got {describe_value(ids, 120)}; pass a list[int]")
