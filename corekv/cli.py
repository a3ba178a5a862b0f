"""The ``corekv`` command line: ``plugins``, ``config``, ``bench hit-rate|plot-reload``,
``generate``, ``warm``, ``store stats|ls|verify|clear``, ``serve`` (corekv/cli_serve.py) and
``route`` (corekv/cli_route.py).

Config: ``--config FILE``, else ``$COREKV_CONFIG``, else the packaged ``corekv/defaults.yaml`` (the
default model plus an lmdb tier at ``./kvstore``, so two runs of the same prompt share its
prefix). The Python API's ``corekv.load_config()`` keeps the device-only dataclass defaults.

Errors a user can fix (bad config, bad arguments, a broken plugin) print one line,
``corekv: error: <message>``, and exit 2 (config or usage) or 1 (runtime); ``--debug`` shows the
traceback instead. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any

EXIT_RUNTIME = 1
EXIT_USAGE = 2
DEFAULTS_FILE = "defaults.yaml"  # package data of corekv: the CLI's config when none is named
_EXIT_CODES_HELP = (
    "config: --config FILE, else $COREKV_CONFIG, else the built-in defaults (`corekv config` shows\n"
    "them: the default model and an lmdb tier at ./kvstore, 2GiB). corekv.load_config() in Python\n"
    "keeps the device-only defaults instead.\n\n"
    "exit codes: 0 ok; 1 runtime error (model, store, engine; also `store verify` finding bad\n"
    "entries); 2 usage or config error; 130 interrupted. --debug shows tracebacks.\n\n")


class UsageError(Exception):
    """A command-line argument is wrong (exit code 2, like argparse's own errors)."""


class _Parser(argparse.ArgumentParser):
    # NOTE: argparse prints the whole usage block and exits; corekv errors are one line and
    # main() must return its exit code rather than raise SystemExit.
    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _parser_kwargs(description: str, examples: str, notes: str = "") -> dict[str, Any]:
    return {"description": description, "epilog": notes + "examples:\n" + examples,
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    # NOTE: SUPPRESS defaults, so --config/--debug work before or after the subcommand without
    # the subcommand's default overwriting a value given before it.
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="YAML config file (default: $COREKV_CONFIG, else the built-in "
                        "defaults: see `corekv config`)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="log debug messages and show tracebacks on errors")
    parser = _Parser(prog="corekv", parents=[common], **_parser_kwargs(
        "corekv: a plugin-style KV-cache framework for LLM inference.",
        "  corekv plugins\n"
        "  corekv config --config cache.yaml\n"
        "  corekv generate --prompt 'What is a KV cache?' --chat\n"
        "  corekv bench hit-rate\n"
        "  corekv store stats --config cache.yaml\n"
        "  corekv serve --config cache.yaml --port 8000\n"
        "  corekv route --workers http://127.0.0.1:8001 http://127.0.0.1:8002\n", _EXIT_CODES_HELP))
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser)

    p = commands.add_parser("plugins", parents=[common], help="list backends, tiers and plugins",
                            **_parser_kwargs(
                                "List every registered backend and tier, and every plugin, with "
                                "the distribution it comes from.",
                                "  corekv plugins\n  corekv plugins --json\n"
                                "  corekv plugins --config cache.yaml   # also the config's plugins:\n"))
    p.add_argument("--json", action="store_true", help="print JSON (with each option schema)")
    p.set_defaults(handler=_cmd_plugins)

    p = commands.add_parser("config", parents=[common], help="print the effective config",
                            **_parser_kwargs(
                                "Print the effective configuration (file, then COREKV_* environment "
                                "overrides, with defaults filled in) as YAML.",
                                "  corekv config --config cache.yaml\n"
                                "  COREKV_ENGINE__BLOCK_SIZE=32 corekv config\n"
                                "  corekv config --reference > docs/config.md\n"))
    p.add_argument("--reference", action="store_true",
                   help="print the configuration reference (markdown) instead")
    p.set_defaults(handler=_cmd_config)

    bench = commands.add_parser("bench", parents=[common], help="benchmarks without a model",
                                **_parser_kwargs("Index-only benchmarks.", "  corekv bench hit-rate\n"))
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True,
                                          parser_class=_Parser)
    p = bench_commands.add_parser("hit-rate", parents=[common], help="prefix hit rates per backend",
                                  **_parser_kwargs(
                                      "Replay the seed workloads through the radix and hash-block "
                                      "backends and print the fraction of tokens served from cache.",
                                      "  corekv bench hit-rate\n"
                                      "  corekv bench hit-rate --workloads multi_turn,parallel\n"
                                      "  corekv bench hit-rate --capacity 32768 --json\n"))
    p.add_argument("--workloads", metavar="NAMES",
                   help="comma-separated workload names (default: all four)")
    p.add_argument("--capacity", metavar="TOKENS", type=_int_at_least(1),
                   help="device pool size in tokens (default: unbounded, nothing evicted)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", metavar="DIR",
                   help="also write DIR/hit_rate.json, DIR/hit_rate.md and (with matplotlib) "
                        "DIR/hit_rate.png")
    p.set_defaults(handler=_cmd_bench_hit_rate)

    p = bench_commands.add_parser("plot-reload", parents=[common],
                                  help="plot reload vs recompute TTFT",
                                  **_parser_kwargs(
                                      "Plot the TTFT of each reload path against prefix length from the\n"
                                      "JSON of benchmarks/reload_vs_recompute.py (needs corekv[plots]).",
                                      "  corekv bench plot-reload --json rvr.json --out results\n"
                                      "  corekv bench plot-reload --json a.json --json b.json --out docs/img\n"))
    p.add_argument("--json", metavar="FILE", action="append", required=True,
                   help="a results file (repeat to merge several; a later file wins per prefix length)")
    p.add_argument("--out", metavar="DIR", required=True, help="writes DIR/reload_ttft.png")
    p.set_defaults(handler=_cmd_bench_plot_reload)

    p = commands.add_parser("generate", parents=[common], help="generate text for one prompt",
                            **_parser_kwargs(
                                "Load the model and cache from the config and generate a reply.",
                                "  corekv generate --prompt 'The capital of France is'\n"
                                "  corekv generate --chat --prompt 'What is a KV cache?' "
                                "--max-tokens 64\n"
                                "  corekv generate --config cache.yaml --salt tenant-a --chat "
                                "--prompt 'Hi' --stats\n"))
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    p.add_argument("--salt", metavar="S", help="cache_salt: prefixes are shared only within a salt")
    p.add_argument("--max-tokens", metavar="N", type=_int_at_least(1), default=64,
                   help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", metavar="T", type=_float_at_least(0.0), default=0.0,
                   help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--stats", action="store_true",
                   help="also print, one line each on stderr, the cached tokens, the cached tokens "
                        "by tier and the time to first token")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead: the text, the request's cache facts and "
                        "the whole engine.stats()")
    p.set_defaults(handler=_cmd_generate)

    p = commands.add_parser("warm", parents=[common], help="compute and keep a prefix",
                            **_parser_kwargs(
                                "Compute a prompt's KV and keep its full blocks cached, so later "
                                "requests hit it; across processes this needs a persistent tier "
                                "(lmdb, redis, fsspec) in the config.",
                                "  corekv warm --config cache.yaml --prompt 'You are a helpful assistant.'\n"
                                "  corekv warm --config cache.yaml --prompt \"$(cat system.txt)\" "
                                "--salt tenant-a --pin\n"
                                "  corekv warm --prompts-file system_prompts.txt --stats --json\n"))
    p.add_argument("--prompt", action="append", default=[],
                   help="the prefix text (repeat for several prompts)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="a text file with one prompt per line (blank lines skipped)")
    p.add_argument("--salt", metavar="S", help="cache_salt the prefix is kept for")
    p.add_argument("--pin", action="store_true", help="pin it: never evicted from the device pool")
    p.add_argument("--stats", action="store_true", help="also print the engine's stats (stderr)")
    p.add_argument("--json", action="store_true", help="with --stats: the stats as JSON")
    p.set_defaults(handler=_cmd_warm)
    from corekv.cli_serve import add_serve_command
    from corekv.cli_route import add_route_command
    from corekv.cli_store import add_store_commands

    add_store_commands(commands, common)
    add_route_command(commands, common)
    add_serve_command(commands, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the ``corekv`` console script exits with it)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _fail(str(e), EXIT_USAGE)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    debug = getattr(args, "debug", False)
    if args.command in ("generate", "warm", "store", "serve", "route") and not debug:
        # NOTE: transformers and its GGUF reader draw tqdm bars while loading, which bury the one
        # line of output. tqdm reads TQDM_* variables when it is imported, so set it first.
        os.environ.setdefault("TQDM_DISABLE", "1")
        if "transformers" in sys.modules:  # NOTE: imported before main() ran (in-process callers)
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args) or 0
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # `corekv plugins | head`
        sys.stderr.close()
        return 0
    except Exception as e:
        code = _exit_code(e)
        if debug or code is None:
            raise
        return _fail(str(e), code)


