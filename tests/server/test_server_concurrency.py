"""Concurrent requests share engine steps (continuous batching through the one engine thread), and
a client that goes away (mid-stream, or while waiting for a whole answer) aborts its request in the
engine, as does a shutdown whose drain timeout runs out."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from processes import wait_until
from server_helpers import MODEL_ID, FinishedRecorder, tiny_config

from corekv.engine.llm_engine import Engine
from corekv.server import BackgroundServer, build_app

NUM_STREAMS = 4
MAX_TOKENS = 16


def hold_engine_thread(server) -> threading.Event:
    """Block the engine thread inside a call until the returned event is set."""
    runner = server.app.state.async_engine
    gate, entered = threading.Event(), threading.Event()

    def wait(engine):
        entered.set()
        gate.wait(60)

    threading.Thread(target=lambda: asyncio.run(runner.call(wait)), daemon=True).start()
    assert entered.wait(30), "the engine thread did not take the call"
    return gate


def test_concurrent_streams_run_in_the_same_steps(server, client):
    runner = server.app.state.async_engine
    steps_before = httpx.get(server.url + "/admin/stats", timeout=30).json()["num_steps"]
    gate = hold_engine_thread(server)
    texts: dict[int, str] = {}

    def stream(i: int) -> None:
        chunks = client.completions.create(model=MODEL_ID, prompt=f"stream number {i} says",
                                           max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        texts[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: runner.num_pending == NUM_STREAMS, what="all requests to be queued")
    finally:
        gate.set()
    for t in threads:
        t.join(60)
    assert len(texts) == NUM_STREAMS
    steps = httpx.get(server.url + "/admin/stats", timeout=30).json()["num_steps"] - steps_before
    # NOTE: one after another they would take NUM_STREAMS * MAX_TOKENS steps; batched, the
    # prompts prefill in one step and every decode step serves all of them.
    assert steps == MAX_TOKENS


def test_greedy_text_does_not_depend_on_what_shares_the_batch(server, client):
    prompt = "batched or alone"
    alone = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text
    gate = hold_engine_thread(server)
    results = []

    def ask(p):
        results.append((p, client.completions.create(
            model=MODEL_ID, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True}).choices[0].text))

    threads = [threading.Thread(target=ask, args=(p,)) for p in (prompt, "another prompt", "third")]
    for t in threads:
        t.start()
    wait_until(lambda: server.app.state.async_engine.num_pending == 3, what="3 queued requests")
    gate.set()
    for t in threads:
        t.join(60)
    assert dict(results)[prompt] == alone


MANY_TOKENS = 3000  # NOTE: far more than can finish before a disconnect reaches the engine


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server, recorder):
    max_tokens = MANY_TOKENS
    prompt = "a very long answer that nobody will read"
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk read, then the connection is closed

    def finished():
        return [o for o in recorder.outputs if o.prompt == prompt]

    (output,) = wait_until(finished, what="the aborted request to finish")
    assert output.finish_reason == "abort"
    assert len(output.token_ids) < max_tokens
    stats = httpx.get(server.url + "/admin/stats", timeout=30).json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_a_client_that_gives_up_on_a_whole_response_aborts_its_request(server, recorder):
    prompt = "a whole answer nobody waits for"
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": MANY_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    (output,) = wait_until(lambda: [o for o in recorder.outputs if o.prompt == prompt],
                           what="the abandoned request to finish")
    assert output.finish_reason == "abort"
    assert len(output.token_ids) < MANY_TOKENS


def test_a_stream_longer_than_the_drain_timeout_is_aborted_at_shutdown(tiny_model_folder):
    recorder = FinishedRecorder()
    with Engine.from_config(tiny_config(tiny_model_folder), plugins=(recorder,)) as engine:
        server = BackgroundServer(build_app(engine, served_model_name=MODEL_ID),
                                  drain_timeout=0.2).start()
        body = {"model": MODEL_ID, "prompt": "longer than the drain", "max_tokens": MANY_TOKENS,
                "stream": True, "temperature": 0.0, "ignore_eos": True}
        stopper = threading.Thread(target=server.stop)
        lines = []
        with pytest.raises(httpx.RemoteProtocolError):  # NOTE: the response is cut, not ended
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if not stopper.is_alive() and len(lines) == 1:
                        stopper.start()
        stopper.join(60)
        assert not stopper.is_alive() and "data: [DONE]" not in lines
        (output,) = recorder.outputs
        assert output.finish_reason == "abort" and len(output.token_ids) < MANY_TOKENS
