"""The plugin manager (the spec types plugins return live in :mod:`corekv.specs`, re-exported here).

There is no global plugin manager: :func:`make_plugin_manager` builds one. It loads the modules
registered under the ``corekv`` entry-point group (corekv's own builtin backends and tiers are
registered there exactly like third-party ones), then any modules named in the config's
``plugins:`` list or passed in ``plugins=``.

Set ``COREKV_DISABLE_PLUGIN_AUTOLOAD=1`` to load only corekv's own entry points (tests use it to
stay hermetic from whatever else is installed in the environment).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import pluggy

from corekv import hookspecs
from corekv.errors import PluginError
from corekv.specs import (
    OPTION_KINDS, AdmissionPolicySpec, BackendSpec, ConfigSectionSpec, EvictionPolicySpec, Option, TierSpec,
)

ENTRY_POINT_GROUP = "corekv"
AUTOLOAD_ENV = "COREKV_DISABLE_PLUGIN_AUTOLOAD"
OWN_DISTRIBUTION = "corekv"

hookimpl = pluggy.HookimplMarker("corekv")

#: re-exported: plugins import the spec types from here (``from corekv.plugin import Option, TierSpec``)
__all__ = [
    "AUTOLOAD_ENV", "AdmissionPolicySpec", "BackendSpec", "ConfigSectionSpec", "ENTRY_POINT_GROUP",
    "EvictionPolicySpec",
    "OPTION_KINDS", "Option",
    "PluginManager", "TierSpec", "available_plugins", "hook_signature", "hook_signatures", "hookimpl",
    "make_plugin_manager", "option_info",
]


class _CorekvPluggy(pluggy.PluginManager):
    """pluggy's manager, but every ``corekv_*`` function of a plugin counts as a hook
    implementation, marked or not.

    NOTE: pluggy only looks at marked functions, so a forgotten ``@hookimpl`` would be silently
    ignored; treating the ``corekv_`` prefix as the mark (as pytest does for ``pytest_``) means a
    misspelled name reaches ``check_pending`` and fails loudly instead.
    """

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("corekv_"):
            attr = inspect.getattr_static(plugin, name, None)
            if inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod)):
                return {}
        return opts


class PluginManager:
    """A typed facade over a :class:`pluggy.PluginManager` for corekv's hooks.

    Invariant: every registered plugin's hook implementations name a ``corekv_*`` hookspec
    (checked on every registration), and backend, tier and config section names are unique across
    plugins (checked each time :meth:`backends` / :meth:`tiers` / :meth:`config_sections` collects
    them).
    """

    def __init__(self, pm: pluggy.PluginManager, module_to_distribution: dict[str, str]):
        self.pm = pm
        self.hook = pm.hook
        self._module_to_distribution = module_to_distribution

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register one more plugin object or module; returns the name it is registered under."""
        return _register(self.pm, plugin, name or _plugin_object_name(plugin))

    def resolve_model(self, name: str) -> str | None:
        """The local path a plugin resolves the model alias ``name`` to, or ``None``."""
        return self.hook.corekv_resolve_model(name=name)

    def backends(self) -> dict[str, BackendSpec]:
        return self._collect(self.hook.corekv_register_backends, "backend")

    def tiers(self) -> dict[str, TierSpec]:
        return self._collect(self.hook.corekv_register_tiers, "tier")

    def eviction_policies(self) -> dict[str, EvictionPolicySpec]:
        """``{policy name: spec}`` of the eviction policies plugins register."""
        return self._collect(self.hook.corekv_register_eviction_policies, "eviction policy")

    def admission_policies(self) -> dict[str, AdmissionPolicySpec]:
        """``{policy name: spec}`` of the admission policies plugins register."""
        return self._collect(self.hook.corekv_register_admission_policies, "admission policy")

    def config_sections(self) -> dict[str, ConfigSectionSpec]:
        """``{section name: spec}`` of the top-level config sections plugins declare."""
        return self._collect(self.hook.corekv_register_config_sections, "config section")

    def plugin_names(self) -> dict[str, str]:
        """``{plugin name: distribution}`` for every registered plugin."""
        return {
            name: self._module_to_distribution.get(name, "")
            for name, _ in self.pm.list_name_plugin()
            if name is not None
        }

    def _collect(self, hook, what: str) -> dict:
        spec_type = _SPEC_TYPES[what]
        specs: dict[str, Any] = {}
        for impl in hook.get_hookimpls():  # registration order (pluggy calls them in reverse)
            plugin_name = self.pm.get_name(impl.plugin) or ""
            try:
                returned = impl.function()
            except Exception as e:
                raise PluginError(
                    f"plugin {plugin_name!r} failed in {hook.name}() ({type(e).__name__}: {e}); "
                    "fix or uninstall the package that provides it"
                ) from e
            for spec in _checked_specs(returned, spec_type, plugin_name, hook.name):
                if spec.name in specs:
                    raise PluginError(
                        f"{what} {spec.name!r} is registered twice: by plugin "
                        f"{specs[spec.name].plugin!r} and by plugin {plugin_name!r}; "
                        "uninstall or rename one of them"
                    )
                specs[spec.name] = type(spec)(
                    **{**spec.__dict__, "plugin": plugin_name,
                       "distribution": self._module_to_distribution.get(plugin_name, "")}
                )
        return specs