def _exit_code(error: Exception) -> int | None:
    from corekv.errors import ConfigError, CoreKVError

    if isinstance(error, (ConfigError, UsageError)):
        return EXIT_USAGE
    if isinstance(error, (CoreKVError, FileNotFoundError)):
        return EXIT_RUNTIME
    return None


def _fail(message: str, code: int) -> int:
    one_line = " ".join(message.split())  # NOTE: a plugin's exception text may span lines
    print(f"corekv: error: {one_line}", file=sys.stderr)
    return code


# -- commands ----------------------------------------------------------------------------------
def _load(args: argparse.Namespace):
    from corekv.config import CONFIG_ENV, load_config

    source = getattr(args, "config", None)
    if source is None and not os.environ.get(CONFIG_ENV):
        source = defaults_path()
    return load_config(source)


def defaults_path() -> str:
    """The packaged default config file (``corekv/defaults.yaml``) the CLI uses when none is named."""
    from importlib.resources import files

    return str(files("corekv").joinpath(DEFAULTS_FILE))


def _config_plugins(args: argparse.Namespace) -> tuple[str, ...]:
    """The config's ``plugins:`` when a config is named (by --config or COREKV_CONFIG)."""
    from corekv.config import CONFIG_ENV

    if getattr(args, "config", None) is None and not os.environ.get(CONFIG_ENV):
        return ()
    return _load(args).plugins


