"""Helpers of the router tests: the workers' sizes and a router on a thread (worker processes,
ports and waiting come from tests/processes.py)."""
from __future__ import annotations

import threading

import httpx

from processes import wait_until

BLOCK_SIZE = 4
NUM_BLOCKS = 128
NUM_WORKERS = 3
WORKER_KEY = "worker-key-0123"  # the keyed worker's (conftest.py)
CLIENT_KEY = "client-key-4567"  # a router's own, for its clients


class RouterThread:
    """``corekv.router.app.build_app`` served by uvicorn on a thread; ``url`` ends without /v1."""

    def __init__(self, app, port: int):
        import uvicorn

        self.app, self.url = app, f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def pool(self):
        return self.app.state.router.pool

    def workers_state(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=10).json()["workers"]

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the router to start")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
