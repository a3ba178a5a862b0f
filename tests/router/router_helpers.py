"""Helpers of the router tests: worker subprocesses, a router on a thread, ports and waiting."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BLOCK_SIZE = 4
NUM_BLOCKS = 128
NUM_WORKERS = 3
STARTUP_TIMEOUT_S = 120  # NOTE: three engines import torch at once on a shared 2-core box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class WorkerProcess:
    """One ``python -m corekv.cli serve`` subprocess; ``kill`` (SIGKILL) and ``start`` again reuse
    its port, config and KV event endpoints, as a restarted worker would."""

    def __init__(self, config_path: Path, port: int, log_path: Path):
        self.config_path, self.port, self.log_path = config_path, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise AssertionError(f"worker on port {self.port} is still running; kill or stop it "
                                 "before starting it again (it would be left behind)")
        env = dict(os.environ, COREKV_DISABLE_PLUGIN_AUTOLOAD="1", TQDM_DISABLE="1")
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "corekv.cli", "serve", "--config", str(self.config_path),
             "--port", str(self.port), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker on port {self.port} exited with {self.process.returncode}; "
                                 f"log:\n{self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def running(procs: list[WorkerProcess]):
    """Start every worker, wait until all are healthy, and stop them all on the way out."""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            wait_until(proc.is_ready, STARTUP_TIMEOUT_S, f"worker {proc.url} to be healthy", 0.2)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


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
