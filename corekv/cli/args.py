"""What every ``corekv`` command shares: the exit codes, :class:`UsageError`, the parser class, the
config a command reads (``--config``, else ``$COREKV_CONFIG``, else the packaged defaults) and the
argparse ``type`` functions, so a port, a size or a count is checked and worded the same way by
every command.

Command modules (:mod:`corekv.cli.generate`, :mod:`corekv.cli.serve`, ...) import this module;
it imports none of them, nor :mod:`corekv.cli.entry`.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

from corekv.config.values import SIZE_EXAMPLES, parse_size

EXIT_RUNTIME = 1
EXIT_USAGE = 2
DEFAULTS_FILE = "defaults.yaml"  # package data of corekv: the CLI's config when none is named
#: where --api-key is read from when the flag is not given (`corekv serve`'s key, and the key
#: `corekv route` asks of its clients: the router speaks the workers' API)
API_KEY_ENV = "COREKV_API_KEY"
#: --max-request-bytes' default as the flag takes it: corekv.server.limits.DEFAULT_MAX_REQUEST_BYTES
#: (an int) spelled as a size, so building the parser imports no server code (a test checks that
#: the two agree); `corekv serve` and `corekv route` both take it
DEFAULT_MAX_REQUEST_SIZE = "4MiB"


class UsageError(Exception):
    """A command-line argument is wrong (exit code 2, like argparse's own errors)."""


class Parser(argparse.ArgumentParser):
    # NOTE: argparse prints the whole usage block and exits; corekv errors are one line and
    # main() must return its exit code rather than raise SystemExit.
    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def parser_kwargs(description: str, examples: str, notes: str = "") -> dict[str, Any]:
    """``add_parser`` keywords: the description, then ``notes`` and the examples as the epilog."""
    return {"description": description, "epilog": notes + "examples:\n" + examples,
            "formatter_class": argparse.RawDescriptionHelpFormatter}


# -- the config a command reads ------------------------------------------------------------------
def read_config_arg(args: argparse.Namespace):
    """The config named by ``--config``, else by ``$COREKV_CONFIG``, else the packaged defaults,
    and the plugin manager it was checked against (:func:`corekv.config.read_config`): a command
    that needs plugins (tokenizer, tier admin views, the config dump) uses that one manager."""
    from corekv.config import read_config

    source = getattr(args, "config", None)
    if not config_named(args):
        source = defaults_path()
    return read_config(source)


def load_config_arg(args: argparse.Namespace):
    """The config of :func:`read_config_arg`, for a command that needs no plugin manager."""
    return read_config_arg(args)[0]


def config_named(args: argparse.Namespace) -> bool:
    """Whether ``--config`` or ``$COREKV_CONFIG`` names a config (else: the packaged defaults)."""
    from corekv.config import CONFIG_ENV

    return getattr(args, "config", None) is not None or bool(os.environ.get(CONFIG_ENV))


def defaults_path() -> str:
    """The packaged default config file (``corekv/defaults.yaml``) the CLI uses when none is named."""
    from importlib.resources import files

    return str(files("corekv").joinpath(DEFAULTS_FILE))


def config_plugins(args: argparse.Namespace) -> tuple[str, ...]:
    """The config's ``plugins:`` when a config is named (by --config or COREKV_CONFIG)."""
    return load_config_arg(args).plugins if config_named(args) else ()


def api_key_arg(value: str | None, flag: str, env: str) -> str | None:
    """The key from ``flag``'s value, else from ``$env``, else None; an empty or unsendable key
    (either way) is a UsageError naming where it came from, never quoting the key."""
    from corekv.server.auth import check_api_key

    source = flag
    if value is None:
        value, source = os.environ.get(env), f"${env}"
        if value is None:
            return None
    try:
        return check_api_key(value, source)
    except ValueError as e:
        raise UsageError(str(e)) from None


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


def int_at_least(minimum: int):
    return number_arg(int, f"an integer >= {minimum}", low=minimum)


def float_at_least(minimum: float):
    return number_arg(float, f"a finite number >= {minimum:g}", low=minimum)


def port_arg(*, can_pick_free: bool):
    """An argparse ``type``: a TCP port 1-65535; with ``can_pick_free`` also 0, "any free port",
    for a command that binds first and then tells which (`corekv serve` logs it); `corekv route`
    announces its address before uvicorn binds, so it needs a real port."""
    low = 0 if can_pick_free else 1
    return number_arg(int, f"a port number {low}-65535", low=low, high=65535)


seconds_at_least_0 = number_arg(float, "a finite number of seconds >= 0", low=0.0)
positive_seconds = number_arg(float, "seconds > 0", low=0.0, above=True)
fraction = number_arg(float, "a number in [0, 1]", low=0.0, high=1.0)


def size_arg(text: str) -> int:
    """An argparse ``type``: a byte size >= 1 (``4MiB``, ``1MB``, ``65536``)."""
    value = parse_size(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a size >= 1 byte ({SIZE_EXAMPLES})")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def duration_arg(text: str) -> float:
    """An argparse ``type``: an age or a duration, in seconds (``90s``, ``30m``, ``12h``, ``7d``,
    ``2w``; a bare number is seconds)."""
    match = _DURATION_RE.match(text)
    unit = match.group(2).lower() if match else None
    if unit not in _DURATION_UNITS and unit != "":
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number and a unit, one of "
                                         "s, m, h, d, w (e.g. 12h or 7d)")
    return float(match.group(1)) * _DURATION_UNITS.get(unit, 1)


def non_empty(text: str) -> str:
    """An argparse ``type``: any text but an empty or blank one."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a non-empty name")
    return text


def choice_arg(choices: tuple[str, ...]):
    """An argparse ``type``: one of ``choices``, case-insensitive (returned lower-case)."""
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected one of {', '.join(choices)}")
        return text.lower()
    return parse
