"""Fixtures for the HTTP server tests: a real engine on the tiny model, served by a real uvicorn on
a free loopback port in a background thread, and the official ``openai`` client pointed at it."""
from __future__ import annotations

import pytest
from server_helpers import MODEL_ID, FinishedRecorder, tiny_config

from corekv.engine.llm_engine import Engine
from corekv.server import BackgroundServer, build_app


@pytest.fixture(scope="module")
def recorder():
    return FinishedRecorder()


@pytest.fixture(scope="module")
def engine(tiny_model_folder, recorder):
    with Engine.from_config(tiny_config(tiny_model_folder), plugins=(recorder,)) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine):
    """The engine served at ``server.url`` (``server.app.state.async_engine`` is its thread)."""
    with BackgroundServer(build_app(engine, served_model_name=MODEL_ID)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model_folder):
    """A second engine on the same model: what ``engine.generate`` answers, for comparison."""
    with Engine.from_config(tiny_config(tiny_model_folder)) as engine:
        yield engine
