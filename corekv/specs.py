"""What a plugin declares: the options it accepts, and the backends, tiers and config sections
the ``corekv_register_*`` hooks return.

Both :mod:`corekv.hookspecs` (which names these types in its signatures) and :mod:`corekv.plugin`
(which collects and checks them) import this module; it imports nothing of corekv, so the three
never form a cycle. ``corekv.plugin`` re-exports every name, and plugins import them from there.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_REQUIRED = object()
OPTION_KINDS = ("int", "float", "str", "bool", "size", "mapping", "eviction")


@dataclass(frozen=True)
class Option:
    """One option a backend, a tier or a config section accepts in the config.

    :param kind: ``int``, ``float``, ``str``, ``bool``, ``size`` (bytes; accepts ``"2GiB"``),
        ``mapping`` (string keys to any values, passed on as a dict: a library's own options) or
        ``eviction`` (the name of a registered eviction policy, checked against
        ``corekv_register_eviction_policies``; the factory receives a fresh
        :class:`corekv.eviction.EvictionPolicy` of that name, or the name itself when the
        caller has no plugin manager: pass it to :func:`corekv.eviction.make_policy`).
    :param default: the value when the option is absent; omit it to make the option required.
    :param choices: allowed values, if the option is an enumeration.
    :param minimum: smallest allowed value for numbers and sizes.
    :param pattern: for ``str``: a regular expression the whole value must match, and
        ``pattern_text`` says what it means in errors and the reference (``"a ZMQ address such
        as tcp://*:5557"``).
    :param allow_empty: for ``str``: ``""`` is a value (by default a string must not be empty).
    """

    kind: str
    default: Any = _REQUIRED
    help: str = ""
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    pattern: str | None = None
    pattern_text: str = ""
    allow_empty: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OPTION_KINDS:
            raise ValueError(f"Option kind {self.kind!r} is not one of {OPTION_KINDS}")
        if (self.pattern is not None or self.allow_empty) and self.kind != "str":
            raise ValueError(f"Option(kind={self.kind!r}) has pattern or allow_empty, which apply to "
                             "kind 'str' only")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"Option pattern {self.pattern!r} is not a regular expression ({e})") from e
            if not self.pattern_text:
                raise ValueError(f"Option pattern {self.pattern!r} needs a pattern_text saying what "
                                 "it accepts (errors quote it), e.g. 'a ZMQ address such as tcp://*:5557'")

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
    :class:`corekv.tier.Tier` (options as validated from ``cache.tiers[i]``; the whole convention
    is :mod:`corekv.tier_factory`'s).

    :param admin: for a tier whose entries outlive the process, ``admin(**options)`` returns a
        :class:`corekv.tier_admin.StoreAdmin` over its whole store (every model's entries), which
        ``corekv store`` reads; ``None`` (an in-memory tier) leaves the tier out of those tools.
    """

    admin: Callable[..., Any] | None = None


@dataclass(frozen=True)
class EvictionPolicySpec(_Spec):
    """An eviction policy: ``factory()`` returns a fresh :class:`corekv.eviction.EvictionPolicy`
    (one per structure that evicts); the name is what ``eviction:`` says in the config.
    ``options`` is unused (a policy with settings registers one name per setting)."""


@dataclass(frozen=True)
class AdmissionPolicySpec(_Spec):
    """An admission policy: ``factory(offload_min_hits=int, max_tracked=int)`` returns a fresh
    :class:`corekv.admission.AdmissionPolicy` (which cached blocks go to the tiers); the
    name is what ``cache.admission`` says. ``options`` is unused."""


@dataclass(frozen=True)
class ConfigSectionSpec:
    """A top-level config section a plugin owns (``kv_events:``), validated by ``load_config``
    like corekv's own fields; the values reach the plugin as ``config.sections[name]`` (also
    ``config.<name>``), every option present (defaults filled in), already checked.

    :param name: the top-level key: lowercase letters, digits and single underscores, since
        ``COREKV_<NAME>__<KEY>`` environment variables override it.
    :param options: ``{option name: Option}``, as for backends and tiers.
    :param description: one line, for ``corekv plugins --json``.
    :param check: ``check(values)`` for rules between fields, called once with the section's
        validated values (a read-only mapping, also read as ``values.endpoint``); it raises
        :class:`corekv.ConfigError` with ``path="<name>.<field>"`` and a message that starts
        with that path, names the value received and what was expected.
    """

    name: str
    options: Mapping[str, Option] = field(default_factory=dict)
    description: str = ""
    check: Callable[[Mapping[str, Any]], None] | None = None
    #: filled in by the plugin manager: the distribution and module the spec came from
    plugin: str = ""
    distribution: str = ""
