"""Helpers shared by the server tests: the tiny model's config, a plugin that records finished
requests, SSE reading, and running a ``corekv serve`` subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from corekv.plugin import hookimpl

MODEL_ID = "tiny"
SCRIPT = Path(sys.executable).with_name("corekv")


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


def wait_until(predicate, timeout: float = 30.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class ServeProcess:
    """``corekv serve`` as a user runs it (the console script), on a free loopback port."""

    def __init__(self, config_path, port: int, *args: str):
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "TQDM_DISABLE": "1"}
        self.process = subprocess.Popen(
            [str(SCRIPT), "serve", "--config", str(config_path), "--port", str(port),
             "--served-model-name", MODEL_ID, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def wait_ready(self, timeout: float = 120.0) -> ServeProcess:
        def ready():
            if self.process.poll() is not None:
                raise AssertionError(f"corekv serve exited with {self.process.returncode}:\n"
                                     f"{self.process.stdout.read()}")
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(ready, timeout, "corekv serve to answer /health")
        return self

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.kill()
        out, _ = self.process.communicate(timeout=60)
        return out
