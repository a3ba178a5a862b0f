"""corekv: a plugin-style KV-cache framework with tiered offload for LLM inference."""
from __future__ import annotations

from corekv._lazy import lazy_getattr
from corekv.engine.cpu.threads import prefer_passive_wait
from corekv.errors import ConfigError, CoreKVError, PluginError
from corekv.plugin import available_plugins, hookimpl, make_plugin_manager

__version__ = "0.1.0"

# NOTE: before anything imports torch, whose OpenMP runtime reads its wait policy once when it
# starts: corekv's threads wait passively, so a shared CPU does not stall them (engine/cpu/threads.py).
prefer_passive_wait()

# NOTE: the engine pulls in torch and transformers; importing corekv for its config, hashing or
# backends must not, so these names load on first use.
_LAZY = {
    "load_config": "corekv.config",
    "Config": "corekv.config",
    "Engine": "corekv.engine.llm_engine",
    "RequestOutput": "corekv.engine.outputs",
    "SamplingParams": "corekv.engine.sampling",
    "bench": "corekv.bench",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [
    "Config",
    "ConfigError",
    "CoreKVError",
    "Engine",
    "PluginError",
    "RequestOutput",
    "SamplingParams",
    "available_plugins",
    "bench",
    "hookimpl",
    "load_config",
    "make_plugin_manager",
]
