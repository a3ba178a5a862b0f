"""Reading plain data (parsed YAML, a mapping, environment overrides applied) into a
:class:`~corekv.config.schema.Config`: every field, every plugin's declared options and sections,
and every rule between fields, checked once, here.

The engine, the factories and the plugins trust what this returns; a rule they would otherwise
re-check in their own words belongs in :class:`ConfigReader` instead.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import Field, fields, is_dataclass, replace
from typing import Any

from corekv.config.schema import (
    CORE_KEYS, CacheConfig, Config, EngineConfig, PinnedPrefix, Section, SpeculativeConfig, TierConfig,
    field_check, field_types, top_level_keys,
)
from corekv.config.values import Check, describe_value, did_you_mean, parse_size
from corekv.errors import ConfigError, PluginError
from corekv.plugin import make_plugin_manager


class ConfigReader:
    """Turns plain data into a :class:`corekv.config.Config`.

    Invariant: every value reaches a dataclass or a :class:`Section` only after passing its
    field's :class:`Check` (or its plugin's declared :class:`corekv.plugin.Option`), and a config
    is returned only after every rule between fields held (a section's own ``check`` included);
    the first bad value raises ``ConfigError`` naming its path, the value, what was expected and
    where it came from (file or variable).
    """

    def __init__(self, plugin_manager: Any, origin: str = "", *, extra_plugins: tuple = ()):
        self.plugin_manager = plugin_manager
        #: plugins besides the config's ``plugins:`` for a manager built here (an engine's own)
        self.extra_plugins = tuple(extra_plugins)
        self.origin = origin
        #: field path -> the environment variable that set it
        self.env_sources: dict[str, str] = {}

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{path or 'config'}: {message}{self.note(path)}", path=path)

    def note(self, path: str) -> str:
        """`` (in cache.yaml)`` or `` (set by COREKV_ENGINE__BLOCK_SIZE)``: where ``path`` came from."""
        note = f" ({self.origin})" if self.origin else ""
        for set_path, var in self.env_sources.items():
            if (path == set_path or path.startswith((set_path + ".", set_path + "["))
                    or set_path.startswith((path + ".", path + "["))):
                note = f" (set by {var})"
        return note

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

    # -- plugins ---------------------------------------------------------------------------------
    def load_plugins(self, raw: Any) -> Any:
        """The plugin manager the config is checked against: the one given, else one built from
        the entry points and ``raw``'s ``plugins:`` (checked first)."""
        if self.plugin_manager is None:
            self.check_top_level_mapping(raw)
            plugins = self.value(raw.get("plugins"), Config, _field(Config, "plugins"), "plugins")
            for i, module in enumerate(plugins):
                self.check_importable(module, f"plugins[{i}]")
            self.plugin_manager = make_plugin_manager([*plugins, *self.extra_plugins])
        return self.plugin_manager

    def section_specs(self, raw: Any) -> dict[str, Any]:
        """``{name: ConfigSectionSpec}`` of the registered sections, sorted by name."""
        specs = self.load_plugins(raw).config_sections()
        for name, spec in specs.items():
            if name in CORE_KEYS or name == "sections":
                raise PluginError(f"plugin {spec.plugin!r} registers the config section {name!r}, "
                                  f"which is corekv's own ({', '.join(CORE_KEYS)}); rename the "
                                  "section in the plugin")
        return dict(sorted(specs.items()))

    def top_level_keys(self, raw: Any) -> list[str]:
        return top_level_keys(self.section_specs(raw))

    # -- sections ------------------------------------------------------------------------------
    def read_config(self, raw: Any) -> Config:
        self.check_top_level_mapping(raw)
        specs = self.section_specs(raw)
        self.check_keys(raw, top_level_keys(specs), "")
        # NOTE: cache is read when absent too, so its backend is checked and the backend's
        # declared defaults are filled in (CacheConfig() alone would leave backend_options empty).
        raw = {"cache": {}, **raw}
        kwargs = {f.name: self.value(raw[f.name], Config, f, f.name)
                  for f in fields(Config) if f.name in raw and f.name != "sections"}
        kwargs["sections"] = {name: self.section(spec, raw[name] if name in raw else {}, name)
                              for name, spec in specs.items()}
        config = Config(**kwargs)
        self.check_preemption(config)
        return config

    def section(self, spec: Any, raw: Any, path: str) -> Section:
        """A plugin's section: its options checked and filled in, then its ``check``."""
        self.mapping(raw, path, keys=list(spec.options))
        section = Section(spec.name, self.options(raw, spec.options, path, ""))
        if spec.check is None:
            return section
        try:
            spec.check(section)
        except ConfigError as e:
            raise ConfigError(f"{e}{self.note(e.path or path)}", path=e.path or path) from None
        except Exception as e:
            raise PluginError(f"plugin {spec.plugin!r}: the check of config section {spec.name!r} "
                              f"failed ({type(e).__name__}: {e}); fix or uninstall the package that "
                              "provides it") from e
        return section

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
        if cls is SpeculativeConfig:
            self.check_speculative(kwargs, path)
        return cls(**kwargs)

    def fields_of(self, cls: type, raw: Any, path: str, skip: tuple[str, ...] = ()) -> dict:
        self.mapping(raw, path, keys=[f.name for f in fields(cls)])
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
        if "admission" in kwargs:
            self.check_plugin_name(kwargs["admission"], self.plugin_manager.admission_policies(),
                                   _join(path, "admission"), "admission policy")
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
        self.mapping(raw, path)
        self.check_keys(raw, [*extra_keys, *schema], path, owner)
        result = {}
        for name, option in schema.items():
            option_path = _join(path, name)
            if name in raw and not (raw[name] is None and option.default is None):
                result[name] = self.checked(raw[name], self.option_check(option), option_path)
            elif name in raw or not option.is_required:
                default = option.default
                result[name] = parse_size(default) if option.kind == "size" and isinstance(default, str) else default
            else:
                about = f" ({option.help})" if option.help else ""
                raise self.error(option_path, f"missing; expected {Check.for_option(option).expected()}"
                                 f"{about}, required{owner}")
        return result

    def option_check(self, option: Any) -> Check:
        """An option's check; for kind ``eviction`` its choices are the registered policies."""
        check = Check.for_option(option)
        if option.kind == "eviction":
            check = replace(check, choices=tuple(sorted(self.plugin_manager.eviction_policies())))
        return check

    # -- checks ----------------------------------------------------------------------------------
    def check_top_level_mapping(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            # NOTE: the section names in the message need a plugin manager; without one (a file
            # that is not a mapping has no plugins: list) the entry points' sections are listed.
            manager = self.plugin_manager or make_plugin_manager()
            self.mapping(raw, "", keys=top_level_keys(sorted(manager.config_sections())))

    def mapping(self, raw: Any, path: str, keys: list[str] | None = None) -> None:
        if not isinstance(raw, dict):
            with_keys = f" with keys {', '.join(keys)}" if keys else ""
            raise self.error(path, f"got {describe_value(raw)}; expected a mapping{with_keys}")

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

    def check_speculative(self, kwargs: dict, path: str) -> None:
        """The fields given belong to the method chosen: a draft model only with ``draft``, the
        n-gram window only with ``ngram`` (and its minimum at most its maximum).

        NOTE: a field at its default counts as not given, so a dumped config reads back."""
        method = kwargs.get("method")
        given = [name for name in kwargs if name != "method" and kwargs[name] != _default(SpeculativeConfig, name)]
        if method is None and given:
            raise self.error(_join(path, "method"), f"missing, and {', '.join(given)} given; expected "
                             "method: ngram or method: draft (leave engine.speculative out to keep it off)")
        if method == "draft" and kwargs.get("model") is None:
            raise self.error(_join(path, "model"), "missing; expected the draft model for method: "
                             "draft (an alias, a Hugging Face model folder or a .gguf file with the "
                             "target's tokenizer)")
        wrong = {"ngram": ["model"], "draft": ["prompt_lookup_min", "prompt_lookup_max"]}.get(method, [])
        for name in wrong:
            if name in given:
                other = "draft" if method == "ngram" else "ngram"
                raise self.error(_join(path, name), f"got {describe_value(kwargs[name])} with method: "
                                 f"{method}; expected {name} only with method: {other}: remove it")
        low = kwargs.get("prompt_lookup_min", SpeculativeConfig.prompt_lookup_min)
        high = kwargs.get("prompt_lookup_max", SpeculativeConfig.prompt_lookup_max)
        if low > high:
            raise self.error(_join(path, "prompt_lookup_min"), f"got {low}, more than prompt_lookup_max "
                             f"{high}; expected prompt_lookup_min <= prompt_lookup_max")

    def check_preemption(self, config: Config) -> None:
        """``engine.preemption: swap`` parks preempted sequences' KV in a tier whose class says
        ``supports_swap`` (``host``, ``shm``), so ``cache.tiers`` must have one (whether it starts
        is the engine's to find out), and ``engine.prefill_first``, which preempts more often,
        needs swap."""
        if config.engine.prefill_first and config.engine.preemption != "swap":
            raise self.error("engine.prefill_first", "true preempts decodes for waiting prompts, which "
                             "with preemption: recompute computes their KV again; set engine.preemption: "
                             "swap (with a host tier in cache.tiers) or prefill_first: false")
        if config.engine.preemption != "swap":
            return
        specs = self.plugin_manager.tiers()
        types = [t.type for t in config.cache.tiers]
        if not any(_supports_swap(specs[t]) for t in types):
            able = sorted(name for name, spec in specs.items() if _supports_swap(spec))
            raise self.error("engine.preemption", "'swap' parks preempted sequences' KV in a tier "
                             f"that can hold swapped blocks (types: {', '.join(able) or 'none registered'}), "
                             f"but cache.tiers has none (types: {types}); add "
                             "`- {type: host, size: 1GiB}` to cache.tiers or use preemption: recompute")

    def check_importable(self, module: str, path: str) -> None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise self.error(path, f"got {module!r}; expected an importable module name; install "
                             "the package that provides it or fix the name")


def _supports_swap(spec: Any) -> bool:
    """Whether the tier a spec builds declares ``supports_swap`` (read from its factory, the class)."""
    return getattr(spec.factory, "supports_swap", False) is True


def _field(cls: type, name: str) -> Field:
    return next(f for f in fields(cls) if f.name == name)


def _default(cls: type, name: str) -> Any:
    return _field(cls, name).default


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
