"""corekv: a plugin-style KV-cache framework with tiered offload for LLM inference."""
from corekv.errors import ConfigError, CoreKVError, PluginError
from corekv.plugin import available_plugins, hookimpl, make_plugin_manager

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CoreKVError",
    "PluginError",
    "available_plugins",
    "hookimpl",
    "make_plugin_manager",
]