_SPEC_TYPES = {"backend": BackendSpec, "tier": TierSpec, "config section": ConfigSectionSpec,
               "eviction policy": EvictionPolicySpec, "admission policy": AdmissionPolicySpec}
#: a section name is also the COREKV_<SECTION>__<KEY> variable's first part (read lowercased)
_SECTION_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


def _checked_specs(returned: Any, spec_type: type, plugin_name: str, hook_name: str) -> list:
    """The specs a registration hook returned, after checking their shape (a plugin bug
    otherwise surfaces far away, when the engine calls a factory)."""
    where = f"plugin {plugin_name!r}: {hook_name}()"
    if returned is None:
        return []
    if not isinstance(returned, (list, tuple)):
        raise PluginError(f"{where} returned {returned!r}; expected a list of {spec_type.__name__}")
    for spec in returned:
        if not isinstance(spec, spec_type):
            raise PluginError(f"{where} returned {spec!r} in its list; expected {spec_type.__name__} objects")
        if not isinstance(spec.name, str) or not spec.name:
            raise PluginError(f"{where} returned a {spec_type.__name__} named {spec.name!r}; expected a non-empty string")
        if not isinstance(spec, ConfigSectionSpec) and not callable(spec.factory):
            raise PluginError(f"{where}: {spec.name!r} has factory {spec.factory!r}; expected a callable")
        if getattr(spec, "admin", None) is not None and not callable(spec.admin):
            raise PluginError(f"{where}: {spec.name!r} has admin {spec.admin!r}; expected a callable or None")
        if not isinstance(spec.options, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Option) for k, v in spec.options.items()
        ):
            raise PluginError(f"{where}: {spec.name!r} has options {spec.options!r}; expected a mapping of str to corekv.plugin.Option")
        if isinstance(spec, ConfigSectionSpec):
            _check_section_spec(spec, where)
    return list(returned)


def _check_section_spec(spec: ConfigSectionSpec, where: str) -> None:
    if not _SECTION_NAME.fullmatch(spec.name):
        raise PluginError(f"{where} returned a ConfigSectionSpec named {spec.name!r}; expected lowercase "
                          "letters, digits and single underscores (it is also COREKV_<NAME>__<KEY>), "
                          "e.g. 'kv_events'")
    if spec.check is not None and not callable(spec.check):
        raise PluginError(f"{where}: {spec.name!r} has check {spec.check!r}; expected a callable or None")
    # NOTE: a section's values are read as attributes too (config.kv_events.endpoint), so an option
    # may not be named like a method of the mapping that holds them.
    hidden = sorted(k for k in spec.options if not k.isidentifier() or k.startswith("_") or hasattr(Mapping, k))
    if hidden:
        raise PluginError(f"{where}: {spec.name!r} has options named {hidden}; expected identifiers "
                          "that do not start with _ and are not mapping methods (get, items, keys, "
                          "values): rename them")


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _import_plugin(target: str, origin: str) -> Any:
    """Import ``module`` or ``module:attribute`` (the entry-point value syntax)."""
    module_name, _, attribute = target.partition(":")
    try:
        plugin = importlib.import_module(module_name)
        for part in attribute.split(".") if attribute else ():
            plugin = getattr(plugin, part)
        return plugin
    except Exception as e:
        raise PluginError(
            f"plugin {origin} failed to import ({type(e).__name__}: {e}); "
            "fix or uninstall the package that provides it"
        ) from e


def _plugin_object_name(plugin: object) -> str:
    if isinstance(plugin, ModuleType):
        return plugin.__name__
    return getattr(plugin, "__name__", None) or type(plugin).__name__


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> str:
    if pm.has_plugin(name):
        raise PluginError(
            f"two plugins are named {name!r} ({pm.get_plugin(name)!r} and {plugin!r}); "
            "rename one of them or uninstall one of the packages that provide them"
        )
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except (pluggy.PluginValidationError, ValueError) as e:
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        detail = " ".join(str(e).split())  # NOTE: pluggy's messages span lines; errors are one line
        raise PluginError(
            f"plugin {name!r} is invalid: {detail}; hook implementations must be named after a "
            "corekv_* hookspec (see docs/plugins.md) and take only that hook's arguments"
        ) from e
    return name


