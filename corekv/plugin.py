"""Plugin specs and the plugin manager.

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
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from corekv import hookspecs
from corekv.errors import PluginError

ENTRY_POINT_GROUP = "corekv"
AUTOLOAD_ENV = "COREKV_DISABLE_PLUGIN_AUTOLOAD"
OWN_DISTRIBUTION = "corekv"

hookimpl = pluggy.HookimplMarker("corekv")

_REQUIRED = object()
OPTION_KINDS = ("int", "float", "str", "bool", "size")


@dataclass(frozen=True)
class Option:
    """One option a backend or tier accepts in the config.

    :param kind: ``int``, ``float``, ``str``, ``bool`` or ``size`` (bytes; accepts ``"2GiB"``).
    :param default: the value when the option is absent; omit it to make the option required.
    :param choices: allowed values, if the option is an enumeration.
    :param minimum: smallest allowed value for numbers and sizes.
    """

    kind: str
    default: Any = _REQUIRED
    help: str = ""
    choices: tuple[Any, ...] = ()
    minimum: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in OPTION_KINDS:
            raise ValueError(f"Option kind {self.kind!r} is not one of {OPTION_KINDS}")

    @property
    def is_required(self) -> bool:
        return self.default is _REQUIRED


@dataclass(frozen=True)
class _Spec:
    name: str
    factory: Callable[..., Any]
    options: Mapping[str, Option] = field(default_factory=dict)
    description: str = ""
    #: filled in by the plugin manager: the distribution and module the spec came from
    plugin: str = ""
    distribution: str = ""


@dataclass(frozen=True)
class BackendSpec(_Spec):
    """A prefix-cache backend: ``factory(num_blocks, block_size, **options)`` returns a
    :class:`corekv.backend.PrefixCacheBackend`."""


@dataclass(frozen=True)
class TierSpec(_Spec):
    """A storage tier: ``factory(**options, block_bytes=..., fingerprint=...)`` returns a
    :class:`corekv.tier.Tier` (options as validated from ``cache.tiers[i]``)."""


class PluginManager:
    """A typed facade over a :class:`pluggy.PluginManager` for corekv's hooks."""

    def __init__(self, pm: pluggy.PluginManager, module_to_distribution: dict[str, str]):
        self.pm = pm
        self.hook = pm.hook
        self._module_to_distribution = module_to_distribution

    def register(self, plugin: object, name: str | None = None) -> None:
        self.pm.register(plugin, name=name)
        self.pm.check_pending()

    def backends(self) -> dict[str, BackendSpec]:
        return self._collect(self.hook.corekv_register_backends, "backend")

    def tiers(self) -> dict[str, TierSpec]:
        return self._collect(self.hook.corekv_register_tiers, "tier")

    def plugin_names(self) -> dict[str, str]:
        """``{plugin name: distribution}`` for every registered plugin."""
        return {
            name: self._module_to_distribution.get(name, "")
            for name, _ in self.pm.list_name_plugin()
            if name is not None
        }

    def _collect(self, hook, what: str) -> dict:
        specs: dict[str, _Spec] = {}
        for impl in reversed(hook.get_hookimpls()):  # registration order
            plugin_name = self.pm.get_name(impl.plugin) or ""
            for spec in impl.function() or []:
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


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _import_plugin(module_name: str, origin: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise PluginError(
            f"plugin {origin} failed to import ({type(e).__name__}: {e}); "
            "fix or uninstall the package that provides it"
        ) from e


def make_plugin_manager(plugins: Iterable[str | object] = (), *, autoload: bool | None = None) -> PluginManager:
    """Build a plugin manager with corekv's hooks and load plugins.

    :param plugins: extra plugins: module names (``"my_package.my_plugin"``) or objects.
    :param autoload: load third-party entry points; default: unless ``COREKV_DISABLE_PLUGIN_AUTOLOAD``
        is set. corekv's own entry points are always loaded.
    """
    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_ENV)
    pm = pluggy.PluginManager("corekv")
    pm.add_hookspecs(hookspecs)
    module_to_distribution: dict[str, str] = {}
    seen_modules: set[str] = set()
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else ""
        if not autoload and dist != OWN_DISTRIBUTION:
            continue
        if ep.value in seen_modules:  # the same module can be listed by several installs
            continue
        module = _import_plugin(ep.value, f"{ep.name!r} (entry point {ep.value!r} of {dist or 'unknown'})")
        pm.register(module, name=ep.name)
        seen_modules.add(ep.value)
        module_to_distribution[ep.name] = dist
    for plugin in plugins:
        if isinstance(plugin, str):
            if plugin in seen_modules or pm.has_plugin(plugin):
                continue
            module = _import_plugin(plugin, f"{plugin!r} (from plugins:)")
            pm.register(module, name=plugin)
            seen_modules.add(plugin)
            module_to_distribution[plugin] = _distribution_of(plugin)
        else:
            pm.register(plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(f"{e}; hook implementations must be named after a corekv_* hookspec") from e
    return PluginManager(pm, module_to_distribution)


def _distribution_of(module_name: str) -> str:
    top = module_name.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    return dists[0] if dists else ""


def available_plugins(plugins: Iterable[str | object] = ()) -> dict[str, dict[str, dict[str, str]]]:
    """``{"backends": {name: info}, "tiers": {name: info}, "plugins": {name: info}}``.

    ``info`` has ``description``, ``plugin`` (the plugin that registered it) and ``distribution``.
    """
    manager = make_plugin_manager(plugins)
    describe = lambda spec: {"description": spec.description, "plugin": spec.plugin,
                             "distribution": spec.distribution}
    return {
        "backends": {n: describe(s) for n, s in sorted(manager.backends().items())},
        "tiers": {n: describe(s) for n, s in sorted(manager.tiers().items())},
        "plugins": {n: {"distribution": d} for n, d in sorted(manager.plugin_names().items())},
    }
