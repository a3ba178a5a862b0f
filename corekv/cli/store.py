"""``corekv store stats|ls|verify|clear|prune``: the command-line side of :mod:`corekv.store`, which
opens the config's persistent tiers through their admin views (no model is loaded, except by
``clear`` without ``--model``/``--all-models``, for the config's model's fingerprint)."""
from __future__ import annotations

import argparse
import json
import re
import sys

from corekv.cli.args import (EXIT_RUNTIME, Parser, UsageError, duration_arg, int_at_least,
                             parser_kwargs, read_config_arg, size_arg)
from corekv.cli.output import print_table


def add_store_commands(commands, common) -> None:
    store = commands.add_parser("store", parents=[common], help="inspect, verify or clear a store",
                                **parser_kwargs(
                                    "Inspect the persistent tiers (lmdb, fsspec, redis) of a config "
                                    "without loading the model: every entry's header names its "
                                    "model, dtype and shape, so stores shared by several models "
                                    "work. A host tier lives in one process and is skipped.",
                                    "  corekv store stats --config cache.yaml\n"
                                    "  corekv store ls --config cache.yaml --limit 20\n"
                                    "  corekv store verify --config cache.yaml --delete-bad\n"
                                    "  corekv store clear --config cache.yaml --all-models --yes\n"))
    sub = store.add_subparsers(dest="store_command", metavar="ACTION", required=True,
                               parser_class=Parser)
    tier_help = "only this tier (its name in cache.tiers; default: every inspectable tier)"
    for name, help_text, description, examples in (
            ("stats", "entries, bytes, capacity and models per tier",
             "Per tier: entries, bytes, capacity, and per model (12-hex-digit fingerprint "
             "digest) its entries and block layouts (dtype[shape]).",
             "  corekv store stats\n  corekv store stats --config cache.yaml --json\n"),
            ("ls", "list entries", "List entries: tier, block hash, size, model, dtype and shape.",
             "  corekv store ls --limit 10\n  corekv store ls --tier lmdb --json\n"),
            ("verify", "check every entry's header and checksum",
             "Read every entry and check its header and checksum (for entries of any model). "
             "Exits 1 when bad entries are found or a store cannot be read at all (such as a "
             "truncated LMDB data file, which the error names).",
             "  corekv store verify\n  corekv store verify --delete-bad\n"),
            ("clear", "delete entries",
             "Delete the entries of the config's model (its weights are loaded to compute its "
             "fingerprint), of --model FP12, or of every model (--all-models). Asks nothing: "
             "requires --yes.",
             "  corekv store clear --yes\n  corekv store clear --all-models --yes\n"
             "  corekv store clear --model 0123456789ab --yes\n"),
            ("prune", "delete entries by age and/or to a size, oldest first",
             "Delete the entries (of every model) unused for longer than --older-than, then, "
             "oldest first, more until each tier holds at most --max-size. For stores shared by "
             "several machines, whose engines each see only their own uses: run it from cron. "
             "Age is the last read or write where the store records reads (lmdb, shm, redis) "
             "and the last write on object stores (fsspec). Asks nothing: requires --yes or "
             "--dry-run.",
             "  corekv store prune --older-than 7d --yes\n"
             "  corekv store prune --max-size 10GiB --tier s3 --yes\n"
             "  corekv store prune --older-than 12h --max-size 50GiB --dry-run\n")):
        p = sub.add_parser(name, parents=[common], help=help_text,
                           **parser_kwargs(description, examples))
        p.add_argument("--tier", metavar="NAME", help=tier_help)
        p.add_argument("--json", action="store_true", help="print JSON")
        if name == "ls":
            p.add_argument("--limit", metavar="N", type=int_at_least(1),
                           help="list at most N entries per tier")
        if name == "verify":
            p.add_argument("--delete-bad", action="store_true", help="delete the bad entries")
        if name == "clear":
            p.add_argument("--all-models", action="store_true", help="delete every model's entries")
            p.add_argument("--model", metavar="FP12",
                           help="delete this model's entries (as `corekv store stats` shows it)")
            p.add_argument("--yes", action="store_true", help="really delete (required)")
        if name == "prune":
            p.add_argument("--older-than", metavar="AGE", type=duration_arg,
                           help="delete entries unused for longer than AGE (30m, 12h, 7d, 2w)")
            p.add_argument("--max-size", metavar="SIZE", type=size_arg,
                           help="then delete the oldest until each tier holds at most SIZE "
                           "(10GiB, 500MB)")
            p.add_argument("--dry-run", action="store_true", help="delete nothing; say what would go")
            p.add_argument("--yes", action="store_true", help="really delete (or --dry-run)")
        p.set_defaults(handler=cmd_store)


