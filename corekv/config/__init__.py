"""Configuration: frozen dataclasses, one per area, loaded from YAML or a mapping, validated once.

Every field carries its help text and constraints in its metadata; :func:`load_config` validates
against them (and against the option schemas and config sections that plugins declare),
:func:`dump_config` writes a config back as plain data, and :func:`config_reference` renders it
all as the documentation table.

Precedence, lowest first: the defaults, the YAML file (or mapping), then
``COREKV_<SECTION>__<KEY>`` environment variables (``COREKV_ENGINE__BLOCK_SIZE=32``,
``COREKV_MODEL=...``).

The modules, each importing only those above it:

- :mod:`~corekv.config.values`: single values (sizes, kinds, constraints, "did you mean");
- :mod:`~corekv.config.schema`: the dataclasses, :class:`Section`, field metadata;
- :mod:`~corekv.config.reader`: :class:`ConfigReader`, plain data to a checked :class:`Config`;
- :mod:`~corekv.config.sources`: :func:`load_config`, the YAML file and the environment;
- :mod:`~corekv.config.dump`, :mod:`~corekv.config.reference`: a config back to data, and to docs.
"""
from __future__ import annotations

from corekv.config.dump import dump_config
from corekv.config.reader import ConfigReader
from corekv.config.reference import config_reference
from corekv.config.schema import (
    CacheConfig, Config, EngineConfig, IntegrityConfig, PinnedPrefix, Section, SpeculativeConfig, TierConfig,
)
from corekv.config.sources import CONFIG_ENV, ENV_PREFIX, load_config, read_config

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "CacheConfig",
    "Config",
    "ConfigReader",
    "EngineConfig",
    "IntegrityConfig",
    "PinnedPrefix",
    "Section",
    "SpeculativeConfig",
    "TierConfig",
    "config_reference",
    "dump_config",
    "load_config",
    "read_config",
]
