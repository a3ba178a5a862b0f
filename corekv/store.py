"""``corekv store``: summarise, verify, clear and prune a config's persistent tiers without loading a model.

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

import time
from collections.abc import Iterator
from dataclasses import dataclass

from corekv.block_format import EntryError, check_entry, read_header
from corekv.errors import ConfigError, CoreKVError
from corekv.plugin import make_plugin_manager
from corekv.tier_admin import EntryUse, StoreAdmin, StoredEntry, make_store_admin


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

    def usage(self) -> Iterator[EntryUse]:
        """The admin view's entry sizes and ages; a store's failure names this tier, as in
        :meth:`entries`."""
        try:
            yield from self.admin.usage()
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


def can_prune(view: StoreView) -> bool:
    """Whether the view's store keeps entry ages (:attr:`StoreAdmin.age_basis`)."""
    return view.admin.age_basis is not None


def prune(view: StoreView, *, older_than_s: float | None = None, max_bytes: int | None = None,
          now: float | None = None, dry_run: bool = False) -> dict:
    """Delete, oldest first, the entries (of every model) unused for more than ``older_than_s``
    seconds, then more until the store holds at most ``max_bytes``.

    A shared store's capacity is no one machine's business: each engine's LRU sees only its own
    uses, so a periodic prune by age (and a cap) is what keeps a store shared by a fleet bounded.
    Age is :meth:`StoreAdmin.usage`'s ``last_used`` (``view.admin.age_basis`` says whether reads
    count). ``dry_run`` deletes nothing and reports what would go.

    :returns: ``entries``/``bytes`` before, ``deleted``/``deleted_bytes`` (by age and by size
        together), ``by_age``, ``by_size``, ``kept_bytes``, the ``age_basis`` and the oldest kept
        entry's age in seconds (``None``: none kept).
    """
    if older_than_s is None and max_bytes is None:
        raise ValueError("prune needs older_than_s, max_bytes or both")
    now = time.time() if now is None else now
    uses = sorted(view.usage(), key=lambda use: use.last_used)
    total = sum(use.num_bytes for use in uses)
    num_old = 0
    if older_than_s is not None:
        num_old = next((i for i, use in enumerate(uses) if now - use.last_used <= older_than_s), len(uses))
    kept = total - sum(use.num_bytes for use in uses[:num_old])
    num_gone = num_old
    while max_bytes is not None and kept > max_bytes and num_gone < len(uses):
        kept -= uses[num_gone].num_bytes
        num_gone += 1
    gone = uses[:num_gone]
    if gone and not dry_run:
        view.admin.delete([use.ref for use in gone])
    if not dry_run:
        view.admin.sweep()
    return {"name": view.name, "type": view.type, "age_basis": view.admin.age_basis,
            "entries": len(uses), "bytes": total, "deleted": len(gone),
            "deleted_bytes": total - kept, "by_age": num_old, "by_size": num_gone - num_old,
            "kept_bytes": kept, "dry_run": dry_run,
            "oldest_kept_age_s": now - uses[num_gone].last_used if num_gone < len(uses) else None}


def _why_not_inspectable(spec) -> str:
    if getattr(spec.factory, "is_persistent", None) is False:  # the factory is the Tier class
        return "lives in one process's memory, nothing persists to inspect"
    return f"plugin {spec.plugin or '?'!r} declares no admin view (TierSpec.admin) for it"
