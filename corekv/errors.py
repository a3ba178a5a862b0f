"""corekv's exception types. Every message says what was received, what was expected, and the fix."""
from __future__ import annotations


class CoreKVError(Exception):
    """Base of every error corekv raises on purpose."""


class ConfigError(CoreKVError, ValueError):
    """A configuration value is invalid; the message names the field path (``cache.tiers[1].size``).

    :ivar path: that field path (``None`` when the error is about the whole file), so callers and
        tests can tell which field was rejected without parsing the message.
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class PluginError(CoreKVError):
    """A plugin failed to load or registered something inconsistent; the message names the plugin."""


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: first line of its message"``: a foreign exception (a compiler's, a build's) quoted
    inside a corekv message without its pages of detail."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