def make_plugin_manager(plugins: Iterable[str | object] = (), *, autoload: bool | None = None) -> PluginManager:
    """Build a plugin manager with corekv's hooks and load plugins.

    :param plugins: extra plugins: module names (``"my_package.my_plugin"``) or objects.
    :param autoload: load third-party entry points; default: unless ``COREKV_DISABLE_PLUGIN_AUTOLOAD``
        is set. corekv's own entry points are always loaded.
    """
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Iterable):
        raise TypeError(
            f"make_plugin_manager(plugins=...) got {plugins!r}; expected a list of module names or "
            "plugin objects, e.g. plugins=['my_package.my_plugin']"
        )
    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_ENV)
    pm = _CorekvPluggy("corekv")
    pm.add_hookspecs(hookspecs)
    module_to_distribution: dict[str, str] = {}
    seen_targets: set[str] = set()
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else ""
        if not autoload and dist != OWN_DISTRIBUTION:
            continue
        if ep.value in seen_targets:  # the same module can be listed by several installs
            continue
        origin = f"{ep.name!r} (entry point {ep.name} = {ep.value} in group {ENTRY_POINT_GROUP!r} of distribution {dist or 'unknown'!r})"
        plugin = _import_plugin(ep.value, origin)
        _register(pm, plugin, ep.name)
        seen_targets.add(ep.value)
        module_to_distribution[ep.name] = dist
    for plugin in plugins:
        if isinstance(plugin, str):
            if plugin in seen_targets or pm.has_plugin(plugin):
                continue
            module = _import_plugin(plugin, f"{plugin!r} (listed in plugins:)")
            _register(pm, module, plugin)
            seen_targets.add(plugin)
            module_to_distribution[plugin] = _distribution_of(plugin)
        else:
            _register(pm, plugin, _plugin_object_name(plugin))
    return PluginManager(pm, module_to_distribution)


def _distribution_of(module_name: str) -> str:
    top = module_name.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    return dists[0] if dists else ""


def available_plugins(plugins: Iterable[str | object] = ()) -> dict[str, dict[str, dict[str, str]]]:
    """``{"backends": {name: info}, "tiers": {name: info}, "config_sections": {name: info},
    "eviction_policies": {name: info}, "admission_policies": {name: info}, "plugins": {name: info}}``.

    ``info`` has ``description``, ``plugin`` (the plugin that registered it), ``distribution``
    and ``options`` (``{name: {"kind", "required", "default", "choices", "minimum", "help"}}``).
    """
    manager = make_plugin_manager(plugins)
    describe = lambda spec: {"description": spec.description, "plugin": spec.plugin,
                             "distribution": spec.distribution,
                             "options": {n: option_info(o) for n, o in spec.options.items()}}
    return {
        "backends": {n: describe(s) for n, s in sorted(manager.backends().items())},
        "tiers": {n: describe(s) for n, s in sorted(manager.tiers().items())},
        "config_sections": {n: describe(s) for n, s in sorted(manager.config_sections().items())},
        "eviction_policies": {n: describe(s) for n, s in sorted(manager.eviction_policies().items())},
        "admission_policies": {n: describe(s) for n, s in sorted(manager.admission_policies().items())},
        "plugins": {n: {"distribution": d} for n, d in sorted(manager.plugin_names().items())},
    }


def option_info(option: Option) -> dict[str, Any]:
    """A JSON-friendly description of an :class:`Option`."""
    return {
        "kind": option.kind,
        "required": option.is_required,
        "default": None if option.is_required else option.default,
        "choices": list(option.choices),
        "minimum": option.minimum,
        "help": option.help,
    }


def hook_signature(function: Callable[..., Any]) -> str:
    """``name(arg: type, ...) -> type`` of a hookspec, as ``docs/plugins.md`` headings spell it.

    NOTE: hookspecs.py uses postponed annotations, so they are strings; ``inspect`` would quote
    them, and the docs should read like the source.
    """
    def text(annotation: Any) -> str:
        if annotation is inspect.Signature.empty:
            return ""
        return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

    signature = inspect.signature(function)
    params = []
    for param in signature.parameters.values():
        annotation = text(param.annotation)
        params.append(f"{param.name}: {annotation}" if annotation else param.name)
    returns = text(signature.return_annotation)
    return f"{function.__name__}({', '.join(params)})" + (f" -> {returns}" if returns else "")


def hook_signatures() -> dict[str, str]:
    """``{hook name: hook_signature}`` for every hookspec in :mod:`corekv.hookspecs`, in source order."""
    specs = [
        value for name, value in vars(hookspecs).items()
        if name.startswith("corekv_") and inspect.isfunction(value)
    ]
    specs.sort(key=lambda f: f.__code__.co_firstlineno)
    return {f.__name__: hook_signature(f) for f in specs}
