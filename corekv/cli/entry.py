"""The ``corekv`` entry point: :func:`build_parser` gathers every command module's subcommands,
:func:`main` parses, runs the handler and maps a user-fixable error to its one-line message and
exit code (:data:`corekv.cli.args.EXIT_USAGE`, :data:`~corekv.cli.args.EXIT_RUNTIME`, 130 on
Ctrl-C). Imports run one way: this module imports the command modules, they import
:mod:`corekv.cli.args`, and none of them imports this one.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from corekv.cli.args import EXIT_RUNTIME, EXIT_USAGE, Parser, UsageError, parser_kwargs
from corekv.cli.bench import add_bench_commands
from corekv.cli.config import add_config_command
from corekv.cli.doctor import add_doctor_commands
from corekv.cli.generate import add_generate_command, add_warm_command
from corekv.cli.plugins import add_plugins_command
from corekv.cli.route import add_route_command
from corekv.cli.serve import add_serve_command
from corekv.cli.store import add_store_commands

_EXIT_CODES_HELP = (
    "config: --config FILE, else $COREKV_CONFIG, else the built-in defaults (`corekv config` shows\n"
    "them: the default model and an lmdb tier at ./kvstore, 2GiB). corekv.load_config() in Python\n"
    "keeps the device-only defaults instead.\n\n"
    "exit codes: 0 ok; 1 runtime error (model, store, engine; also `store verify` finding bad\n"
    "entries); 2 usage or config error; 130 interrupted. --debug shows tracebacks.\n\n")
#: commands that load a model or a store, whose loaders' progress bars main() turns off
_QUIET_LOADING_COMMANDS = ("generate", "warm", "store", "serve", "route", "prepare")


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    # NOTE: SUPPRESS defaults, so --config/--debug work before or after the subcommand without
    # the subcommand's default overwriting a value given before it.
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="YAML config file (default: $COREKV_CONFIG, else the built-in "
                        "defaults: see `corekv config`)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="log debug messages and show tracebacks on errors")
    common.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no start-up progress lines on stderr (printed on a terminal only: "
                        "loading or converting the model, building the native kernels)")
    parser = Parser(prog="corekv", parents=[common], **parser_kwargs(
        "corekv: a plugin-style KV-cache framework for LLM inference.",
        "  corekv plugins\n"
        "  corekv config --config cache.yaml\n"
        "  corekv doctor\n"
        "  corekv generate --prompt 'What is a KV cache?' --chat\n"
        "  corekv bench hit-rate\n"
        "  corekv store stats --config cache.yaml\n"
        "  corekv serve --config cache.yaml --port 8000\n"
        "  corekv route --workers http://127.0.0.1:8001 http://127.0.0.1:8002\n", _EXIT_CODES_HELP))
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=Parser)
    # NOTE: the order `corekv --help` lists the commands in
    for add_commands in (add_plugins_command, add_config_command, add_bench_commands,
                         add_generate_command, add_warm_command, add_store_commands,
                         add_route_command, add_serve_command, add_doctor_commands):
        add_commands(commands, common)
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
    if getattr(args, "quiet", False):
        os.environ["COREKV_QUIET"] = "1"  # NOTE: read by corekv.engine.progress
    if args.command in _QUIET_LOADING_COMMANDS and not debug:
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
