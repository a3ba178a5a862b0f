"""Admin views: a persistent tier's whole store, every model's entries, for ``corekv store``.

A :class:`corekv.tier.Tier` is opened for one model: its keys and header checks come from the
model fingerprint, a digest of the weights. The store tools must list, verify and clear a store
shared by several models without loading any of them, so a persistent tier's plugin gives a
second, model-free view of the same storage: a :class:`StoreAdmin`, declared as the tier's
``TierSpec.admin`` factory next to ``TierSpec.factory``. Its module owns the storage layout, so
no other module knows how a tier names or packs its entries, and every tier that declares one
(third-party ones too) gets ``corekv store stats|ls|verify|clear``.

Factory convention (what :func:`make_store_admin` passes to ``TierSpec.admin``)::

    admin(**options) -> StoreAdmin

``options`` are the tier's validated ``cache.tiers[i]`` fields, every declared one (defaults
filled in), and nothing about a model. A store that does not exist raises
:class:`FileNotFoundError`; one that exists but cannot be read (damaged, unreachable) raises
:class:`corekv.errors.CoreKVError` saying why; an option the view rejects raises
``ConfigError(message, path=<option name>)``, as the tier's own factory does.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corekv.errors import ConfigError, CoreKVError, PluginError, describe_exception


@dataclass(frozen=True)
class StoredEntry:
    """One raw entry, as the store holds it (unchecked: a damaged entry is listed too).

    ``ref`` is the store's own handle for :meth:`StoreAdmin.delete` (a database key, a path);
    ``key`` the block hash the entry is stored under; ``model`` the 12 hex digits of the model
    digest that the storage names the entry by (not its header, which may be damaged); ``data``
    the entry's bytes (header + payload) as :meth:`corekv.tier.Tier._read_entries` would give them.
    """

    ref: Hashable
    key: bytes
    model: str
    data: bytes


@dataclass(frozen=True)
class EntryUse:
    """One entry's size and age, read without reading (or touching) the entry itself.

    ``ref`` and ``model`` are as in :class:`StoredEntry`; ``num_bytes`` the bytes it takes as the
    store counts them; ``last_used`` when it was last used, in seconds since the epoch, by the
    store's own clock (what "used" means is :attr:`StoreAdmin.age_basis`).
    """

    ref: Hashable
    model: str
    num_bytes: int
    last_used: float


class StoreAdmin(ABC):
    """A persistent tier's storage seen whole, across every model stored in it.

    Invariants: :meth:`entries` yields each stored entry once and never a partial write (a
    writer's temporary object); it may stream from a snapshot, so callers delete only after
    iterating; :meth:`delete` ignores refs already gone. A view never validates entries: that is
    :mod:`corekv.store`'s job, the same for every tier. Use it as a context manager or call
    :meth:`close` once.

    Capability: ``age_basis`` says what :meth:`usage`'s ``last_used`` means for this store
    (``"last read or write"``, ``"last write"``); ``None`` (the default): the store keeps no
    entry ages, so ``corekv store prune`` cannot prune it.
    """

    age_basis: str | None = None

    @abstractmethod
    def entries(self) -> Iterator[StoredEntry]:
        """Every entry of every model in the store."""

    @abstractmethod
    def delete(self, refs: Sequence[Hashable]) -> None:
        """Remove the entries ``refs`` name (``StoredEntry.ref``); refs already gone are ignored."""

    def usage(self) -> Iterator[EntryUse]:
        """Every entry's size and age (``corekv store prune``), without reading the entries and
        without counting as a use of them. Views with an ``age_basis`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no entry ages (age_basis is None)")

    def capacity_bytes(self) -> int | None:
        """Bytes the store may hold (``None``: unbounded, or decided by a server)."""
        return None

    def sweep(self) -> int:
        """Remove what failed writes left behind (temporary objects no reader sees); returns how
        many. ``corekv store clear`` and ``verify`` call it; a store whose writes are atomic has
        nothing to sweep."""
        return 0

    def close(self) -> None:
        """Release the store (a database handle, a connection)."""

    def __enter__(self) -> StoreAdmin:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def make_store_admin(spec, options: Mapping[str, Any], *, name: str,
                     where: str | None = None) -> StoreAdmin:
    """Open the admin view of a tier from its :class:`corekv.plugin.TierSpec` and its validated
    ``cache.tiers[i]`` options (``name``: the tier's name in the config, which messages give).

    :raises ConfigError: an option the view rejects, as ``<where>.<option>``.
    :raises FileNotFoundError: the store does not exist, prefixed ``tier '<name>': ``.
    :raises CoreKVError: the store cannot be read, prefixed the same way.
    :raises PluginError: the spec has no admin view, or its factory failed in another way or
        returned something other than a :class:`StoreAdmin`.
    """
    where = where or f"cache.tiers ({spec.name})"
    plugin = f"tier {spec.name!r} (plugin {spec.plugin or '?'!r})"
    if spec.admin is None:
        raise PluginError(f"{plugin} declares no admin view (TierSpec.admin), so its store "
                          "cannot be inspected")
    try:
        admin = spec.admin(**options)
    except ConfigError as e:
        field = f"{where}.{e.path}" if e.path else where
        raise ConfigError(f"{field}: {e}", path=field) from e
    except FileNotFoundError as e:
        raise FileNotFoundError(f"tier {name!r}: {e}") from e
    except CoreKVError as e:
        raise CoreKVError(f"tier {name!r}: {e}") from e
    except Exception as e:
        raise PluginError(f"{where}: {plugin} failed to open its admin view: "
                          f"{describe_exception(e)}") from e
    if not isinstance(admin, StoreAdmin):
        raise PluginError(f"{plugin} admin factory returned {type(admin).__name__}, expected a "
                          "corekv.tier_admin.StoreAdmin subclass")
    return admin
