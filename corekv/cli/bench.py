"""``corekv bench hit-rate|plot-reload``: the benchmarks that need no model (the seed workloads
replayed through the backends' indexes, and the plot of benchmarks/reload_vs_recompute.py's JSON)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from corekv.cli.args import Parser, UsageError, int_at_least, parser_kwargs
from corekv.cli.output import progress


def add_bench_commands(commands, common) -> None:
    bench = commands.add_parser("bench", parents=[common], help="benchmarks without a model",
                                **parser_kwargs("Index-only benchmarks.", "  corekv bench hit-rate\n"))
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True,
                                          parser_class=Parser)
    p = bench_commands.add_parser("hit-rate", parents=[common], help="prefix hit rates per backend",
                                  **parser_kwargs(
                                      "Replay the seed workloads through the radix and hash-block "
                                      "backends and print the fraction of tokens served from cache.",
                                      "  corekv bench hit-rate\n"
                                      "  corekv bench hit-rate --workloads multi_turn,parallel\n"
                                      "  corekv bench hit-rate --capacity 32768 --json\n"
                                      "  corekv bench hit-rate --capacity 32768 --eviction lru,lfu,priority\n"))
    p.add_argument("--workloads", metavar="NAMES",
                   help="comma-separated workload names (default: all four)")
    p.add_argument("--capacity", metavar="TOKENS", type=int_at_least(1),
                   help="device pool size in tokens (default: unbounded, nothing evicted)")
    p.add_argument("--eviction", metavar="POLICIES",
                   help="comma-separated eviction policies (lru, lfu, priority or a plugin's): one row "
                        "per workload and policy (default: each backend's default, LRU)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", metavar="DIR",
                   help="also write DIR/hit_rate.json, DIR/hit_rate.md and (with matplotlib) "
                        "DIR/hit_rate.png")
    p.set_defaults(handler=cmd_bench_hit_rate)

    p = bench_commands.add_parser("plot-reload", parents=[common],
                                  help="plot reload vs recompute TTFT",
                                  **parser_kwargs(
                                      "Plot the TTFT of each reload path against prefix length from the\n"
                                      "JSON of benchmarks/reload_vs_recompute.py (needs corekv[plots]).",
                                      "  corekv bench plot-reload --json rvr.json --out results\n"
                                      "  corekv bench plot-reload --json a.json --json b.json --out docs/img\n"))
    p.add_argument("--json", metavar="FILE", action="append", required=True,
                   help="a results file (repeat to merge several; a later file wins per prefix length)")
    p.add_argument("--out", metavar="DIR", required=True, help="writes DIR/reload_ttft.png")
    p.set_defaults(handler=cmd_bench_plot_reload)


def cmd_bench_hit_rate(args: argparse.Namespace) -> int:
    from corekv import bench
    from corekv.config.values import did_you_mean

    workloads = None
    if args.workloads is not None:
        available = bench.seed_workloads()
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        for name in names or [args.workloads]:
            if name not in available:
                raise UsageError(f"--workloads: got {name!r}; expected a comma-separated list of "
                                 f"{', '.join(available)}{did_you_mean(name, available)}")
        workloads = {name: available[name] for name in names}
    smallest = max(size for _, _, size in bench.TABLE_COLUMNS)
    if args.capacity is not None and args.capacity < smallest:
        raise UsageError(f"--capacity: got {args.capacity}; expected at least {smallest} tokens "
                         "(one block of the largest block size in the table)")
    policies: list[str | None] = [None]
    if args.eviction is not None:
        from corekv.plugin import make_plugin_manager

        registered = make_plugin_manager().eviction_policies()
        policies = [n.strip() for n in args.eviction.split(",") if n.strip()] or [args.eviction]
        for name in policies:
            if name not in registered:
                raise UsageError(f"--eviction: got {name!r}; expected a comma-separated list of "
                                 f"registered eviction policies ({', '.join(sorted(registered))})"
                                 f"{did_you_mean(name, registered)}")
    workloads = bench.seed_workloads() if workloads is None else workloads
    # NOTE: one workload at a time, so a progress bar can tick (the table is per workload anyway)
    rows = [row for name in progress(list(workloads), "hit-rate", unit="workload")
            for policy in policies
            for row in bench.hit_rate_table({name: workloads[name]}, capacity=args.capacity,
                                            eviction=policy)]
    print(json.dumps(rows, indent=2) if args.json else bench.format_table(rows))
    if args.out is not None:
        _write_hit_rate_results(rows, args.out)
    return 0


def _write_hit_rate_results(rows: list[dict[str, Any]], out: str) -> None:
    from pathlib import Path

    from corekv import bench, plots

    directory = Path(out)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot create directory {out!r} ({exc}); pass a writable directory")
    (directory / "hit_rate.json").write_text(json.dumps(rows, indent=2) + "\n")
    (directory / "hit_rate.md").write_text("```\n" + bench.format_table(rows) + "\n```\n")
    written = ["hit_rate.json", "hit_rate.md"]
    if plots.have_matplotlib():
        plots.plot_hit_rate(rows, directory / "hit_rate.png")
        written.append("hit_rate.png")
    else:
        print(f"corekv: no hit_rate.png: {plots.PLOTS_HINT} for the plot", file=sys.stderr)
    print(f"wrote {', '.join(written)} to {directory}", file=sys.stderr)


def cmd_bench_plot_reload(args: argparse.Namespace) -> int:
    from pathlib import Path

    from corekv import plots

    if not plots.have_matplotlib():
        raise UsageError(f"bench plot-reload needs matplotlib: {plots.PLOTS_HINT}")
    try:
        rows = plots.merge_reload_rows(*args.json)
    except ValueError as exc:
        raise UsageError(f"--json: {exc}") from exc
    path = plots.plot_reload(rows, Path(args.out) / "reload_ttft.png")
    print(f"wrote {path}", file=sys.stderr)
    return 0
