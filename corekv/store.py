"""``corekv store``: inspect, verify and clear a config's persistent tiers without loading a model.

Design choice: a :class:`corekv.tier.Tier` is opened for *one* model (its key prefix and header
check come from the model fingerprint, which is a digest of the weights), so it cannot show a
store shared by several models, and opening it would mean loading the weights. The store tools
therefore read each tier's storage directly, entry by entry, and trust nothing but the entries
themselves: every entry's header (:func:`corekv.block_format.read_header`) names its model
digest, dtype and shape, and :func:`corekv.block_format.check_entry` verifies it *self-consistently* (magic, version,
dtype, shape vs length, and the tag over its key, header and payload: the checksum, or the MAC
with ``cache.integrity``'s secret). That works for entries of any model in the store.

Each persistent tier type needs a small :class:`StoreView` here (lmdb, fsspec, redis); the
``host`` tier lives in one process's memory, so a new process has nothing to inspect.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass


from corekv.block_format import EntryError, check_entry, read_header
from corekv.errors import ConfigError

_LMDB_KEY_PREFIX_BYTES = 6  # tiers/lmdb.py keys entries as model digest[:6] + block hash


@dataclass(frozen=True)
class StoredEntry:
    """One raw entry: ``model`` is the 12-hex-digit model id its key (not its header) names."""

    ref: object  # the store's own handle (db key, path) for delete()
    key: bytes
    model: str
    data: bytes


class StoreView:
    """Raw access to one tier's storage, across every model stored in it."""

    listing_note = ""

    def __init__(self, name: str, type_: str, options: dict):
        self.name, self.type, self.options = name, type_, options

    def entries(self) -> Iterator[StoredEntry]:
        raise NotImplementedError

    def delete(self, refs: list) -> None:
        raise NotImplementedError

    def capacity_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class LMDBView(StoreView):
    def __init__(self, name, type_, options):
        super().__init__(name, type_, options)
        from corekv.errors import CoreKVError
        from corekv.tiers.lmdb_file import close_lmdb, open_lmdb

        path = os.path.realpath(os.fspath(options["path"]))
        if not os.path.exists(path):
            raise FileNotFoundError(f"tier {name!r}: no LMDB store at {path} (nothing was stored "
                                    "yet, or cache.tiers[].path points elsewhere)")
        try:
            # NOTE: open_lmdb checks the data file before lmdb maps it: reading a page that a
            # truncated file lacks would kill this process with SIGBUS, reporting nothing.
            self.env = open_lmdb(path, map_size=options.get("size") or 2**30, max_dbs=2,
                                 subdir=True, lock=True)
        except ConfigError as e:  # a damaged store is a run-time failure here (exit code 1)
            raise CoreKVError(f"tier {name!r}: {e}") from e
        self._blocks = self.env.open_db(b"blocks")
        self._access = self.env.open_db(b"access")

    def entries(self):
        # NOTE: streamed inside one read transaction (a snapshot; writers are not blocked), so a
        # 20 GiB store is never held in memory; callers delete only after iterating.
        with self.env.begin() as txn:
            for db_key, data in txn.cursor(db=self._blocks):
                yield StoredEntry(db_key, db_key[_LMDB_KEY_PREFIX_BYTES:],
                                  db_key[:_LMDB_KEY_PREFIX_BYTES].hex(), data)

    def delete(self, refs):
        with self.env.begin(write=True) as txn:
            for db_key in refs:
                txn.delete(db_key, db=self._blocks)
                txn.delete(db_key, db=self._access)

    def capacity_bytes(self):
        return self.env.info()["map_size"]

    def close(self):
        close_lmdb(self.env)


class FsspecView(StoreView):
    def __init__(self, name, type_, options):
        super().__init__(name, type_, options)
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(options["url"], **(options.get("storage_options") or {}))
        self.root = root.rstrip("/")

    def entries(self):
        try:
            paths = sorted(self.fs.find(self.root))
        except FileNotFoundError:
            return
        for path in paths:
            parts = self.fs._strip_protocol(path)[len(self.root):].strip("/").split("/")
            if len(parts) != 3 or ".tmp" in parts[-1]:
                continue  # not a block object (e.g. a writer's temporary file)
            try:
                key = bytes.fromhex(parts[2])
            except ValueError:
                continue
            yield StoredEntry(path, key, parts[0], self.fs.cat_file(path))

    def delete(self, refs):
        for path in refs:
            self.fs.rm_file(path)

    def capacity_bytes(self):
        return self.options.get("size") or None


class RedisView(StoreView):
    def __init__(self, name, type_, options):
        super().__init__(name, type_, options)
        import redis

        self.client = redis.Redis.from_url(options.get("url") or "redis://127.0.0.1:6379/0")

    def entries(self):
        for redis_key in self.client.scan_iter(match="corekv:*", count=1000):
            _, fp12, hexkey = redis_key.decode().split(":", 2)
            data = self.client.get(redis_key)
            if data is not None:
                yield StoredEntry(redis_key, bytes.fromhex(hexkey), fp12, data)

    def delete(self, refs):
        if refs:
            self.client.delete(*refs)

    def close(self):
        self.client.close()


VIEWS = {"lmdb": LMDBView, "fsspec": FsspecView, "redis": RedisView}


def open_views(cfg, tier_name: str | None = None) -> tuple[list[StoreView], list[str]]:
    """A :class:`StoreView` per inspectable tier of ``cfg.cache.tiers`` (or just ``tier_name``),
    and one line per tier that cannot be inspected, saying why.

    :raises ConfigError: no tiers, an unknown ``tier_name``, or a tier that cannot be inspected.
    """
    tiers = list(cfg.cache.tiers)
    if not tiers:
        raise ConfigError("the config has no cache.tiers, so there is no store to inspect; pass "
                          "--config with a persistent tier (lmdb, fsspec, redis)")
    if tier_name is not None:
        names = [t.name or t.type for t in tiers]
        if tier_name not in names:
            raise ConfigError(f"--tier: got {tier_name!r}; expected one of {names}")
        tiers = [t for t in tiers if (t.name or t.type) == tier_name]
    views, skipped = [], []
    for tier in tiers:
        view_type = VIEWS.get(tier.type)
        if view_type is None:
            skipped.append(f"{tier.name or tier.type} ({tier.type}: "
                           + ("lives in one process's memory, nothing persists to inspect)"
                              if tier.type == "host" else "no store view for this tier type)"))
            continue
        views.append(view_type(tier.name or tier.type, tier.type, dict(tier.options)))
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
            "capacity_bytes": view.capacity_bytes(), "unreadable_headers": num_unreadable,
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
        view.delete([entry.ref for entry, _ in bad])
    return {"name": view.name, "good": good, "bad": len(bad), "deleted": len(bad) if delete_bad else 0,
            "bad_entries": [{"key": e.key.hex(), "model": e.model, "reason": r} for e, r in bad]}


def clear(view: StoreView, model: str | None) -> int:
    """Delete every entry of ``model`` (12 hex digits), or of every model when ``None``."""
    refs = [e.ref for e in view.entries() if model is None or e.model == model]
    view.delete(refs)
    return len(refs)
