"""Running the app under uvicorn: :func:`serve` in the foreground (``corekv serve``), with a
graceful shutdown on SIGTERM / SIGINT, and :class:`BackgroundServer` in a thread (tests, notebooks).

A graceful shutdown stops accepting connections, lets the requests in flight finish (for at most
``drain_timeout`` seconds; then they are cancelled, which aborts them), stops the engine thread and
closes the engine, which writes pending write-back blocks to the storage tiers.
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
import socket
import threading
import time
from typing import Any

__all__ = ["serve", "BackgroundServer", "bind_socket", "LOG_LEVELS"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve(config: Any, host: str = "127.0.0.1", port: int = 8000, *,
          served_model_name: str | None = None, drain_timeout: float = 30.0,
          log_level: str = "info", api_key: str | None = None,
          max_request_bytes: int | None = None, plugin_manager: Any = None,
          api_keys: Any = None) -> None:
    """Serve one engine built from ``config`` (a :class:`corekv.Config`, a mapping or a YAML path)
    on ``host:port`` until SIGTERM or SIGINT, then shut down gracefully and return.

    ``api_key``, ``api_keys`` (a :class:`corekv.server.tenants.TenantKeys`) and ``max_request_bytes`` (default: ``DEFAULT_MAX_REQUEST_BYTES``) are
    :func:`corekv.server.app.build_app`'s; ``plugin_manager`` is the one ``config`` was checked
    against (see :meth:`corekv.Engine.from_config`). The port is bound before the model loads, so
    a taken port fails at once.
    :raises OSError: the address cannot be bound (message names host, port and the fix).
    """
    _check_args(host, port, drain_timeout, log_level)
    import uvicorn

    from corekv.engine.llm_engine import Engine
    from corekv.server.app import build_app
    from corekv.server.auth import check_api_key
    from corekv.server.limits import DEFAULT_MAX_REQUEST_BYTES, check_max_request_bytes

    if api_key is not None:  # NOTE: before the model loads, like the other arguments
        check_api_key(api_key)
    if api_key is not None and api_keys is not None:
        raise ValueError("pass api_key or api_keys (per-tenant keys), not both")
    if max_request_bytes is None:
        max_request_bytes = DEFAULT_MAX_REQUEST_BYTES
    check_max_request_bytes(max_request_bytes)

    sock = bind_socket(host, port)
    try:
        engine = Engine.from_config(config, plugin_manager=plugin_manager)
    except BaseException:
        sock.close()
        raise
    app = None
    try:
        app = build_app(engine, served_model_name=served_model_name, close_engine=True,
                        api_key=api_key, max_request_bytes=max_request_bytes, api_keys=api_keys)
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level,
                                               timeout_graceful_shutdown=drain_timeout))
        logging.getLogger("uvicorn.error").info("corekv serving %s on http://%s:%d",
                                                app.state.model_id, host, sock.getsockname()[1])
        with _graceful_signals():
            server.run(sockets=[sock])
    finally:
        # NOTE: after a forced exit (a second Ctrl-C) uvicorn skips the app's shutdown: stop the
        # engine thread here, so the engine is still closed and its write-back flushed.
        if app is None:
            engine.close()
        elif not app.state.async_engine.stop(timeout=drain_timeout + 60):
            logging.getLogger(__name__).error("the engine thread did not stop; tier writes may be lost")
        sock.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one; read it with getsockname)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise OSError(f"--host: cannot resolve {host!r} ({e}); pass an address such as 127.0.0.1 "
                      "or 0.0.0.0") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or "
                      "stop the process that uses it") from None
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """An app served by uvicorn in a daemon thread on a loopback port; a context manager.

    Invariants: ``url`` is set once :meth:`start` returns and the app has run its startup;
    :meth:`stop` shuts down gracefully (the app's shutdown runs) and waits for the thread.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 drain_timeout: float = 5.0, startup_timeout: float = 60.0):
        _check_args(host, port, drain_timeout, "warning")
        import uvicorn

        self.app, self.host, self.startup_timeout = app, host, startup_timeout
        self._sock = bind_socket(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=drain_timeout))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="corekv-http", daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True  # NOTE: and free the port: nobody calls stop()
                self._thread.join(self.startup_timeout)
                self._sock.close()
                raise RuntimeError(f"the server on {self.url} did not start within "
                                   f"{self.startup_timeout} s (see its log)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


@contextlib.contextmanager
def _graceful_signals():
    """SIGTERM and SIGINT end ``serve`` normally (exit 0) after the graceful shutdown.

    NOTE: uvicorn restores the previous handlers after its shutdown and re-raises the signal it
    caught; with the defaults that kills the process by SIGTERM or raises KeyboardInterrupt. A
    no-op handler meanwhile makes that re-raise harmless.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_args(host: Any, port: Any, drain_timeout: Any, log_level: Any) -> None:
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host must be a non-empty string, got {host!r}; pass e.g. '127.0.0.1' "
                         "(this machine only) or '0.0.0.0' (every interface)")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in 0..65535, got {port!r}; pass e.g. 8000 "
                         "(0 picks a free port)")
    if (not isinstance(drain_timeout, (int, float)) or isinstance(drain_timeout, bool)
            or not math.isfinite(drain_timeout) or drain_timeout < 0):
        raise ValueError(f"drain_timeout must be a finite number of seconds >= 0, got "
                         f"{drain_timeout!r}; pass e.g. 30")
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
