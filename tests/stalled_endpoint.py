"""A TCP endpoint on 127.0.0.1 that accepts every connection and never answers: a hung server, a
stuck load balancer. Tests point remote tiers at it to check that every call has a deadline."""
from __future__ import annotations

import socket
import threading

import pytest


class StalledEndpoint:
    """Accepts connections on ``port`` and holds them open, reading nothing, sending nothing."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._connections: list[socket.socket] = []
        self._is_closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        self._is_closed = True
        self._listener.close()
        for connection in self._connections:
            connection.close()

    def _accept(self) -> None:
        while not self._is_closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self._connections.append(connection)


@pytest.fixture
def stalled_endpoint():
    endpoint = StalledEndpoint()
    yield endpoint
    endpoint.close()
