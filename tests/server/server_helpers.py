"""Helpers shared by the server tests: the tiny model's config, a plugin that records finished
requests, and SSE reading (``corekv serve`` subprocesses: tests/processes.py)."""
from __future__ import annotations

import json

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