def _cmd_plugins(args: argparse.Namespace) -> int:
    from corekv.plugin import available_plugins

    info = available_plugins(_config_plugins(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for title, key in (("Backends", "backends"), ("Tiers", "tiers")):
        rows = [(name, d["distribution"] or "-", d["plugin"], d["description"])
                for name, d in info[key].items()]
        _print_table(title, ("NAME", "DISTRIBUTION", "PLUGIN", "DESCRIPTION"), rows)
    rows = [(name, d["distribution"] or "-") for name, d in info["plugins"].items()]
    _print_table("Plugins", ("NAME", "DISTRIBUTION"), rows)
    return 0


def _print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    print(f"{title}:")
    if not rows:
        print("  (none)")
        return
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from corekv.config import config_reference, dump_config
    from corekv.plugin import make_plugin_manager

    if args.reference:
        print(config_reference(make_plugin_manager(_config_plugins(args))), end="")
        return 0
    cfg = _load(args)
    data = dump_config(cfg, plugin_manager=make_plugin_manager(cfg.plugins))
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _cmd_bench_hit_rate(args: argparse.Namespace) -> int:
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
    workloads = bench.seed_workloads() if workloads is None else workloads
    # NOTE: one workload at a time, so a progress bar can tick (the table is per workload anyway)
    rows = [row for name in _progress(list(workloads), "hit-rate", unit="workload")
            for row in bench.hit_rate_table({name: workloads[name]}, capacity=args.capacity)]
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


def _cmd_bench_plot_reload(args: argparse.Namespace) -> int:
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


def _cmd_generate(args: argparse.Namespace) -> int:
    import corekv

    cfg = _load(args)
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    params = corekv.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with corekv.Engine.from_config(cfg) as engine:
        out = engine.generate([prompt], params, cache_salt=args.salt)[0]
        stats = engine.stats() if args.json or args.stats else None
    if args.json:
        print(json.dumps({"text": out.text, "num_cached_tokens": out.num_cached_tokens,
                          "cached_tokens_by_tier": out.cached_tokens_by_tier, "ttft_s": out.ttft_s,
                          "stats": stats}, indent=2, default=str))
        return 0
    print(out.text)
    if args.stats:
        by_tier = ", ".join(f"{k}={v}" for k, v in out.cached_tokens_by_tier.items()) or "none"
        ttft = f"{out.ttft_s:.3f}s" if out.ttft_s is not None else "n/a"
        for line in (f"cached tokens: {out.num_cached_tokens} of {len(out.prompt_token_ids)} "
                     "prompt tokens",
                     f"cached tokens by tier: {by_tier}",
                     f"time to first token: {ttft}"):
            print(line, file=sys.stderr)
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    import corekv

    prompts = list(args.prompt)
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise UsageError(f"--prompts-file: cannot read {args.prompts_file!r} ({e}); pass a "
                             "text file with one prompt per line") from None
    if not prompts:
        raise UsageError("warm needs --prompt TEXT (repeatable) or --prompts-file FILE "
                         "(see 'corekv warm --help')")
    cfg = _load(args)
    with corekv.Engine.from_config(cfg) as engine:
        counts = [engine.warm(p, pin=args.pin, cache_salt=args.salt)
                  for p in _progress(prompts, "warm", unit="prompt")]
        stats = engine.stats() if args.stats else None
    verb = "warmed and pinned" if args.pin else "warmed"
    if len(counts) == 1:
        print(f"{verb} {counts[0]} prompt tokens")
    else:
        print(f"{verb} {sum(counts)} prompt tokens in {len(counts)} prompts")
    if stats is not None:
        _print_stats(stats, as_json=args.json)
    return 0


def _print_stats(stats: dict[str, Any], *, as_json: bool) -> None:
    """engine.stats() on stderr: JSON, or one ``key: value`` line per fact (tiers flattened)."""
    if as_json:
        print(json.dumps(stats, indent=2, default=str), file=sys.stderr)
        return
    for key, value in stats.items():
        if isinstance(value, dict):
            for sub, sub_value in value.items():
                print(f"{key}.{sub}: {json.dumps(sub_value, default=str)}", file=sys.stderr)
        else:
            print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}",
                  file=sys.stderr)


