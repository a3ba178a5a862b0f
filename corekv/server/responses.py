"""OpenAI's response bodies for completions and chat completions, whole or as SSE chunks.

:class:`ResponseWriter` knows one request's kind (``completion`` or ``chat``), id, model and
creation time, and renders each piece: the whole response, one streamed delta, the finish chunks,
the usage chunk, and the ``data: [DONE]`` line that ends a stream.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from corekv.engine.outputs import RequestOutput

__all__ = ["ResponseWriter", "usage", "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` is the engine's ``num_cached_tokens`` (prompt
    tokens whose KV was reused) and ``cached_tokens_by_tier`` (corekv's) says where it came from."""
    num_prompt = len(output.prompt_token_ids)
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens,
                                      "cached_tokens_by_tier": dict(output.cached_tokens_by_tier)}}


class ResponseWriter:
    """Renders one request's response. ``kind`` is ``"completion"`` or ``"chat"``."""

    def __init__(self, kind: str, model: str, n: int):
        if kind not in ("completion", "chat"):
            raise ValueError(f"ResponseWriter kind must be 'completion' or 'chat', got {kind!r}")
        self.kind, self.model, self.n = kind, model, n
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def full(self, output: RequestOutput) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        if self.kind == "chat":
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": None, "finish_reason": c.finish_reason} for c in output.outputs]
        else:
            choices = [{"index": c.index, "text": c.text, "logprobs": None,
                        "finish_reason": c.finish_reason} for c in output.outputs]
        return {**self._head(""), "choices": choices, "usage": usage(output)}

    def opening(self) -> list[str]:
        """Chunks before any text: chat announces the assistant role per choice."""
        if self.kind != "chat":
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(self.n)]

    def delta(self, index: int, text: str) -> str:
        return self._chunk(index, {"content": text} if self.kind == "chat" else text, None)

    def closing(self, output: RequestOutput, include_usage: bool) -> list[str]:
        """One finish chunk per choice, the usage chunk when asked for, then ``[DONE]``."""
        chunks = [self._chunk(c.index, {} if self.kind == "chat" else "", c.finish_reason)
                  for c in output.outputs]
        if include_usage:
            chunks.append(sse({**self._head(".chunk"), "choices": [], "usage": usage(output)}))
        return [*chunks, SSE_DONE]

    def _head(self, suffix: str) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        # NOTE: OpenAI's completion chunks keep object "text_completion"; chat's gain ".chunk".
        return {"id": self.id, "object": obj + (suffix if self.kind == "chat" else ""),
                "created": self.created, "model": self.model}

    def _chunk(self, index: int, delta: Any, finish_reason: str | None) -> str:
        choice = ({"index": index, "delta": delta} if self.kind == "chat"
                  else {"index": index, "text": delta})
        choice.update(logprobs=None, finish_reason=finish_reason)
        return sse({**self._head(".chunk"), "choices": [choice]})
