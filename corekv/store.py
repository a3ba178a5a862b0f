"""``corekv store``: summarise, verify and clear a config's persistent tiers without loading a model.

A :class:`corekv.tier.Tier` is opened for *one* model (its key prefix and header check come from
the model fingerprint, which is a digest of the weights), so it cannot show a store shared by
several models, and opening it would mean loading the weights. The store tools therefore read
each tier's admin view (:class:`corekv.tier_admin.StoreAdmin`, which the tier's plugin declares
as ``TierSpec.admin``): every entry of every model, raw, as the tier's own module reads its
layout. They trust nothing but the entries themselves: every entry's header
(:func:`corekv.block_format.read_header`) names its model digest, dtype and shape, and
:func:`corekv.block_format.check_entry` verifies it *self-consistently* (magic, version, dtype,
shape vs length, and the tag over its key, header and payload: the checksum, or the MAC with
``cache.integrity``'s secret). That works for entries of any model in the store, and for any
tier with an admin view, third-party ones included. A tier without one (``host`` lives in one
process's memory, so a new process has nothing to inspect) is skipped with a note.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from corekv.block_format import EntryError, check_entry, read_header
from corekv.errors import ConfigError, CoreKVError
from corekv.plugin import make_plugin_manager
from corekv.tier_admin import StoreAdmin, StoredEntry, make_store_admin


@dataclass(frozen=True)
class StoreView:
    """One configured tier's admin view, under the name and type the config gives the tier."""

    name: str
    type: str
    admin: StoreAdmin

    def entries(self) -> Iterator[StoredEntry]:
        """The admin view's entries; a store found damaged on the way is a :class:`CoreKVError`
        naming this tier (one line for ``corekv store``, never a traceback)."""
        try:
            yield from self.admin.entries()
        except CoreKVError as e:
            raise CoreKVError(f"tier {self.name!r}: {e}") from e

    def close(self) -> None:
        self.admin.close()


def open_views(cfg, tier_name: str | None = None, *,
               plugin_manager=None) -> tuple[list[StoreView], list[str]]:
    """A :class:`StoreView` per inspectable tier of ``cfg.cache.tiers`` (or just ``tier_name``),
    and one line per tier that cannot be inspected, saying why. ``plugin_manager`` gives each
    tier type's ``TierSpec.admin``: pass the one ``cfg`` was read with
    (:func:`corekv.config.read_config`; `corekv store` does); default: one built for
    ``cfg.plugins``.

    :raises ConfigError: no tiers, an unknown ``tier_name``, or no tier that can be inspected.
    :raises FileNotFoundError, CoreKVError: a tier's store is missing or cannot be read
        (:func:`corekv.tier_admin.make_store_admin`); the views opened before it are closed.
    """
    tiers = list(enumerate(cfg.cache.tiers))
    if not tiers:
        raise ConfigError("the config has no cache.tiers, so there is no store to inspect; pass "
                          "--config with a persistent tier (lmdb, fsspec, redis)")
    if tier_name is not None:
        names = [t.name or t.type for _, t in tiers]
        if tier_name not in names:
            raise ConfigError(f"--tier: got {tier_name!r}; expected one of {names}")
        tiers = [(i, t) for i, t in tiers if (t.name or t.type) == tier_name]
    if plugin_manager is None:
        plugin_manager = make_plugin_manager(cfg.plugins)
    specs = plugin_manager.tiers()
    views, skipped = [], []
    try:
        for index, tier in tiers:
            name, spec = tier.name or tier.type, specs[tier.type]
            if spec.admin is None:
                skipped.append(f"{name} ({tier.type}: {_why_not_inspectable(spec)})")
                continue
            admin = make_store_admin(spec, tier.options, name=name, where=f"cache.tiers[{index}]")
            views.append(StoreView(name, tier.type, admin))
    except BaseException:
        for view in views:
            view.close()
        raise
    if not views:
        raise ConfigError("no inspectable tier: " + "; ".join(skipped))
    return views, skipped


def summarize(view: StoreView) -> dict:
    """Entries, bytes, capacity, and per model: entries, bytes, dtypes and shapes (from headers)."""
    models: dict[str, dict] = {}
    num_entries = num_bytes = num_unreadable = 0
    for entry in view.entries():
        num_entries += 1
        num_bytes += len(entry.data)
        model = models.setdefault(entry.model, {"entries": 0, "bytes": 0, "layouts": set()})
        model["entries"] += 1
        model["bytes"] += len(entry.data)
        try:
            header = read_header(entry.data)
            model["layouts"].add(f"{header.dtype}{list(header.shape)}")
        except EntryError:
            num_unreadable += 1
    for model in models.values():
        model["layouts"] = sorted(model["layouts"])
    return {"name": view.name, "type": view.type, "entries": num_entries, "bytes": num_bytes,
            "capacity_bytes": view.admin.capacity_bytes(), "unreadable_headers": num_unreadable,
            "models": models}


def verify(view: StoreView, *, delete_bad: bool = False, secret: bytes | None = None) -> dict:
    """Check every entry under its key (:func:`check_entry`; with ``secret``, its MAC); returns
    counts and the bad entries' reasons."""
    good, bad = 0, []
    for entry in view.entries():
        try:
            check_entry(entry.key, entry.data, secret)
            good += 1
        except EntryError as e:
            bad.append((entry, str(e)))
    if delete_bad and bad:
        view.admin.delete([entry.ref for entry, _ in bad])
    return {"name": view.name, "good": good, "bad": len(bad), "deleted": len(bad) if delete_bad else 0,
            "bad_entries": [{"key": e.key.hex(), "model": e.model, "reason": r} for e, r in bad],
            "swept": view.admin.sweep()}


def clear(view: StoreView, model: str | None) -> int:
    """Delete every entry of ``model`` (12 hex digits), or of every model when ``None``, and what
    failed writes left behind (:meth:`StoreAdmin.sweep`)."""
    refs = [e.ref for e in view.entries() if model is None or e.model == model]
    view.admin.delete(refs)
    view.admin.sweep()
    return len(refs)


def _why_not_inspectable(spec) -> str:
    if getattr(spec.factory, "is_persistent", None) is False:  # the factory is the Tier class
        return "lives in one process's memory, nothing persists to inspect"
    return f"plugin {spec.plugin or '?'!r} declares no admin view (TierSpec.admin) for it"