def _progress(items: list, desc: str, unit: str):
    """A tqdm bar on stderr when it is a terminal, tqdm is installed and there are several items."""
    if len(items) < 2 or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    # NOTE: disable=False explicitly: main() sets TQDM_DISABLE for the model loaders' own bars.
    # mininterval=0: items are few and slow, so redraw on each one (tqdm's default 0.1 s throttle
    # skips every update of a run that finishes fast, leaving only "0/N" ever drawn).
    return tqdm(items, desc=desc, unit=unit, file=sys.stderr, disable=False, leave=False,
                mininterval=0)


# -- argument types ------------------------------------------------------------------------------
def number_arg(kind: type, expected: str, *, low: float | None = None, high: float | None = None,
               above: bool = False):
    """An argparse ``type``: ``kind(text)``, finite, within ``[low, high]`` (``above``: ``> low``);
    otherwise the error ``got <value>; expected <expected>`` (argparse prefixes the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {expected}") from None
        ok = math.isfinite(value) and (high is None or value <= high) and (
            low is None or (value > low if above else value >= low))
        if not ok:
            raise argparse.ArgumentTypeError(f"got {value}; expected {expected}")
        return value
    return parse


def _int_at_least(minimum: int):
    return number_arg(int, f"an integer >= {minimum}", low=minimum)


def _float_at_least(minimum: float):
    return number_arg(float, f"a finite number >= {minimum:g}", low=minimum)


if __name__ == "__main__":
    sys.exit(main())
