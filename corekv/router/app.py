"""The router's HTTP side: an ASGI app that forwards OpenAI requests to the chosen worker.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are tokenized as the engine does
(:func:`corekv.engine.prompts.encode_prompt`), routed by the policy, and forwarded byte for byte;
an SSE stream is relayed as it comes. ``GET /v1/models`` goes to any healthy worker. ``GET /health``
is 200 while any worker is healthy; ``GET /workers`` shows each worker's state.

Retries: a request whose worker cannot be reached, drops the connection, or answers 502/503/504
*before the router sent the client a byte* goes to another worker (``max_retries`` times; when all
fail, the last 502/503/504 is returned, else a 502 of the router's own). A non-streamed answer is
read whole first, a stream up to its first token; so a worker that dies loses no request whose
stream has not yet reached the client. Other answers (a worker's 4xx included) pass unchanged.

Guards, as in ``corekv serve``: with an ``api_key`` every path but ``/health`` needs
``Authorization: Bearer <api_key>`` (401), and a body over ``max_request_bytes`` is a 413, both
before the body is read. The client's ``Authorization`` is the router's and is never forwarded;
workers get the pool's own (``WorkerPool(worker_api_key=...)``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from corekv.router.policy import CacheAwarePolicy, RoundRobinPolicy
from corekv.router.health import WorkerPool
from corekv.router.workers import Worker
from corekv.server.auth import OPEN_PATHS, APIKeyGuard, check_api_key
from corekv.engine.requests import num_prompt_chars
from corekv.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, check_max_request_bytes
from corekv.server.protocol import APIError, parse_json

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
# NOTE: hop-by-hop headers, and those httpx/Starlette recompute for the body they actually send
_DROPPED_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding",
                              "content-length", "content-encoding", "accept-encoding", "upgrade",
                              "proxy-connection", "te", "trailer"})
# NOTE: the client's credentials are for the router; a worker gets the pool's worker key instead
_CLIENT_ONLY_HEADERS = frozenset({"authorization"})


def build_app(pool: WorkerPool, policy: CacheAwarePolicy | RoundRobinPolicy, tokenizer: Any, *,
              max_retries: int = 2, request_timeout_s: float = 600.0, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, admin_key: str | None = None
              ) -> Starlette:
    """The router app; its lifespan starts the health checks and the forwarding client.

    :param api_key: when set, clients need ``Authorization: Bearer <api_key>`` on every path but
        ``/health``.
    :param max_request_bytes: larger request bodies are answered 413 before they are read.
    :param admin_key: when set, ``GET /workers`` (each worker's traffic and cache view) needs
        ``Authorization: Bearer <admin_key>`` instead of ``api_key``: clients' keys do not show
        how much the other clients send.
    """
    middleware = [Middleware(BodyLimit, max_bytes=check_max_request_bytes(max_request_bytes))]
    if api_key is not None:  # NOTE: outermost: a client without the key is refused first
        open_paths = OPEN_PATHS | ({"/workers"} if admin_key is not None else set())
        middleware.insert(0, Middleware(APIKeyGuard, api_key=check_api_key(api_key),
                                        open_paths=frozenset(open_paths)))
    router = _Router(pool, policy, tokenizer, max_retries, request_timeout_s,
                     None if admin_key is None else check_api_key(admin_key, "admin_key"))

    @asynccontextmanager
    async def lifespan(app):
        router.client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        await pool.start()
        try:
            yield
        finally:
            await pool.close()
            await router.client.aclose()

    routes = [Route("/v1/completions", router.completions, methods=["POST"]),
              Route("/v1/chat/completions", router.chat, methods=["POST"]),
              Route("/v1/models", router.models, methods=["GET"]),
              Route("/health", router.health, methods=["GET"]),
              Route("/workers", router.workers, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.router = router
    return app


class _Router:
    def __init__(self, pool, policy, tokenizer, max_retries: int, request_timeout_s: float,
                 admin_key: str | None = None):
        self.pool, self.policy, self.tokenizer = pool, policy, tokenizer
        self.admin_key = admin_key
        self.max_retries, self.request_timeout_s = max_retries, request_timeout_s
        self.client: httpx.AsyncClient | None = None

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def models(self, request: Request) -> Response:
        return await self._forward(request, "GET", "/v1/models", b"", [], None, stream=False)

    async def health(self, request: Request) -> Response:
        num_healthy = len(self.pool.healthy_workers())
        body = {"status": "ok" if num_healthy else "unavailable", "healthy_workers": num_healthy,
                "workers": len(self.pool.workers)}
        return JSONResponse(body, status_code=200 if num_healthy else 503)

    async def workers(self, request: Request) -> Response:
        if self.admin_key is not None and not _has_key(request, self.admin_key):
            error = APIError("GET /workers needs the router's admin key: send 'Authorization: Bearer "
                             "<admin key>' (--admin-key)", status=401, code="invalid_api_key")
            return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return JSONResponse({"policy": self.policy.name,
                             "workers": [w.state() for w in self.pool.workers]})

    # -- forwarding --------------------------------------------------------------------------------
    async def _generate(self, request: Request, path: str, *, chat: bool) -> Response:
        body = await request.body()
        bounds = [(w.info or {}).get("max_prompt_chars") for w in self.pool.workers]
        bounds = [b for b in bounds if isinstance(b, int) and not isinstance(b, bool)]
        # NOTE: parsing and tokenizing a long body takes a while: not on the event loop
        payload, token_ids, salt = await asyncio.to_thread(
            self._route_key, body, chat, max(bounds) if bounds else None)
        stream = isinstance(payload, dict) and payload.get("stream") is True
        return await self._forward(request, "POST", path, body, token_ids, salt, stream=stream)

    def _route_key(self, body: bytes, chat: bool, max_prompt_chars: int | None
                   ) -> tuple[Any, list[int], Hashable]:
        """The body's JSON (None if invalid: the worker answers the 400, in its own words), and
        the prompt's token ids and salt to route it by."""
        try:
            payload = parse_json(body)
        except APIError:
            return None, [], None
        token_ids, salt = prompt_token_ids(self.tokenizer, payload, chat=chat,
                                           max_prompt_chars=max_prompt_chars)
        return payload, token_ids, salt

    async def _forward(self, request: Request, method: str, path: str, body: bytes,
                       token_ids: list[int], salt: Hashable, *, stream: bool) -> Response:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in _DROPPED_HEADERS and k.lower() not in _CLIENT_ONLY_HEADERS}
        headers.update(self.pool.worker_headers)
        tried: set[int] = set()
        failures: list[str] = []
        busy_answer: Response | None = None  # the last 502/503/504, returned if no worker does better
        for _ in range(self.max_retries + 1):
            worker = self._pick(tried, token_ids, salt)
            if worker is None:
                break
            tried.add(worker.index)
            ticket = worker.begin(token_ids, salt)
            upstream: httpx.Response | None = None
            try:
                try:
                    upstream = await self.client.send(
                        self.client.build_request(method, worker.url + path, content=body,
                                                  headers=headers), stream=True)
                except httpx.HTTPError as e:
                    self._failed(worker, ticket, failures, e)
                    continue
                out_headers = {k: v for k, v in upstream.headers.items()
                               if k.lower() not in _DROPPED_HEADERS}
                if upstream.status_code in RETRY_STATUSES:
                    try:
                        busy_answer = Response(await upstream.aread(), status_code=upstream.status_code,
                                               headers=out_headers)
                    except httpx.HTTPError:
                        pass
                    await upstream.aclose()
                    worker.finish(ticket)
                    failures.append(f"{worker.url}: HTTP {upstream.status_code}")
                    continue
                chunks = upstream.aiter_bytes()
                try:
                    # NOTE: read the whole body, or a stream up to its first token, before answering:
                    # until the client has a byte, a dead worker can still be replaced.
                    first = (await upstream.aread()) if not stream else await _opening(chunks)
                except httpx.HTTPError as e:
                    await upstream.aclose()
                    self._failed(worker, ticket, failures, e)
                    continue
                if not stream:
                    await upstream.aclose()
                    worker.finish(ticket)
                    return Response(first, status_code=upstream.status_code, headers=out_headers)
                return StreamingResponse(
                    _relay(first, chunks, upstream, worker, ticket), status_code=upstream.status_code,
                    headers=out_headers, background=BackgroundTask(_close, upstream, worker, ticket))
            except BaseException:
                # NOTE: cancelled (the client left, the router stops) or an unexpected error:
                # the ticket and the connection must not leak, or the worker's load stays raised.
                if upstream is not None:
                    with contextlib.suppress(Exception):
                        await upstream.aclose()
                worker.finish(ticket)
                raise
        return busy_answer or self._unavailable(failures)

    def _pick(self, tried: set[int], token_ids: list[int], salt: Hashable) -> Worker | None:
        candidates = [w for w in self.pool.healthy_workers() if w.index not in tried]
        if not candidates:
            # NOTE: every healthy worker failed (or none is known healthy yet): try the others
            # rather than fail, a worker marked down by one lost connection may be fine again.
            candidates = [w for w in self.pool.workers if w.index not in tried]
        if not candidates:
            return None
        return self.policy.choose(candidates, token_ids, salt).worker

    def _failed(self, worker: Worker, ticket: int, failures: list[str], error: Exception) -> None:
        worker.finish(ticket)
        worker.num_failures += 1
        worker.mark_down(f"{type(error).__name__}: {error}")
        failures.append(f"{worker.url}: {type(error).__name__}")

    def _unavailable(self, failures: list[str]) -> Response:
        if failures:
            message = (f"no worker answered after {len(failures)} attempts "
                       f"({'; '.join(failures)}); retry later or check the workers (GET /workers)")
            status = 502
        else:
            message = "no worker is available; check the workers (GET /workers)"
            status = 503
        return JSONResponse({"error": {"message": message, "type": "router_error", "param": None,
                                       "code": status}}, status_code=status)


