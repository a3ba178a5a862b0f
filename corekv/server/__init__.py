"""``corekv serve``: an OpenAI-compatible HTTP server over one :class:`corekv.Engine`.

``build_app(engine)`` is the FastAPI app (:mod:`corekv.server.app`), ``serve(config, host, port)``
runs it in the foreground and ``BackgroundServer(app)`` in a thread (:mod:`corekv.server.serving`);
``AsyncEngine`` (:mod:`corekv.server.async_engine`) is the engine thread between them.
"""
from corekv._lazy import lazy_getattr

_LAZY = {"build_app": "corekv.server.app", "serve": "corekv.server.serving",
         "BackgroundServer": "corekv.server.serving", "AsyncEngine": "corekv.server.async_engine"}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
