"""OpenAI's response bodies for completions and chat completions, whole or as SSE chunks.

:class:`ResponseWriter` knows one request's kind (``completion`` or ``chat``), id, model and
creation time, and renders each piece: the whole response, one streamed delta (with its tokens'
logprobs, :mod:`corekv.server.logprobs`), a choice's finish chunk, the usage chunk, and the
``data: [DONE]`` line that ends a stream.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from corekv.engine.outputs import RequestOutput, TokenLogprobs
from corekv.server.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs

__all__ = ["ResponseWriter", "usage", "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage object over a request's outputs (a completions batch has one per prompt);
    ``cached_tokens`` is the engine's ``num_cached_tokens`` (prompt tokens whose KV was reused)
    and ``cached_tokens_by_tier`` (corekv's) says where it came from."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    by_tier: dict[str, int] = {}
    for output in outputs:
        for tier, count in output.cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + count
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs),
                                      "cached_tokens_by_tier": by_tier}}


class ResponseWriter:
    """Renders one request's response. ``kind`` is ``"completion"`` or ``"chat"``.

    Choice ``i * n + j`` is completion ``j`` of prompt ``i`` (chat has one prompt). With
    ``tokens`` (a :class:`TokenTexts`, needed when the request asked for logprobs) choices carry
    their logprobs in the kind's shape; a completions choice keeps its running ``text_offset``
    across streamed chunks.
    """

    def __init__(self, kind: str, model: str, n: int, *, tokens: TokenTexts | None = None,
                 skip_special_tokens: bool = True):
        if kind not in ("completion", "chat"):
            raise ValueError(f"ResponseWriter kind must be 'completion' or 'chat', got {kind!r}")
        self.kind, self.model, self.n = kind, model, n
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._tokens, self._skip_special = tokens, skip_special_tokens
        self._completion_logprobs: dict[int, CompletionLogprobs] = {}

    def full(self, outputs: Sequence[RequestOutput], echoes: Sequence[str] | None = None
             ) -> dict[str, Any]:
        """The whole (non-streamed) response; ``echoes``: each prompt's text, to prepend."""
        choices = []
        for i, output in enumerate(outputs):
            for c in output.outputs:
                index = i * self.n + c.index
                logprobs = self._logprobs(index, c.logprobs)
                if self.kind == "chat":
                    choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": logprobs, "finish_reason": c.finish_reason})
                else:
                    text = c.text if echoes is None else echoes[i] + c.text
                    choices.append({"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": c.finish_reason})
        return {**self._head(""), "choices": choices, "usage": usage(outputs)}

    def opening(self) -> list[str]:
        """Chunks before any text: chat announces the assistant role per choice."""
        if self.kind != "chat":
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(self.n)]

    def delta(self, index: int, text: str, logprobs: Sequence[TokenLogprobs] | None = None) -> str:
        """A chunk of choice ``index``: new text, and the new tokens' logprobs when asked for."""
        return self._chunk(index, {"content": text} if self.kind == "chat" else text, None,
                           self._logprobs(index, logprobs))

    def finish(self, index: int, finish_reason: str) -> str:
        """The chunk that ends choice ``index``."""
        return self._chunk(index, {} if self.kind == "chat" else "", finish_reason)

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> str:
        """The last chunk before ``[DONE]`` with ``stream_options.include_usage``: no choices."""
        return sse({**self._head(".chunk"), "choices": [], "usage": usage(outputs)})

    def _logprobs(self, index: int, logprobs: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        if logprobs is None or self._tokens is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(logprobs, self._tokens)
        renderer = self._completion_logprobs.get(index)
        if renderer is None:
            renderer = self._completion_logprobs[index] = CompletionLogprobs(
                self._tokens, skip_special_tokens=self._skip_special)
        return renderer.render(logprobs)

    def _head(self, suffix: str) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        # NOTE: OpenAI's completion chunks keep object "text_completion"; chat's gain ".chunk".
        return {"id": self.id, "object": obj + (suffix if self.kind == "chat" else ""),
                "created": self.created, "model": self.model}

    def _chunk(self, index: int, delta: Any, finish_reason: str | None,
               logprobs: dict[str, Any] | None = None) -> str:
        choice = ({"index": index, "delta": delta} if self.kind == "chat"
                  else {"index": index, "text": delta})
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return sse({**self._head(".chunk"), "choices": [choice]})
