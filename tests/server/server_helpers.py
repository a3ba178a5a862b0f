"""Helpers shared by the server tests: the tiny model's config, a plugin that records finished
requests, SSE reading, and the errors a server logs (``corekv serve`` subprocesses:
tests/processes.py)."""
from __future__ import annotations

import contextlib
import json
import logging

from corekv.plugin import hookimpl

MODEL_ID = "tiny"


def tiny_config(folder, **engine) -> dict:
    """The tiny model with a small KV pool; ``engine`` overrides engine fields."""
    return {"model": str(folder), "engine": {"num_blocks": 256, "block_size": 16, **engine},
            "cache": {"backend": "radix"}}


class FinishedRecorder:
    """A real plugin that keeps every finished request's output (to see aborts server-side)."""

    def __init__(self):
        self.outputs = []

    @hookimpl
    def corekv_on_request_finished(self, output) -> None:
        self.outputs.append(output)


def sse_payloads(lines) -> list:
    """The JSON payloads of ``data:`` lines up to ``data: [DONE]`` (asserted to come last)."""
    payloads, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, f"data after [DONE]: {line!r}"
        if line == "data: [DONE]":
            done = True
            continue
        payloads.append(json.loads(line[len("data: "):]))
    assert done, "the stream did not end with data: [DONE]"
    return payloads


@contextlib.contextmanager
def logged_errors():
    """The records of errors (and of anything with a traceback) that an in-process server logs
    meanwhile. NOTE: uvicorn's loggers do not propagate to the root logger, which caplog
    watches, so the handler sits on ``uvicorn`` (whose ``uvicorn.error`` logs an app's
    exceptions) and on the root (corekv's loggers)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info or record.levelno >= logging.ERROR:
                records.append(record)

    handler = Keep()
    loggers = [logging.getLogger("uvicorn"), logging.getLogger()]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
