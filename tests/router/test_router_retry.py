"""The router's answers to a worker that is busy (502/503/504 before any byte) and to one that
breaks a stream mid-way, in front of a real ``corekv serve`` worker (tests/router/conftest.py).

A stand-in worker plays the faulty one: a small HTTP app on loopback served by uvicorn like the
router, healthy on ``GET /health``, answering completions with the status it is given or with a
stream it cuts after its first token. A real worker cannot be made to answer 503/504 on demand,
nor to drop a stream halfway, so the fault is staged there; router, HTTP and the real worker
are the real parts."""
from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from processes import free_port
from router_helpers import RouterThread

FIRST_EVENT = b'data: {"id": "cmpl-standin", "object": "text_completion", "choices": [{"index": 0, "text": "Hel", ' \
              b'"finish_reason": null}]}\n\n'


class StandIn:
    """A stand-in worker on a thread: ``answer`` is an HTTP status (its JSON error body names the
    stand-in) or ``"break"`` (a stream cut after its first event); ``requests`` counts completions."""

    def __init__(self, answer):
        self.answer, self.requests = answer, 0

        async def health(request: Request):
            return JSONResponse({"status": "ok"})

        async def completions(request: Request):
            self.requests += 1
            await request.body()
            if self.answer != "break":
                return JSONResponse(self.body, status_code=self.answer)

            async def cut():
                yield FIRST_EVENT
                raise ConnectionAbortedError("stand-in worker drops the stream")  # uvicorn resets it
            return StreamingResponse(cut(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])
        self.thread = RouterThread(app, free_port())
        self.url = self.thread.url

    @property
    def body(self) -> dict:
        return {"error": {"message": f"stand-in at {self.url} is busy", "type": "server_error",
                          "code": self.answer}}

    def __enter__(self):
        self.thread.__enter__()
        return self

    def __exit__(self, *exc):
        self.thread.__exit__(*exc)


def complete(router, prompt: str, **extra) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **extra})


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_busy_answer_is_retried_on_another_worker(workers, make_router, status):
    """Round robin (which wraps to the first worker after a retry) sends both requests to the busy
    stand-in first: both get the real worker's completion; a busy worker is not marked down (it
    answered)."""
    with StandIn(status) as busy:
        router = make_router([busy.url, workers[0].url], policy="round_robin")
        answers = [complete(router, f"retry {status} request {i}") for i in range(2)]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert all(len(a.json()["choices"][0]["text"]) > 0 for a in answers)
        assert busy.requests == 2
        state = {w["url"]: w for w in router.workers_state()}
        assert state[busy.url]["healthy"] and state[busy.url]["in_flight"] == 0
        assert state[workers[0].url]["requests"] == 2 and state[workers[0].url]["in_flight"] == 0


def test_when_every_worker_is_busy_the_last_busy_answer_is_returned(make_router):
    with StandIn(503) as first, StandIn(504) as second:
        router = make_router([first.url, second.url], policy="round_robin", max_retries=2)
        answer = complete(router, "nobody is free")
        assert (first.requests, second.requests) == (1, 1), "each worker tried once, none twice"
        last = first if answer.status_code == 503 else second
        assert answer.status_code in (503, 504) and answer.json() == last.body


def test_a_stream_broken_mid_way_ends_early_and_counts_a_failure(make_router):
    """The client already has the first token: no other worker can continue the stream, so the
    router ends it where the worker broke it (no ``[DONE]``), counts the failure and frees the
    worker's slot; the worker stays in the rotation (its health checks pass)."""
    with StandIn("break") as breaking:
        router = make_router([breaking.url], max_retries=2)
        with httpx.stream("POST", router.url + "/v1/completions", timeout=120,
                          json={"prompt": "a stream that breaks", "max_tokens": 8, "stream": True}) as response:
            assert response.status_code == 200
            received = b""
            try:
                for chunk in response.iter_bytes():
                    received += chunk
            except httpx.HTTPError:
                pass  # NOTE: a client may also see the cut itself; either way the stream is short
        assert received.startswith(FIRST_EVENT) and b"[DONE]" not in received
        assert json.loads(FIRST_EVENT[len(b"data: "):])["choices"][0]["text"] == "Hel"
        assert breaking.requests == 1, "a started stream is never replayed on another attempt"
        [state] = router.workers_state()
        assert state["failures"] >= 1 and state["in_flight"] == 0 and state["healthy"]
