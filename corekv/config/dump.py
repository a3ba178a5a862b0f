"""A :class:`~corekv.config.schema.Config` written back as plain, YAML-ready data."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, fields, is_dataclass
from typing import Any

from corekv.config.schema import CacheConfig, Config, PinnedPrefix, TierConfig
from corekv.config.values import format_size


def dump_config(cfg: Config, *, plugin_manager: Any = None) -> dict[str, Any]:
    """``cfg`` as plain YAML-ready data that :func:`load_config` turns back into an equal config.

    Sizes are written with units where exact (``256MiB``). Tier, backend and plugin section
    options of kind ``size`` are too when ``plugin_manager`` is given (they are plain byte counts
    otherwise). Each plugin section is a top-level key, where ``sections`` is in the dataclass.
    """
    if not isinstance(cfg, Config):
        raise TypeError(f"dump_config(cfg=...) got {cfg!r}; expected a corekv.Config from load_config")
    backends = plugin_manager.backends() if plugin_manager is not None else {}
    tiers = plugin_manager.tiers() if plugin_manager is not None else {}
    sections = plugin_manager.config_sections() if plugin_manager is not None else {}

    def options(values: Mapping[str, Any], spec: Any) -> dict[str, Any]:
        kinds = {n: o.kind for n, o in spec.options.items()} if spec is not None else {}
        return {k: format_size(v) if kinds.get(k) == "size" and isinstance(v, int) else _plain(v)
                for k, v in values.items()}

    def dump(obj: Any) -> Any:
        if isinstance(obj, Config):
            data = {}
            for f in fields(obj):
                if f.name == "sections":
                    data.update({name: options(values, sections.get(name))
                                 for name, values in obj.sections.items()})
                else:
                    data[f.name] = _dump_field(f, getattr(obj, f.name), dump)
            return data
        if isinstance(obj, TierConfig):
            entry = {"type": obj.type} | ({} if obj.name == obj.type else {"name": obj.name})
            return entry | ({"required": True} if obj.required else {}) | options(obj.options, tiers.get(obj.type))
        if isinstance(obj, PinnedPrefix):
            return {k: v for k, v in _dump_fields(obj, dump).items() if v is not None}
        if isinstance(obj, CacheConfig):
            data = _dump_fields(obj, dump)
            data["backend_options"] = options(obj.backend_options, backends.get(obj.backend))
            return data
        if is_dataclass(obj):
            return _dump_fields(obj, dump)
        return _plain(obj)

    return dump(cfg)


def _dump_fields(obj: Any, dump: Any) -> dict[str, Any]:
    return {f.name: _dump_field(f, getattr(obj, f.name), dump) for f in fields(obj)}


def _dump_field(f: Field, value: Any, dump: Any) -> Any:
    if f.metadata["check"].get("kind") == "size" and isinstance(value, int):
        return format_size(value)
    if isinstance(value, tuple) and f.name != "token_ids":
        return [dump(v) for v in value]
    return dump(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value
