"""A real ``redis-server`` on 127.0.0.1 for the redis tier's tests (started, killed, restarted).

Without ``redis-server`` on PATH the tests skip, except in CI (``CI`` set), where they fail:
CI installs it, so a missing server there is a broken pipeline, not a reason to skip.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
from processes import free_port

REDIS_SERVER = shutil.which("redis-server")


def require_redis_server() -> str:
    if REDIS_SERVER is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed but CI is set: install it "
                        "(apt-get install -y redis-server)")
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    return REDIS_SERVER


class RedisServer:
    """One redis-server process without persistence; ``kill()`` and ``start()`` keep the port."""

    def __init__(self, workdir, *extra_args: str, password: str | None = None, tls_port: bool = False):
        self.binary = require_redis_server()
        self.workdir = str(workdir)
        self.port = free_port()
        self.password = password
        self.is_tls = tls_port
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.is_tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        port_args = (["--port", "0", "--tls-port", str(self.port)] if self.is_tls
                     else ["--port", str(self.port)])
        args = [self.binary, *port_args, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.workdir, *self.extra_args]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"redis-server exited: {' '.join(args)}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not listen on port {self.port} within 20 s")

    def kill(self) -> None:
        """SIGKILL, as a crashed or unplugged server: no clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        self.process = None


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
