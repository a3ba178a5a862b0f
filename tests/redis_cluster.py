"""A real Redis Cluster on 127.0.0.1 for the redis tier's cluster tests: six ``redis-server``
processes in cluster mode (3 primaries, each with one replica), joined by ``redis-cli --cluster
create``. Nodes can be killed (a crash), stopped (SIGSTOP: the kernel still accepts connections,
nobody answers) and resumed.

Every node listens on a free port and gossips on another free one (``cluster-port``), so
clusters of parallel test runs never collide. Like tests/redis_server.py, a missing
``redis-server`` skips the tests, except in CI, where it fails them.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import redis
from processes import free_port
from redis_server import require_redis_server

#: ms without an answer before the others mark a node failed and its replica takes over. NOTE:
#: short, so a failover test waits ~2 s, not the default 15 s; long enough that a loaded 2-core
#: CI machine does not see false failovers.
NODE_TIMEOUT_MS = 1500


class RedisCluster:
    """Six cluster-mode redis-servers without persistence; ``nodes[i]`` is ``(port, process)``."""

    def __init__(self, workdir, *extra_args: str, node_timeout_ms: int = NODE_TIMEOUT_MS,
                 password: str | None = None):
        self.binary = require_redis_server()
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            message = "redis-cli is not installed (apt-get install -y redis-tools)"
            pytest.fail(f"{message} but CI is set") if os.environ.get("CI") else pytest.skip(message)
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.password = password
        if password:  # every node requires it, replicas use it to reach their primary
            self.extra_args += ["--requirepass", password, "--masterauth", password]
        self.node_timeout_ms = node_timeout_ms
        self.ports = [free_port() for _ in range(6)]
        self.bus_ports = [free_port() for _ in range(6)]
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """The URL of one node (the tier discovers the others from it)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisCluster:
        """Start the six nodes and join them; on any failure the nodes started are stopped."""
        try:
            for port in self.ports:
                self._start_node(port)
            auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
            subprocess.run([self.cli, *auth, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node says ``cluster_state:ok``, 3 primaries serve all slots and
        every replica is in sync with its primary."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._node_is_ok(port) for port, p in self.processes.items() if p.poll() is None):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the redis cluster on ports {self.ports} did not settle in {timeout_s} s")

    def primary_ports(self) -> list[int]:
        """Ports of the nodes that serve slots now (a replica that took over included)."""
        with self.client(next(p for p in self.ports if self.is_running(p))) as client:
            lines = client.execute_command("CLUSTER", "NODES").decode().splitlines()
        # NOTE: a line is "<id> <ip:port@bus> <flags> <primary id> ... <slots>"
        return sorted(int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines
                      if "master" in line.split()[2] and "fail" not in line.split()[2]
                      and len(line.split()) > 8)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=2)

    def is_running(self, port: int) -> bool:
        process = self.processes.get(port)
        return process is not None and process.poll() is None

    def kill(self, port: int) -> None:
        """SIGKILL, as a crashed machine; its replica takes over after the node timeout."""
        process = self.processes[port]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def pause(self, port: int) -> None:
        """SIGSTOP: connections are still accepted by the kernel, no reply ever comes."""
        self.processes[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=10)

    def _start_node(self, port: int) -> None:
        bus_port = self.bus_ports[self.ports.index(port)]
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf", "--cluster-port", str(bus_port),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # NOTE: what the README asks of operators: while a dead primary's replica has not
                # taken over yet, the other primaries keep serving their own slots
                "--cluster-require-full-coverage", "no",
                # NOTE: a replica's first sync starts at once, not after the default 5 s wait
                "--repl-diskless-sync-delay", "0", *self.extra_args]
        self.processes[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.processes[port].poll() is None, f"redis-server exited: {' '.join(args)}"
            try:
                with self.client(port) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not listen on port {port} within 20 s")

    def _node_is_ok(self, port: int) -> bool:
        try:
            with self.client(port) as client:
                info = dict(line.split(":", 1) for line in
                            client.execute_command("CLUSTER", "INFO").decode().split() if ":" in line)
                if not (info.get("cluster_state") == "ok" and int(info.get("cluster_slots_ok", 0)) == 16384
                        and int(info.get("cluster_size", 0)) == 3 and int(info.get("cluster_known_nodes", 0)) >= 6):
                    return False
                # NOTE: a replica that never finished its first sync cannot take over its primary
                replication = client.info("replication")
                return replication["role"] == "master" or replication.get("master_link_status") == "up"
        except redis.RedisError:
            return False


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """One healthy cluster for a test module's non-destructive tests."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def disposable_redis_cluster(tmp_path):
    """A cluster of its own for a test that kills or stops nodes."""
    cluster = RedisCluster(tmp_path).start()
    yield cluster
    cluster.stop()
