"""Reading plain data (parsed YAML, a mapping, environment overrides) into the config dataclasses.

Kept apart from :mod:`corekv.config` so that module stays the readable contract (the dataclasses and
the three public functions) and this one the mechanics of checking them.
"""
from __future__ import annotations

import functools
import importlib.util
import typing
from collections.abc import Mapping
from dataclasses import Field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from corekv.config import (
    ENV_PREFIX, CacheConfig, Config, EngineConfig, PinnedPrefix, TierConfig,
)
from corekv.config_values import Check, describe_value, did_you_mean, parse_size
from corekv.errors import ConfigError


@functools.cache
def field_types(cls: type) -> dict[str, tuple[Any, bool, bool]]:
    """``{field: (item type, is a list, accepts None)}`` from the dataclass's type hints."""
    result = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        is_list = typing.get_origin(hint) is tuple
        result[name] = (typing.get_args(hint)[0] if is_list else hint, is_list, optional)
    return result


def field_check(cls: type, f: Field) -> Check:
    """The :class:`Check` a scalar field (or each item of a list field) must pass."""
    check = dict(f.metadata["check"])
    item_type = field_types(cls)[f.name][0]
    kind = check.pop("kind", None) or {int: "int", float: "float", str: "str", bool: "bool"}[item_type]
    return Check(kind, **check)