async def _opening(chunks: AsyncIterator[bytes]) -> bytes:
    """A stream's bytes up to and including its first event that is more than an opening (chat's
    role announcement, sent before the prompt is even computed), or all of it if shorter."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *events, _ = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        if any(not _is_opening_event(event) for event in events):
            break
    return buffer


def _is_opening_event(event: bytes) -> bool:
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        choices = json.loads(data)["choices"]
        return bool(choices) and all(c["delta"].get("content") == "" and c.get("finish_reason") is None
                                     and set(c["delta"]) <= {"role", "content"} for c in choices)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


async def _relay(first: bytes, chunks: AsyncIterator[bytes], upstream: httpx.Response,
                 worker: Worker, ticket: int) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as e:
        # NOTE: the client already has part of the stream; another worker cannot continue it.
        logger.warning("worker %s broke a stream mid-way (%s)", worker.url, e)
        worker.num_failures += 1
    finally:
        # NOTE: also in the background task: Starlette skips that when the client disconnects,
        # and this finally may not run when the client disconnects; finish() is idempotent.
        await _close(upstream, worker, ticket)


async def _close(upstream: httpx.Response, worker: Worker, ticket: int) -> None:
    await upstream.aclose()
    worker.finish(ticket)


def prompt_token_ids(tokenizer: Any, payload: Any, *, chat: bool,
                     max_prompt_chars: int | None = None) -> tuple[list[int], Hashable]:
    """The prompt's token ids as the worker's engine will see them, and its ``cache_salt``.

    ``([], salt)`` when the body is not a valid request, or its prompt has more characters than
    ``max_prompt_chars`` (the most any worker announces on ``/admin/info``: none could take it):
    the router then routes by load alone and the worker answers with the error."""
    from corekv.engine.prompts import encode_prompt
    from corekv.server.protocol import parse_messages

    if not isinstance(payload, dict):
        return [], None
    salt = payload.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    prompt = payload.get("messages") if chat else payload.get("prompt")
    try:
        if chat:
            prompt = parse_messages(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a one-prompt batch, as the server reads it
        if max_prompt_chars is not None and num_prompt_chars(prompt) > max_prompt_chars:
            return [], salt
        return encode_prompt(tokenizer, prompt), salt
    except Exception as e:  # NOTE: a bad body or any tokenizer failure: the worker says why
        logger.debug("prompt not tokenized (%s); routing by load", e)
        return [], salt


def _has_key(request: Request, key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
