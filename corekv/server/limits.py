"""How big a request may be, checked before the work its size would cost: the body's bytes
(:class:`BodyLimit`, 413 before the body is read whole) and the prompt's characters
(``Engine.max_prompt_chars``, refused before the prompt is tokenized).

Both ``corekv serve`` and ``corekv route`` put :class:`BodyLimit` in front of their app. It is
plain ASGI, so it works with every Starlette the server supports and rejects a declared length
before any route runs.
"""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from corekv.server.protocol import APIError

__all__ = ["BodyLimit", "DEFAULT_MAX_REQUEST_BYTES", "check_max_request_bytes"]

#: the default body limit: room for a long context as text or as token ids, and far below what
#: would strain the server's memory
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 (OpenAI's error body).

    A declared ``Content-Length`` over the limit is refused before a byte of the body is read
    (the HTTP server then discards the rest as it arrives). A body without one (chunked) is read
    here up to the limit, refused as soon as it passes it, else handed on to the app as it came.
    """

    def __init__(self, app: Any, max_bytes: int):
        check_max_request_bytes(max_bytes)
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" not in headers:
            # NOTE: the HTTP server delivers exactly Content-Length bytes (a malformed value is
            # its 400), so a declared length within the limit needs no counting.
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(scope, receive, send, f"the request body is {int(length)} bytes, over")
                return
            await self.app(scope, receive, send)
            return
        messages, num_bytes = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app learns it from the replayed message
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await self._refuse(scope, receive, send, "the request body is longer than")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any, what: str) -> None:
        error = APIError(f"{what} this server's limit of {self.max_bytes} bytes "
                         "(--max-request-bytes); send a shorter request",
                         status=413, code="request_too_large")
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def check_max_request_bytes(value: Any, name: str = "max_request_bytes") -> int:
    """``value`` if it is a body limit (an integer >= 1), else ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer number of bytes >= 1, got {value!r}; pass e.g. "
                         f"{DEFAULT_MAX_REQUEST_BYTES} (4 MiB, the default)")
    return value
