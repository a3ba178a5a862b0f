"""One engine, many concurrent HTTP requests: a thread that owns the engine and steps it, and a
per-request asyncio queue of text deltas (with their tokens' logprobs when asked for).

The :class:`corekv.Engine` is not thread-safe, so exactly one thread (the *engine thread*) touches
it. Handlers on the event loop hand work in through a thread-safe inbox (new requests, aborts, and
calls such as ``warm`` or ``stats``); the engine thread takes everything waiting, then runs one
``step()`` for all running requests together (continuous batching), then pushes each request's new
text and its finish into that request's asyncio queue with ``loop.call_soon_threadsafe``.

Prompts are tokenized before they reach the inbox, on a worker thread (:meth:`AsyncEngine.encode`),
so a long prompt holds up neither the event loop nor the steps of the requests already running.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from corekv.engine.outputs import RequestOutput, TokenLogprobs
from corekv.engine.requests import RequestRejectedError
from corekv.errors import CoreKVError
from corekv.engine.sampling import SamplingParams
from corekv.engine.streaming import TextStream

__all__ = ["AsyncEngine", "Delta", "EngineStepError", "EngineUnavailableError", "RequestHandle"]

logger = logging.getLogger(__name__)

#: consecutive failed steps after which the engine is declared dead (every request then fails)
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineStepError(RuntimeError):
    """The engine failed while running a request (a fault of the server, not of the request)."""


class EngineUnavailableError(EngineStepError):
    """The engine takes no more requests: the server is shutting down, or the engine died."""


@dataclass(frozen=True)
class Delta:
    """New text of completion ``index``, and (``SamplingParams.logprobs``) the log-probabilities
    of its tokens sampled since the last delta; these may run ahead of the text, which holds
    back what could start a stop string."""

    index: int
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()


class RequestHandle:
    """One request as the event loop sees it: iterate it for :class:`Delta` s; the last item is
    the :class:`RequestOutput`. Leaving the iteration early (a client gone) aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, events: asyncio.Queue):
        self.request_id = request_id
        self._engine, self._events = engine, events
        #: the final event once it arrived (the output, or the error that ended the request)
        self.output: RequestOutput | BaseException | None = None

    async def __aiter__(self) -> AsyncIterator[Delta | RequestOutput]:
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    self.output = event  # NOTE: failed in the engine: nothing left to abort
                    raise event
                if isinstance(event, RequestOutput):
                    self.output = event
                yield event
                if self.output is not None:
                    return
        finally:
            if self.output is None:
                self._engine.abort(self.request_id)

    async def result(self) -> RequestOutput:
        """Wait for the final output (the deltas are dropped)."""
        async for event in self:
            if isinstance(event, RequestOutput):
                return event
        raise AssertionError("a request's events end with its output; this indicates a bug in AsyncEngine")


@dataclass
class _Active:
    text: TextStream
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue

    def push(self, event: Any) -> None:
        _push(self.loop, self.events.put_nowait, event)


# -- inbox items: what the event loop hands the engine thread ----------------------------------
@dataclass(frozen=True)
class _Add:
    """Admit a request (already tokenized); ``admitted`` is settled once it is, or failed to be,
    and its deltas and output go to ``events``."""

    request_id: str
    prompt: Any
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future

    def refuse(self, error: BaseException) -> None:
        _push(self.loop, _settle, self.admitted, None, error)


@dataclass(frozen=True)
class _Call:
    """Run ``fn(engine)`` between steps; ``done`` gets its result or error."""

    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future

    def refuse(self, error: BaseException) -> None:
        _push(self.loop, _settle, self.done, None, error)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


_InboxItem = _Add | _Call | _Abort | _Stop


