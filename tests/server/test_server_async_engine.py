"""The engine thread on its own: a stop never leaves a request hanging, and a stopped engine
refuses new work with an error the app answers as 503."""
from __future__ import annotations

import asyncio
import threading

import pytest
from server_helpers import tiny_config

from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams
from corekv.server.app import as_api_error
from corekv.server.async_engine import AsyncEngine, Delta, EngineUnavailableError

LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_folder):
    with Engine.from_config(tiny_config(tiny_model_folder)) as engine:
        yield engine


def test_a_stop_fails_the_requests_in_flight_and_closes_the_engine(engine):
    runner = AsyncEngine(engine, close_engine=True)
    runner.start()

    async def scenario():
        handle = await runner.submit("stopped while running", LONG)
        events = handle.__aiter__()
        assert isinstance(await events.__anext__(), Delta)  # it runs
        stopper = threading.Thread(target=runner.stop)
        stopper.start()
        with pytest.raises(EngineUnavailableError) as info:
            async for _ in events:
                pass
        stopper.join(30)
        return info.value

    error = asyncio.run(scenario())
    assert as_api_error(error).status == 503
    assert not runner.is_alive
    with pytest.raises(Exception, match="closed"):
        engine.generate("after close", SamplingParams(max_tokens=1))


def test_a_stopped_engine_refuses_requests_and_calls(engine):
    runner = AsyncEngine(engine)
    runner.start()
    assert runner.stop(timeout=30)

    async def scenario():
        with pytest.raises(EngineUnavailableError):
            await runner.submit("too late", LONG)
        with pytest.raises(EngineUnavailableError):
            await runner.call(lambda e: e.stats())

    asyncio.run(scenario())
    out = engine.generate("the engine itself still works", SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def test_a_rejected_request_raises_at_submit_and_leaves_the_engine_idle(engine):
    runner = AsyncEngine(engine)
    runner.start()
    too_long = SamplingParams(max_tokens=engine.backend.num_blocks * engine.block_size + 1)

    async def scenario():
        with pytest.raises(ValueError, match="max_tokens"):
            await runner.submit("hi", too_long)
        return await runner.call(lambda e: (e.has_unfinished_requests, e.stats()["num_steps"]))

    try:
        assert asyncio.run(scenario()) == (False, 0)
    finally:
        runner.stop(timeout=30)


def test_prompts_are_tokenized_while_the_engine_thread_is_busy(engine):
    """Tokenizing runs on a worker thread, so a long prompt holds up neither the event loop nor
    the steps of running requests: here it finishes while the engine thread is held in a call."""
    runner = AsyncEngine(engine)
    runner.start()
    gate, entered = threading.Event(), threading.Event()
    chat = [{"role": "user", "content": "and a chat"}]

    def hold(_):
        entered.set()
        gate.wait(60)

    async def scenario():
        held = asyncio.ensure_future(runner.call(hold))
        assert await asyncio.to_thread(entered.wait, 30), "the engine thread did not take the call"
        try:
            text_ids = await asyncio.wait_for(runner.encode("tokenized meanwhile"), 30)
            chat_ids = await asyncio.wait_for(runner.encode(chat, add_generation_prompt=False), 30)
            return text_ids, chat_ids, held.done()
        finally:
            gate.set()
            await held

    try:
        text_ids, chat_ids, was_held_done = asyncio.run(scenario())
    finally:
        runner.stop(timeout=30)
    assert not was_held_done
    assert text_ids == engine.encode("tokenized meanwhile")
    assert chat_ids == engine.encode(chat, add_generation_prompt=False) != engine.encode(chat)


def test_a_request_tokenized_ahead_keeps_its_text_prompt_in_the_output(engine):
    runner = AsyncEngine(engine)
    runner.start()

    async def scenario():
        handle = await runner.submit("kept as text", SamplingParams(max_tokens=2))
        return await handle.result()

    try:
        output = asyncio.run(scenario())
    finally:
        runner.stop(timeout=30)
    assert output.prompt == "kept as text"
    assert output.prompt_token_ids == engine.encode("kept as text")