class ConfigReader:
    """Turns plain data into a :class:`corekv.config.Config`.

    Invariant: every value reaches a dataclass only after passing its field's :class:`Check` (or
    its plugin's declared :class:`corekv.plugin.Option`); the first bad one raises ``ConfigError``
    naming its path, the value, what was expected and where it came from (file or variable).
    """

    def __init__(self, plugin_manager: Any, origin: str = ""):
        self.plugin_manager = plugin_manager
        self.origin = origin
        #: field path -> the environment variable that set it
        self.env_sources: dict[str, str] = {}

    def error(self, path: str, message: str) -> ConfigError:
        note = f" ({self.origin})" if self.origin else ""
        for set_path, var in self.env_sources.items():
            if (path == set_path or path.startswith((set_path + ".", set_path + "["))
                    or set_path.startswith((path + ".", path + "["))):
                note = f" (set by {var})"
        return ConfigError(f"{path or 'config'}: {message}{note}", path=path)

    def plain(self, value: Any, path: str = "") -> Any:
        """A deep copy with dicts and lists only (keys checked to be strings)."""
        if isinstance(value, Mapping):
            for key in value:
                if not isinstance(key, str):
                    raise self.error(path, f"has key {describe_value(key)}; expected string keys")
            return {k: self.plain(v, _join(path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    # -- sections ------------------------------------------------------------------------------
    def read_config(self, raw: Any) -> Config:
        self.mapping(raw, "", Config)
        if self.plugin_manager is None:
            from corekv.plugin import make_plugin_manager

            plugins = self.value(raw.get("plugins"), Config, _field(Config, "plugins"), "plugins")
            for i, module in enumerate(plugins):
                self.check_importable(module, f"plugins[{i}]")
            self.plugin_manager = make_plugin_manager(plugins)
        return self.dataclass(Config, raw, "")

    def dataclass(self, cls: type, raw: Any, path: str) -> Any:
        if cls is CacheConfig:
            return self.cache(raw, path)
        kwargs = self.fields_of(cls, raw, path)
        if cls is EngineConfig:
            if kwargs.get("num_blocks") is not None:
                kwargs["kv_cache_memory"] = None  # NOTE: documented: num_blocks wins
            elif "kv_cache_memory" in kwargs and kwargs["kv_cache_memory"] is None:
                raise self.error(_join(path, "kv_cache_memory"), "got None and num_blocks is not "
                                 "set; expected a pool size such as 256MiB, or num_blocks: N")
        if cls is PinnedPrefix:
            self.check_pinned(kwargs, path)
        return cls(**kwargs)

    def fields_of(self, cls: type, raw: Any, path: str, skip: tuple[str, ...] = ()) -> dict:
        self.mapping(raw, path, cls)
        self.check_keys(raw, [f.name for f in fields(cls)], path)
        return {f.name: self.value(raw[f.name], cls, f, _join(path, f.name))
                for f in fields(cls) if f.name in raw and f.name not in skip}

    def cache(self, raw: Any, path: str) -> CacheConfig:
        special = ("backend", "backend_options", "tiers")
        kwargs = self.fields_of(CacheConfig, raw, path, skip=special)
        backend_path = _join(path, "backend")
        backend = self.value(raw.get("backend", "radix"), CacheConfig,
                             _field(CacheConfig, "backend"), backend_path)
        backends = self.plugin_manager.backends()
        self.check_plugin_name(backend, backends, backend_path, "backend")
        options_path = _join(path, "backend_options")
        kwargs["backend_options"] = self.options(
            raw.get("backend_options") or {}, backends[backend].options, options_path,
            f" for backend {backend!r}")
        tiers = [self.tier(entry, f"{_join(path, 'tiers')}[{i}]")
                 for i, entry in enumerate(self.list_of(raw.get("tiers"), _join(path, "tiers")))]
        for i, tier in enumerate(tiers):
            first = next(j for j, other in enumerate(tiers) if other.name == tier.name)
            if first != i:
                raise self.error(f"{_join(path, 'tiers')}[{i}].name", f"got {tier.name!r}, the "
                                 f"name of {_join(path, 'tiers')}[{first}] too; expected a "
                                 "unique name: set name: on one of them")
        return CacheConfig(backend=backend, tiers=tuple(tiers), **kwargs)

    def tier(self, raw: Any, path: str) -> TierConfig:
        if not isinstance(raw, dict):
            raise self.error(path, f"got {describe_value(raw)}; expected a mapping such as "
                             "{type: host, size: 2GiB}")
        specs = self.plugin_manager.tiers()
        if "type" not in raw:
            raise self.error(_join(path, "type"), "missing; expected a tier type: one of "
                             + (", ".join(sorted(specs)) or "(none registered)"))
        tier_type = self.value(raw["type"], TierConfig, _field(TierConfig, "type"), _join(path, "type"))
        self.check_plugin_name(tier_type, specs, _join(path, "type"), "tier type")
        name = self.value(raw.get("name", tier_type), TierConfig, _field(TierConfig, "name"),
                          _join(path, "name"))
        required = self.value(raw.get("required", False), TierConfig, _field(TierConfig, "required"),
                              _join(path, "required"))
        rest = {k: v for k, v in raw.items() if k not in ("type", "name", "required")}
        options = self.options(rest, specs[tier_type].options, path, f" for tier {tier_type!r}",
                               extra_keys=("type", "name", "required"))
        return TierConfig(type=tier_type, name=name, options=options, required=required)

    # -- values ----------------------------------------------------------------------------------
    def value(self, raw: Any, cls: type, f: Field, path: str) -> Any:
        item_type, is_list, optional = field_types(cls)[f.name]
        if raw is None and optional:
            return None
        if is_list:
            items = self.list_of(raw, path)
            return tuple(self.item(v, item_type, cls, f, f"{path}[{i}]") for i, v in enumerate(items))
        return self.item(raw, item_type, cls, f, path)

    def item(self, raw: Any, item_type: Any, cls: type, f: Field, path: str) -> Any:
        if is_dataclass(item_type):
            return self.dataclass(item_type, raw, path)
        return self.checked(raw, field_check(cls, f), path)

    def checked(self, raw: Any, check: Check, path: str) -> Any:
        ok, value = check.convert(raw)
        if not ok:
            raise self.error(path, f"got {describe_value(raw)}; expected {check.expected()}"
                             f"{check.hint(raw)}")
        return value

    def options(self, raw: Any, schema: Mapping[str, Any], path: str, owner: str,
                extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
        """Validate ``raw`` against a plugin's ``{name: Option}`` schema; fill in defaults."""
        self.mapping(raw, path, None)
        self.check_keys(raw, [*extra_keys, *schema], path, owner)
        result = {}
        for name, option in schema.items():
            option_path = _join(path, name)
            if name in raw and not (raw[name] is None and option.default is None):
                check = Check(option.kind, choices=tuple(option.choices), minimum=option.minimum)
                result[name] = self.checked(raw[name], check, option_path)
            elif name in raw or not option.is_required:
                default = option.default
                result[name] = parse_size(default) if option.kind == "size" and isinstance(default, str) else default
            else:
                check = Check(option.kind, choices=tuple(option.choices), minimum=option.minimum)
                about = f" ({option.help})" if option.help else ""
                raise self.error(option_path, f"missing; expected {check.expected()}{about}, "
                                 f"required{owner}")
        return result

    # -- checks ----------------------------------------------------------------------------------
    def mapping(self, raw: Any, path: str, cls: type | None) -> None:
        if not isinstance(raw, dict):
            keys = f" with keys {', '.join(f.name for f in fields(cls))}" if cls else ""
            raise self.error(path, f"got {describe_value(raw)}; expected a mapping{keys}")

    def list_of(self, raw: Any, path: str) -> list:
        if raw is None:  # NOTE: `tiers:` with every entry commented out is an empty list
            return []
        if not isinstance(raw, list):
            raise self.error(path, f"got {describe_value(raw)}; expected a list")
        return raw

    def check_keys(self, raw: dict, valid: list[str], path: str, owner: str = "") -> None:
        for key in raw:
            if key not in valid:
                hint = did_you_mean(key, valid)
                raise self.error(_join(path, key), f"unknown key{owner} (value "
                                 f"{describe_value(raw[key])}){hint}{' V' if hint else '; v'}"
                                 f"alid keys: {', '.join(valid) or '(none)'}")

    def check_plugin_name(self, name: str, specs: Mapping[str, Any], path: str, what: str) -> None:
        if name not in specs:
            hint = did_you_mean(name, specs)
            fix = "" if hint else "; install the plugin that provides it or list its module under plugins:"
            registered = ", ".join(sorted(specs)) or "none are registered"
            raise self.error(path, f"got {name!r}; expected a registered {what} ({registered}){hint}{fix}")

    def check_pinned(self, kwargs: dict, path: str) -> None:
        text, token_ids = kwargs.get("text"), kwargs.get("token_ids")
        if (text is None) == (token_ids is None):
            got = "both text and token_ids" if text is not None else "neither text nor token_ids"
            raise self.error(path, f"got {got}; expected exactly one of them, e.g. "
                             "{text: 'You are a helpful assistant.'}")
        if token_ids == ():
            raise self.error(_join(path, "token_ids"), "got []; expected at least one token id")
        if token_ids is not None and kwargs.get("chat"):
            raise self.error(_join(path, "chat"), "got true with token_ids; expected chat: true "
                             "only with text (token ids are used as given)")

    def check_importable(self, module: str, path: str) -> None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise self.error(path, f"got {module!r}; expected an importable module name; install "
                             "the package that provides it or fix the name")


def apply_env_overrides(raw: dict, env: Mapping[str, str], reader: ConfigReader) -> None:
    """Set ``COREKV_<SECTION>__<KEY>[__<KEY>...]`` variables into ``raw`` (shallowest first).

    A one-part name counts only if it is a top-level field (``COREKV_MODEL``), so unrelated
    variables like ``COREKV_CONFIG`` pass through; a name with ``__`` must name a real section.
    """
    top = [f.name for f in fields(Config)]
    overrides = []
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        parts = var[len(ENV_PREFIX):].lower().split("__")
        if len(parts) == 1 and parts[0] not in top:
            continue
        overrides.append((len(parts), var, parts, text))
    for _, var, parts, text in sorted(overrides):
        if parts[0] not in top or not all(parts):
            hint = did_you_mean(parts[0], top)
            raise ConfigError(f"{var}: unknown config section {parts[0]!r}{hint}"
                              f"{' E' if hint else '; e'}xpected COREKV_<SECTION>__<KEY> with a section among "
                              f"{', '.join(top)} (e.g. COREKV_ENGINE__BLOCK_SIZE=32)", path=parts[0])
        node, path = raw, ""
        for i, part in enumerate(parts):
            if isinstance(node, list) and part.isdigit():
                if int(part) >= len(node):
                    raise ConfigError(f"{var}: {path} has {len(node)} entries, so there is no entry "
                                      f"{part}; expected an index below {len(node)}", path=path)
                key, child_path = int(part), f"{path}[{part}]"
            elif isinstance(node, dict):
                key, child_path = part, _join(path, part)
            else:
                raise ConfigError(f"{var}: cannot set {part!r} inside {path}, which holds "
                                  f"{describe_value(node)}; expected a mapping there", path=path)
            if i == len(parts) - 1:
                node[key] = parse_yaml(text, var, is_env=True)
            else:
                if isinstance(node, dict) and node.get(key) is None:
                    if parts[i + 1].isdigit():
                        raise ConfigError(
                            f"{var}: {child_path} is not set, so it has no entry {parts[i + 1]}; "
                            f"expected the whole list instead, e.g. {ENV_PREFIX}"
                            f"{'__'.join(parts[:i + 1]).upper()}='[...]'", path=child_path)
                    node[key] = {}
                node = node[key]
            path = child_path
        reader.env_sources[path] = var


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping (YAML would keep the
    last silently, which hides typos such as two ``tiers:`` sections)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str, *, is_env: bool = False) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        if is_env:
            raise ConfigError(f"{where}: got {text!r}, which is not valid YAML ({problem}); expected "
                              "a YAML value such as 32, radix, 2GiB or [a, b]") from e
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from e


def read_yaml_file(path: Path, via: str = "") -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r}{via} not found; expected a YAML file: check "
                          "the path (relative paths start at the current directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r}{via} cannot be read ({e}); expected a "
                          "readable UTF-8 YAML file") from e
    data = parse_yaml(text, str(path))
    return {} if data is None else data


def _field(cls: type, name: str) -> Field:
    return next(f for f in fields(cls) if f.name == name)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
