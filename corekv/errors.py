"""corekv's exception types. Every message says what was received, what was expected, and the fix."""


class CoreKVError(Exception):
    """Base of every error corekv raises on purpose."""


class ConfigError(CoreKVError, ValueError):
    """A configuration value is invalid; the message names the field path (``cache.tiers[1].size``)."""


class PluginError(CoreKVError):
    """A plugin failed to load or registered something inconsistent; the message names the plugin."""
