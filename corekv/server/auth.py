"""API keys: with one set, ``corekv serve`` and ``corekv route`` answer 401 to any request that
does not carry ``Authorization: Bearer <key>``, the header vLLM's ``--api-key`` checks and the
``openai`` client sends for its ``api_key``.

:class:`APIKeyGuard` is ASGI middleware in front of the whole app, so every route is protected,
one added later included, except the ``open_paths`` (``/health``: load balancers and the router's
health checks probe it without credentials, and it tells only whether the server is up).
"""
from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

from corekv.server.protocol import APIError

__all__ = ["APIKeyGuard", "OPEN_PATHS", "bearer_headers", "check_api_key"]

OPEN_PATHS = frozenset({"/health"})


class APIKeyGuard:
    """ASGI middleware: a request to a path outside ``open_paths`` needs the key, else 401.

    The key is compared with :func:`hmac.compare_digest`, so the time an answer takes does not
    tell how much of a guessed key was right; the scheme word ``Bearer`` is case-insensitive
    (RFC 7235). A refusal never quotes what the client sent.
    """

    def __init__(self, app: Any, api_key: str, *, open_paths: frozenset[str] = OPEN_PATHS):
        self.app, self.open_paths = app, open_paths
        self._key = check_api_key(api_key).encode("ascii")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        credentials = dict(scope["headers"]).get(b"authorization")
        if credentials is None:
            message = ("no API key: this server needs the header 'Authorization: Bearer <key>' "
                       "(the openai client sends its api_key so)")
        else:
            scheme, _, token = credentials.strip().partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                await self.app(scope, receive, send)
                return
            message = ("the API key is not this server's: send 'Authorization: Bearer <key>' with "
                       "the key it was started with (--api-key or $COREKV_API_KEY)")
        error = APIError(message, status=401, code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def check_api_key(key: Any, name: str = "api_key") -> str:
    """``key`` if it can be an API key (visible ASCII, no spaces: it travels in an HTTP header),
    else ValueError naming ``name``; the error never quotes the key."""
    if not isinstance(key, str) or not key:
        kind = "an empty string" if key == "" else type(key).__name__
        raise ValueError(f"{name}: got {kind}; expected a non-empty key, e.g. one made with "
                         "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"{name}: the key has the character {bad!r}; a key travels in an HTTP "
                         "header, so use visible ASCII characters without spaces (e.g. "
                         "secrets.token_urlsafe(32))")
    return key


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The headers that present ``api_key`` to a server that checks it (none without a key)."""
    return {} if api_key is None else {"Authorization": f"Bearer {check_api_key(api_key)}"}
