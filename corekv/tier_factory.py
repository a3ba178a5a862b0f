"""Building a tier from its plugin's :class:`corekv.plugin.TierSpec`: :func:`make_tier`.

Factory convention (what :func:`make_tier` passes to ``TierSpec.factory``)::

    factory(**options, block_bytes=int, fingerprint=bytes, dtype=str, shape=tuple[int, ...])

``options`` are the tier's validated ``cache.tiers[i]`` fields; ``fingerprint`` is the model
fingerprint digest; ``dtype``/``shape`` describe one block (``prod(shape) * itemsize ==
block_bytes``). A factory may accept ``name`` too; :func:`make_tier` passes it when given. A
factory that rejects an option raises ``ConfigError(message, path=<option name>)``, so the error
names ``cache.tiers[i].<option>``. Tiers never see the integrity secret: :func:`make_tier` gives
their codec the key, so a third-party tier checks MACs with no code of its own.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from corekv.errors import ConfigError, PluginError
from corekv.tier import Tier

__all__ = ["make_tier"]


def make_tier(spec, options: Mapping[str, Any], *, block_bytes: int, fingerprint: bytes,
              dtype: str = "uint8", shape: Sequence[int] | None = None,
              name: str | None = None, secret: bytes | None = None,
              where: str | None = None) -> Tier:
    """Build a tier from its :class:`corekv.plugin.TierSpec` and its ``cache.tiers[i]`` options.

    Absent options take their declared defaults; unknown or missing required ones raise
    :class:`ConfigError`, and so does a factory that raises ``ConfigError(path=<option>)``, with
    ``where`` (the entry's field path, e.g. ``cache.tiers[0]``) before the option's name; any other
    failure of the factory raises :class:`PluginError` naming the plugin. ``secret`` makes every
    entry's tag a MAC with that key (:mod:`corekv.block_format`), whatever the tier's type.

    NOTE: options from a loaded config were checked by the config reader already; the checks
    here are for callers that build a tier directly (a plugin's tests, embedding code).
    """
    where = where or f"cache.tiers ({spec.name})"
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {unknown}; expected some of {sorted(spec.options)}",
                          path=where)
    kwargs = {}
    for option_name, option in spec.options.items():
        if option_name in options:
            kwargs[option_name] = options[option_name]
        elif option.is_required:
            raise ConfigError(f"{where}: option {option_name!r} is required ({option.help}); add it",
                              path=f"{where}.{option_name}")
        else:
            kwargs[option_name] = option.default
    extra = {"name": name} if name is not None else {}
    try:
        tier = spec.factory(**kwargs, block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype,
                            shape=tuple(shape) if shape is not None else None, **extra)
    except ConfigError as e:
        field = f"{where}.{e.path}" if e.path else where
        raise ConfigError(f"{field}: {e}", path=field) from e
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"{where}: tier {spec.name!r} (plugin {spec.plugin or '?'!r}) failed to "
                          f"start: {type(e).__name__}: {e}") from e
    if not isinstance(tier, Tier):
        raise PluginError(f"tier {spec.name!r} (plugin {spec.plugin or '?'!r}) factory returned "
                          f"{type(tier).__name__}, expected a corekv.tier.Tier subclass")
    if secret is not None:
        tier.codec = tier.codec.with_secret(secret)
    return tier
