"""Helpers of the router tests: the workers' sizes, a router on a thread and the real route
command in a subprocess (worker processes, ports and waiting come from tests/processes.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import httpx

from processes import free_port, wait_until

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


def start_route(args: list[str], **env: str) -> tuple[subprocess.Popen, str]:
    """``python -m corekv.cli route ARGS`` on a free port, waited for until ``/health`` answers;
    returns the process (the caller terminates it) and its URL."""
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "corekv.cli", "route", *args, "--port", str(port), "--health-interval", "0.5"],
        env=dict(os.environ, COREKV_DISABLE_PLUGIN_AUTOLOAD="1", **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert router.poll() is None, router.stdout.read().decode()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 60, "corekv route to answer /health", 0.2)
    except BaseException:
        router.kill()
        raise
    return router, url
