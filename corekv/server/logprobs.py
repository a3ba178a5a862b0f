"""Log-probabilities in OpenAI's two shapes, from the engine's :class:`TokenLogprobs`.

Chat (``logprobs: true, top_logprobs: k``)::

    choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                          "logprob", "bytes"}, ... k]}, ...], "refusal": null}

Completions (``logprobs: k``), the legacy shape::

    choices[i].logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token:
                          logprob, ...}, ...], "text_offset": [...]}

where each ``top_logprobs`` entry holds the ``k`` most likely tokens and the sampled one (so up to
``k + 1``, as OpenAI and vLLM answer; tokens that decode to the same text share one key, holding
the likelier one's logprob). The values are the engine's: the model's raw distribution,
before penalties and temperature (see :mod:`corekv.engine.logprobs`).

A token's ``token`` is its own decoded text (a token that holds only part of a character shows
U+FFFD); its ``bytes`` are the token's exact bytes where the tokenizer says them (byte-level BPE,
SentencePiece byte fallback), so the bytes of consecutive tokens join into the text.
``text_offset`` is where each token starts in the choice's text, in characters, counted over the
tokens' bytes decoded in sequence (a special token the text skips adds none).
"""
from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Sequence
from typing import Any

from corekv.engine.outputs import TokenLogprobs

__all__ = ["TokenTexts", "chat_logprobs", "CompletionLogprobs"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """A tokenizer's token ids as OpenAI's logprobs show them: text and bytes, cached per id.

    Only reads the tokenizer (decoding does not change it), so any thread may use it.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._byte_of_char = _byte_level_alphabet(tokenizer)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        # NOTE: a vocabulary is static, and a response asks for the same few thousand ids again
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_of_char is not None and all(c in self._byte_of_char for c in piece):
                return bytes(self._byte_of_char[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
        return self.text(token_id).encode("utf-8")


def chat_logprobs(logprobs: Sequence[TokenLogprobs], tokens: TokenTexts) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat response (or of one streamed chunk's tokens)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": logprob,
                "bytes": list(tokens.bytes(token_id))}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in logprobs],
            "refusal": None}


class CompletionLogprobs:
    """``choices[i].logprobs`` of one completions choice, rendered as its tokens arrive: it keeps
    the running ``text_offset``, so a stream's chunks continue where the last one ended."""

    def __init__(self, tokens: TokenTexts, *, skip_special_tokens: bool = True, text_offset: int = 0):
        self._tokens, self._skip_special = tokens, skip_special_tokens
        self._offset = text_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def render(self, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The legacy shape for ``logprobs`` (the next tokens of this choice)."""
        tokens = self._tokens
        offsets = []
        for t in logprobs:
            offsets.append(self._offset)
            if not (self._skip_special and t.token_id in tokens.special_ids):
                self._offset += len(self._decoder.decode(tokens.bytes(t.token_id)))
        top = []
        for t in logprobs:
            # NOTE: tokens with the same text share a key (the shape's own limit): the likelier wins
            best: dict[str, float] = {}
            for token_id, logprob in (*t.top, (t.token_id, t.logprob)):
                best.setdefault(tokens.text(token_id), logprob)
            top.append(best)
        return {"tokens": [tokens.text(t.token_id) for t in logprobs],
                "token_logprobs": [t.logprob for t in logprobs], "top_logprobs": top,
                "text_offset": offsets}


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int] | None:
    """For a byte-level BPE tokenizer (GPT-2's scheme: every byte spelled as one printable
    character), the character of each byte back to the byte; None for other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel" and getattr(tokenizer, "byte_decoder", None) is None:
        return None
    # NOTE: GPT-2's bytes_to_unicode: printable bytes are themselves, the others 256 + n in order
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars
