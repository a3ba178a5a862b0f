"""The HTTP app: OpenAI's ``/v1`` endpoints, ``/health``, ``/metrics`` and ``/admin/*`` over one
engine, and :func:`serve`, which runs it under uvicorn with a graceful shutdown.

Endpoints::

    POST /v1/completions        prompt: str | list[int] | a batch of either  (stream: SSE chunks,
    POST /v1/chat/completions   messages: [{"role", "content"}]                data: [DONE])
    GET  /v1/models             the one served model
    GET  /health                200 {"status": "ok"}, 503 once the engine is dead or stopping
    GET  /metrics               Prometheus text (every plugin's corekv_collect_metrics answer)
    POST /admin/warm            {"prompt" | "messages", "cache_salt", "pin"} -> {"cached_tokens"}
    POST /admin/unpin           {"prompt" | "messages", "cache_salt"} -> {"unpinned_tokens"}
    GET  /admin/stats           engine.stats()
    GET  /admin/info            {"model", "block_size", "max_prompt_chars", "kv_events"}

Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 4xx for what the
client sent, 5xx only for faults of the server. Two middlewares answer before any route runs:
with an ``api_key``, a request without it is a 401 (every path but ``/health``,
:mod:`corekv.server.auth`); with per-tenant ``api_keys`` the same, and a tenant's key is a 403 on
``/admin/*`` and ``/metrics`` (:mod:`corekv.server.tenants`); a body over ``max_request_bytes`` is
a 413 (:mod:`corekv.server.limits`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from corekv.errors import CoreKVError
from corekv.engine.outputs import RequestOutput
from corekv.server.async_engine import (AsyncEngine, Delta, EngineStepError, EngineUnavailableError,
                                        RequestHandle)
from corekv.server.auth import APIKeyGuard, check_api_key
from corekv.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, check_max_request_bytes
from corekv.server.protocol import (APIError, GenerateRequest, error_body, parse_chat,
                                    parse_completion, parse_json, parse_prefix)
from corekv.server.logprobs import TokenTexts
from corekv.server.responses import ResponseWriter, SSE_DONE, sse
from corekv.server.tenants import TenantGuard, TenantKeys, TenantUsage, scoped_salt, tenant_of

__all__ = ["build_app", "as_api_error", "kv_events_info"]

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def build_app(engine: Any, *, served_model_name: str | None = None, close_engine: bool = False,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_keys: TenantKeys | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; it starts the engine thread on startup and stops it on
    shutdown (closing the engine there when ``close_engine``).

    :param served_model_name: the model id clients send and ``/v1/models`` lists (default:
        ``engine.config.model``).
    :param api_key: when set, every path but ``/health`` needs ``Authorization: Bearer <api_key>``.
    :param max_request_bytes: larger request bodies are answered 413 before they are read.
    :param api_keys: per-tenant keys and an admin key (:mod:`corekv.server.tenants`): a tenant's
        requests run under its own salt, ``/admin/*`` and ``/metrics`` need the admin key, and
        each tenant's usage is counted; instead of ``api_key``.
    """
    if served_model_name is not None and (not isinstance(served_model_name, str)
                                          or not served_model_name.strip()):
        raise ValueError(f"served_model_name must be a non-empty string or None, got "
                         f"{served_model_name!r}; pass the model id clients will send")
    if api_key is not None:
        check_api_key(api_key)
    if api_key is not None and api_keys is not None:
        raise ValueError("pass api_key (one key for everything) or api_keys (per-tenant keys and an "
                         "admin key), not both")
    check_max_request_bytes(max_request_bytes)  # NOTE: here, not when the first request builds the stack
    model_id = served_model_name or str(engine.config.model)
    runner = AsyncEngine(engine, close_engine=close_engine)
    tokens = TokenTexts(engine.model.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        await runner.shutdown()

    app = FastAPI(title="corekv", lifespan=lifespan)
    app.state.async_engine, app.state.model_id = runner, model_id
    # NOTE: the last added runs first: a client without the key is refused before its body is read
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=api_key)
    if api_keys is not None:
        app.add_middleware(TenantGuard, keys=api_keys)
    usage = TenantUsage(api_keys.tenant_names if api_keys is not None else ())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        error = as_api_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _scoped(parse_completion(await _json(request)), request)
        return await _generate(runner, model_id, req, "completion", request, tokens, usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(runner, model_id, _scoped(parse_chat(await _json(request)), request),
                               "chat", request, tokens, usage)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_id, "object": "model", "created": 0, "owned_by": "corekv",
            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not runner.is_alive:
            reason = runner.dead_reason or "the engine thread is not running"
            raise APIError(f"unhealthy: {reason}", status=503, type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        # NOTE: pluggy calls hook implementations last registered first; served in registration order
        texts = engine.plugin_manager.hook.corekv_collect_metrics(engine=engine)[::-1]
        if api_keys is not None:  # NOTE: behind the admin key (TenantGuard), labelled by tenant
            texts.append(usage.exposition())
        elif not texts:
            raise APIError("no metrics: prometheus-client is not installed (pip install "
                           "'corekv[metrics]') or the prometheus plugin is disabled", status=404)
        return Response(b"".join(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/warm")
    async def warm(request: Request):
        body = await _json(request)
        prompt, salt, pin = parse_prefix(body, with_pin=True)
        ids = await _answer(runner.encode(prompt, add_generation_prompt=False))
        if len(ids) < engine.block_size:
            # NOTE: only whole blocks are cached: a shorter prefix would warm nothing, and a 200
            # saying {"cached_tokens": 0} reads like success
            field = "messages" if "messages" in body else "prompt"
            raise APIError(f"{field}: {len(ids)} tokens, shorter than one KV block; warm caches "
                           f"whole blocks only: send at least {engine.block_size} tokens (the "
                           "block size)", param=field, code="prefix_too_short")
        count = await _answer(runner.call(lambda e: e.warm(ids, pin=pin, cache_salt=salt)))
        return {"cached_tokens": count}

    @app.post("/admin/unpin")
    async def unpin(request: Request):
        prompt, salt, _ = parse_prefix(await _json(request), with_pin=False)
        ids = await _answer(runner.encode(prompt, add_generation_prompt=False))
        return {"unpinned_tokens": await _answer(runner.call(lambda e: e.unpin(ids, cache_salt=salt)))}

    @app.get("/admin/stats")
    async def stats():
        stats = await _answer(runner.call(lambda e: e.stats()))
        if api_keys is not None:
            stats["tenants"] = usage.snapshot()
        return JSONResponse(json.loads(json.dumps(stats, default=str)))

    @app.get("/admin/info")
    async def info():
        return {"model": model_id, "block_size": engine.block_size,
                "max_prompt_chars": runner.max_prompt_chars, "kv_events": kv_events_info(engine)}

    return app


def kv_events_info(engine: Any) -> dict[str, Any] | None:
    """Where ``engine`` publishes KV events (``{"endpoint", "replay_endpoint", "topic"}``, the
    ``corekv_describe_kv_events`` hook's answer); None when no plugin publishes them."""
    manager = getattr(engine, "plugin_manager", None)
    return manager.hook.corekv_describe_kv_events(engine=engine) if manager is not None else None


def as_api_error(error: BaseException) -> APIError:
    """The HTTP error a failure becomes: what the request got wrong is 400, the server's own
    faults are 5xx (503 while it cannot take requests)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineUnavailableError):
        return APIError(str(error), status=503, type="server_error")
    if isinstance(error, EngineStepError):
        return APIError(str(error), status=500, type="server_error")
    if isinstance(error, (ValueError, TypeError, CoreKVError)) or _is_template_error(error):
        # NOTE: raised while admitting a request (SamplingParams, the prompt, the chat template,
        # a request too long for the pool): all about what the client sent.
        code = "request_rejected" if type(error).__name__ == "RequestRejectedError" else None
        return APIError(str(error), status=400, code=code, param=getattr(error, "field", None))
    return APIError(f"internal error: {type(error).__name__}: {error}", status=500, type="server_error")


# -- helpers -----------------------------------------------------------------------------------
async def _json(request: Request) -> Any:
    # NOTE: on a worker thread: a body near the limit takes a while to parse and check
    return await asyncio.to_thread(parse_json, await request.body())


async def _answer(work: Awaitable[Any]) -> Any:
    """``await work``, its failure as the HTTP error it becomes."""
    try:
        return await work
    except Exception as e:
        raise as_api_error(e) from e


def _scoped(req: GenerateRequest, http_request: Request) -> GenerateRequest:
    """``req`` under its tenant's salt (:func:`corekv.server.tenants.scoped_salt`)."""
    salt = scoped_salt(tenant_of(http_request), req.cache_salt)
    return req if salt == req.cache_salt else dataclasses.replace(req, cache_salt=salt)


async def _generate(runner: AsyncEngine, model_id: str, req: GenerateRequest, kind: str,
                    http_request: Request, tokens: TokenTexts, usage: TenantUsage):
    if req.model is not None and req.model != model_id:
        raise APIError(f"the model {req.model!r} does not exist; this server serves {model_id!r} "
                       "(see GET /v1/models)", status=404, param="model", code="model_not_found")
    n = req.params.n
    writer = ResponseWriter(kind, model_id, n, tokens=tokens if req.params.logprobs is not None else None,
                            skip_special_tokens=req.params.skip_special_tokens)
    handles = await _submit_all(runner, req)  # NOTE: first: it checks token ids against the vocabulary
    echoes = None
    if req.echo:  # NOTE: token-id prompts are decoded on a worker thread (a long prompt takes a while)
        try:
            echoes = await asyncio.to_thread(_prompt_texts, runner.engine.model.tokenizer, req)
        except BaseException:
            for handle in handles:
                runner.abort(handle.request_id)
            raise
    if not req.stream:
        results = [asyncio.ensure_future(handle.result()) for handle in handles]
        try:
            # NOTE: nothing is sent until the end, so only polling notices a client that gave up;
            # cancelling the waits (as the finally does) aborts the requests in the engine.
            while True:
                done, pending = await asyncio.wait(results, timeout=DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = next((r for r in done if r.exception() is not None), None)
                if failed is not None:
                    raise as_api_error(failed.exception()) from failed.exception()
                if not pending:
                    break
                if await http_request.is_disconnected():
                    return Response(status_code=499)
        finally:
            for r in results:
                r.cancel()
        outputs = [r.result() for r in results]
        usage.record(tenant_of(http_request), outputs)
        return writer.full(outputs, echoes)

    async def events() -> AsyncIterator[str]:
        for chunk in writer.opening():
            yield chunk
        for i, echo in enumerate(echoes or ()):
            for j in range(n):
                yield writer.delta(i * n + j, echo)
        outputs: list[RequestOutput | None] = [None] * len(handles)
        try:
            async with contextlib.aclosing(_merged(handles)) as merged:
                async for i, event in merged:
                    if isinstance(event, Delta):
                        yield writer.delta(i * n + event.index, event.text, event.logprobs)
                    else:
                        outputs[i] = event
                        for c in event.outputs:
                            yield writer.finish(i * n + c.index, c.finish_reason)
        except EngineStepError as e:
            # NOTE: the 200 status is already sent: the error goes in the stream, as vLLM does.
            yield sse(as_api_error(e).body())
            yield SSE_DONE
            return
        usage.record(tenant_of(http_request), outputs)
        if req.include_usage:
            yield writer.usage_chunk(outputs)
        yield SSE_DONE

    # NOTE: when the client disconnects, Starlette stops this generator; leaving the `async for`
    # over the handles aborts the requests in the engine.
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _submit_all(runner: AsyncEngine, req: GenerateRequest) -> list[RequestHandle]:
    """Admit every prompt of ``req`` (together, so they join the same step); if one is refused,
    abort the others and raise its error (naming the prompt in a batch)."""
    results = await asyncio.gather(*(runner.submit(p, req.params, req.cache_salt) for p in req.prompts),
                                   return_exceptions=True)
    failed = next(((i, r) for i, r in enumerate(results) if isinstance(r, BaseException)), None)
    if failed is None:
        return list(results)
    for result in results:
        if isinstance(result, RequestHandle):
            runner.abort(result.request_id)
    index, error = failed
    if not isinstance(error, Exception):
        raise error  # NOTE: a cancellation (the client left) is no HTTP error
    api_error = as_api_error(error)
    if len(req.prompts) > 1 and api_error.status == 400:
        api_error = APIError(f"prompt[{index}]: {api_error}", status=400, param=api_error.param or "prompt",
                             code=api_error.code)
    raise api_error from error


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Any]]:
    """``(prompt index, event)`` of every handle as they come; ends when all have their output.
    Leaving early (or a failed request) stops the others, which aborts them in the engine."""
    if len(handles) == 1:  # NOTE: the common case, without a task per handle
        async with contextlib.aclosing(handles[0].__aiter__()) as events:
            async for event in events:
                yield 0, event
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for event in handle:
                merged.put_nowait((index, event))
        except Exception as e:
            merged.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        num_open = len(handles)
        while num_open:
            index, event = await merged.get()
            if isinstance(event, Exception):
                raise event
            if isinstance(event, RequestOutput):
                num_open -= 1
            yield index, event
    finally:
        for task in tasks:
            task.cancel()


def _prompt_texts(tokenizer: Any, req: GenerateRequest) -> list[str]:
    """Each prompt's text, as ``echo`` prepends it: a string as sent, token ids decoded."""
    return [p if isinstance(p, str)
            else tokenizer.decode(p, skip_special_tokens=req.params.skip_special_tokens)
            for p in req.prompts]


def _is_template_error(error: BaseException) -> bool:
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return False
    return isinstance(error, TemplateError)