class AsyncEngine:
    """Drives one :class:`corekv.Engine` from its own thread for asyncio callers.

    Invariants: only the engine thread calls the engine, except ``engine.encode``, which only
    reads the tokenizer (neither encoding nor decoding changes it); every submitted request ends with
    exactly one final event in its queue (its :class:`RequestOutput` or an exception), including
    when a step fails or the engine shuts down; requests waiting in the inbox together join the
    same step.
    """

    def __init__(self, engine: Any, *, close_engine: bool = False):
        self.engine = engine
        self.close_engine = close_engine
        #: longer prompts can never fit the engine (``Engine.max_prompt_chars``); None: no bound
        self.max_prompt_chars = engine.max_prompt_chars
        self.dead_reason: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._ids = iter(range(1 << 62))
        self._thread = threading.Thread(target=self._run, name="corekv-engine", daemon=True)
        self._is_stopping = False
        # NOTE: _put's check-and-put and the engine thread's last drain of the inbox hold this
        # lock, so an item is either drained (and answered) or refused, never left unanswered.
        self._inbox_lock = threading.Lock()

    # -- the event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Requests and calls handed in that the engine thread has not taken yet."""
        return self._inbox.qsize()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    async def encode(self, prompt: Any, *, add_generation_prompt: bool = True) -> list[int]:
        """``engine.encode(prompt)`` on a worker thread (a prompt longer than
        :attr:`max_prompt_chars` is refused there without being tokenized)."""
        return await asyncio.to_thread(self.engine.encode, prompt,
                                       add_generation_prompt=add_generation_prompt)

    async def submit(self, prompt: Any, params: SamplingParams, cache_salt: str | None = None
                     ) -> RequestHandle:
        """Admit one request; raises what :meth:`encode` and ``engine.add_request`` raise (a bad
        prompt, a request that can never fit) before any text is produced, so a caller can still
        answer 4xx."""
        token_ids = await self.encode(prompt)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request_id = f"srv-{next(self._ids)}"
        admitted = loop.create_future()
        self._put(_Add(request_id, prompt, token_ids, params, cache_salt, events, loop, admitted))
        try:
            await admitted
        except asyncio.CancelledError:  # NOTE: the client left while the request was queued
            self.abort(request_id)
            raise
        return RequestHandle(self, request_id, events)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._put(_Call(fn, loop, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op once finished); its handle ends without an output."""
        if self._thread.is_alive():
            self._inbox.put(_Abort(request_id))

    async def shutdown(self) -> None:
        """Stop the engine thread (aborting what is left) and, with ``close_engine``, close the
        engine there (which writes pending blocks to the storage tiers)."""
        await asyncio.to_thread(self.stop)

    def stop(self, timeout: float | None = None) -> bool:
        """:meth:`shutdown` for a caller outside the event loop; True once the thread has ended."""
        if self._thread.ident is None:  # never started: nothing runs the engine
            self._is_stopping = True
            if self.close_engine:
                self.engine.close()
            return True
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _put(self, item: _Add | _Call) -> None:
        with self._inbox_lock:
            if self.dead_reason is not None or not self._thread.is_alive() or self._is_stopping:
                reason = self.dead_reason or "the server is shutting down"
                raise EngineUnavailableError(f"the engine cannot take requests: {reason}")
            self._inbox.put(item)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        failures = 0
        try:
            while True:
                items = [] if engine.has_unfinished_requests else [self._inbox.get()]
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if any(isinstance(item, _Stop) for item in items):
                    self._is_stopping = True
                for item in items:
                    self._handle(item)
                if self._is_stopping:
                    return
                if not engine.has_unfinished_requests:
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:  # NOTE: a fault must fail its requests, never hang them
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    self._fail_all(e, dead=failures >= MAX_CONSECUTIVE_STEP_FAILURES)
                    continue
                failures = 0
                self._publish(outputs)
        finally:
            self._finish()

    def _handle(self, item: _InboxItem) -> None:
        if isinstance(item, _Add):
            try:
                self.engine.add_request(item.prompt, item.params, item.cache_salt,
                                        request_id=item.request_id, prompt_token_ids=item.token_ids)
                active = _Active(self.engine.text_stream(item.request_id), item.loop, item.events)
            except Exception as e:
                item.refuse(e)
                return
            self._active[item.request_id] = active
            _push(item.loop, _settle, item.admitted, None, None)
        elif isinstance(item, _Abort):
            if self._active.pop(item.request_id, None) is not None:
                try:
                    self.engine.abort(item.request_id)
                except KeyError:  # NOTE: finished in the step that raced the abort
                    pass
        elif isinstance(item, _Call):
            try:
                result, error = item.fn(self.engine), None
            except Exception as e:
                result, error = None, e
            # NOTE: engine.warm() steps the engine itself; outputs of other requests that finished
            # meanwhile wait in the engine and come out of the next step(). A fault other than a
            # rejected argument may have lost some of them: fail those rather than let them hang.
            if error is not None and not isinstance(error, (ValueError, TypeError, CoreKVError)):
                self._fail_all(error, dead=False)
            _push(item.loop, _settle, item.done, result, error)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        finished = {o.request_id: o for o in outputs}
        for request_id, active in list(self._active.items()):
            logprobs = dict(active.text.logprob_deltas())
            for index, text in active.text.deltas():
                active.push(Delta(index, text, tuple(logprobs.pop(index, ()))))
            for index, new in logprobs.items():  # NOTE: tokens whose text is still held back
                active.push(Delta(index, "", tuple(new)))
            output = finished.get(request_id)
            if output is not None:
                # NOTE: the engine aborted this request alone (its sampling failed); the others
                # in the step went on
                active.push(output if output.error is None else EngineStepError(output.error))
                del self._active[request_id]

    def _fail_all(self, error: Exception, *, dead: bool) -> None:
        failure = EngineStepError(f"the engine failed while running this request: "
                                  f"{type(error).__name__}: {error}")
        for request_id, active in self._active.items():
            active.push(failure)
            try:
                self.engine.abort(request_id)
            except Exception:  # NOTE: the engine is already broken; the request is failed anyway
                logger.debug("abort of %s after a failed step failed too", request_id, exc_info=True)
        self._active.clear()
        if dead:
            self.dead_reason = f"{MAX_CONSECUTIVE_STEP_FAILURES} steps failed in a row ({failure})"
            self._is_stopping = True

    def _finish(self) -> None:
        self._is_stopping = True
        stopped = EngineUnavailableError("the server shut down before this request finished")
        for request_id, active in self._active.items():
            active.push(stopped)
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
        self._active.clear()
        # NOTE: aborted requests leave the engine in its next step (firing the finished hooks);
        # without it they would stay in a shared engine that outlives this thread.
        for _ in range(3):
            if not self.engine.has_unfinished_requests:
                break
            try:
                self.engine.step()
            except Exception:
                logger.exception("retiring aborted requests at shutdown failed")
                break
        with self._inbox_lock:  # answer whatever raced the stop; later _put calls are refused
            self._is_stopping = True
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, (_Add, _Call)):
                    item.refuse(stopped)
        if self.close_engine:
            try:
                self.engine.close()
            except Exception:
                logger.exception("engine.close() failed; pending tier writes may be lost")


def _push(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``; nothing when the loop is gone (its server has stopped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # NOTE: "Event loop is closed": no one is left to tell
        logger.debug("dropped an event for a closed event loop")


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
