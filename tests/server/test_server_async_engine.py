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