def cmd_store(args: argparse.Namespace) -> int:
    from corekv import store

    cfg, plugin_manager = read_config_arg(args)
    action = args.store_command
    if action == "clear":
        if args.all_models and args.model:
            raise UsageError("--all-models and --model exclude each other; pass one")
        if args.model is not None and not re.fullmatch(r"[0-9a-f]{12}", args.model):
            raise UsageError(f"--model: got {args.model!r}; expected the 12 hex digits "
                             "`corekv store stats` shows for a model")
        if not args.yes:
            raise UsageError("store clear deletes entries and asks no question: add --yes")
    if action == "prune":
        if args.older_than is None and args.max_size is None:
            raise UsageError("store prune needs --older-than AGE, --max-size SIZE or both")
        if not (args.yes or args.dry_run):
            raise UsageError("store prune deletes entries and asks no question: add --yes "
                             "(or --dry-run to see what would go)")
    views, skipped = store.open_views(cfg, args.tier, plugin_manager=plugin_manager)
    for line in skipped:
        print(f"note: skipped tier {line}", file=sys.stderr)
    try:
        if action == "stats":
            return _store_stats(views, args.json)
        if action == "ls":
            return _store_ls(views, args.limit, args.json)
        if action == "verify":
            return _store_verify(views, args.delete_bad, args.json, cfg.cache.integrity.secret())
        if action == "prune":
            return _store_prune(views, args)
        model = None if args.all_models else (args.model or _model_fp12(cfg, plugin_manager))
        result = {view.name: store.clear(view, model) for view in views}
        if args.json:
            print(json.dumps({"model": model, "deleted": result}, indent=2))
        else:
            for name, count in result.items():
                print(f"{name}: deleted {count} entries of {model or 'every model'}")
        return 0
    finally:
        for view in views:
            view.close()


def _model_fp12(cfg, plugin_manager) -> str:
    """The config's model id as stores key it (loads the weights: the fingerprint hashes them)."""
    from corekv.block_format import fingerprint_digest
    from corekv.engine.models import load_model
    from corekv.offload.build import fingerprint_bytes

    model = load_model(cfg.model, dtype=cfg.dtype, device="cpu", plugin_manager=plugin_manager)
    return fingerprint_digest(fingerprint_bytes(model.fingerprint)).hex()[:12]


def _store_stats(views, as_json: bool) -> int:
    from corekv import store

    rows = [store.summarize(view) for view in views]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        capacity = format_size(row["capacity_bytes"]) if row["capacity_bytes"] else "unbounded"
        print(f"{row['name']} ({row['type']}): {row['entries']} entries, {format_size(row['bytes'])}"
              f" of {capacity}")
        for model, info in sorted(row["models"].items()):
            print(f"  model {model}: {info['entries']} entries, {format_size(info['bytes'])}, "
                  f"{', '.join(info['layouts']) or 'no readable header'}")
        if row["unreadable_headers"]:
            print(f"  {row['unreadable_headers']} entries with unreadable headers "
                  "(run `corekv store verify`)")
    return 0


def format_size(num_bytes: int) -> str:
    """Bytes for people: ``1.5 MiB`` (one decimal), ``512 B``."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def _store_ls(views, limit: int | None, as_json: bool) -> int:
    from corekv.block_format import EntryError, read_header

    rows = []
    for view in views:
        for i, entry in enumerate(view.entries()):
            if limit is not None and i >= limit:
                break
            try:
                header = read_header(entry.data)
                dtype, shape = header.dtype, list(header.shape)
            except EntryError:
                dtype, shape = "?", []
            rows.append({"tier": view.name, "key": entry.key.hex(), "bytes": len(entry.data),
                         "model": entry.model, "dtype": dtype, "shape": shape})
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print_table("Entries", ("TIER", "KEY", "BYTES", "MODEL", "DTYPE", "SHAPE"),
                    [(r["tier"], r["key"], r["bytes"], r["model"], r["dtype"], r["shape"])
                     for r in rows])
    return 0


def _store_verify(views, delete_bad: bool, as_json: bool, secret: bytes | None) -> int:
    from corekv import store

    results = [store.verify(view, delete_bad=delete_bad, secret=secret) for view in views]
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            deleted = f", {r['deleted']} deleted" if delete_bad else ""
            print(f"{r['name']}: {r['good']} good, {r['bad']} bad{deleted}")
            for bad in r["bad_entries"]:
                print(f"  bad {bad['key']} (model {bad['model']}): {bad['reason']}")
    return EXIT_RUNTIME if any(r["bad"] for r in results) else 0


def _store_prune(views, args) -> int:
    from corekv import store

    prunable = [view for view in views if store.can_prune(view)]
    for view in views:
        if view not in prunable:
            print(f"note: skipped tier {view.name} ({view.type}: its store keeps no entry ages)",
                  file=sys.stderr)
    if not prunable:
        raise UsageError("store prune: no tier of the config keeps entry ages "
                         f"({', '.join(v.name for v in views)}); use `corekv store clear`")
    results = [store.prune(view, older_than_s=args.older_than, max_bytes=args.max_size,
                           dry_run=args.dry_run) for view in prunable]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for r in results:
        oldest = "nothing" if r["oldest_kept_age_s"] is None else f"the oldest used {_age(r['oldest_kept_age_s'])} ago"
        print(f"{r['name']}: {verb} {r['deleted']} of {r['entries']} entries "
              f"({format_size(r['deleted_bytes'])}; {r['by_age']} by age, {r['by_size']} by size), "
              f"kept {format_size(r['kept_bytes'])}, {oldest} (age: {r['age_basis']})")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0.0):.0f}s"
