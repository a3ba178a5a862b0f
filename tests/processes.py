"""Helpers for tests that run real processes on loopback: free ports, waiting for a condition,
and ``corekv serve`` as a user runs it (the installed console script)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


#: the ``corekv`` console script of the interpreter running the tests
SCRIPT = Path(sys.executable).with_name("corekv")
#: seconds a ``corekv serve`` start may take: several engines importing torch at once on a
#: shared 2-core box take tens of seconds
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float = 30.0, what: str = "a condition", interval_s: float = 0.02):
    """``predicate()``'s first truthy value, polled every ``interval_s``; AssertionError after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


class ServeProcess:
    """One ``corekv serve --config C --port P [args]`` subprocess, its output in ``log_path``.

    ``kill`` (SIGKILL) and ``start`` again reuse its port, config and arguments, as a restarted
    worker would; ``start`` refuses while the process still runs (it would be left behind).
    """

    def __init__(self, config_path, port: int, log_path: Path, *args: str):
        self.config_path, self.port, self.log_path, self.args = config_path, port, Path(log_path), args
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> ServeProcess:
        if self.process is not None and self.process.poll() is None:
            raise AssertionError(f"corekv serve on port {self.port} is still running; kill or stop "
                                 "it before starting it again")
        env = dict(os.environ, COREKV_DISABLE_PLUGIN_AUTOLOAD="1", TQDM_DISABLE="1")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(SCRIPT), "serve", "--config", str(self.config_path), "--port", str(self.port),
                 *self.args], stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_ready(self) -> bool:
        import httpx  # NOTE: here, so tests of backends and tiers run without the server extra

        if self.process.poll() is not None:
            raise AssertionError(f"corekv serve on port {self.port} exited with "
                                 f"{self.process.returncode}; output:\n{self.output()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServeProcess:
        wait_until(self.is_ready, timeout_s, f"corekv serve on {self.url} to answer /health", 0.2)
        return self

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), SIGKILL if it has not exited within 30 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def running(procs: list[ServeProcess]):
    """Start every server, wait until all are healthy, and stop them all on the way out."""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def head_only(host: str, port: int, headers: str) -> bytes:
    """POST a request's head and no body; return the answer, up to the end of its JSON body (each
    read waits at most 30 s): what a server says before it has read a byte of the body."""
    answer = b""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\n{headers}\r\n".encode())
        while not answer.endswith(b"}}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer
