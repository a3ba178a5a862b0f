"""``corekv serve``: the command-line side of :mod:`corekv.server` (an OpenAI-compatible server).

Split from :mod:`corekv.cli` (which builds the parser and runs the handlers) to keep each module
about one thing; it reuses the CLI's parser class, usage errors and argument types.
"""
from __future__ import annotations

import argparse
import os

from corekv.cli import UsageError, _load, _parser_kwargs, number_arg
from corekv.config.values import SIZE_EXAMPLES, parse_size

#: where --api-key is read from when the flag is not given (corekv route's clients' key too)
API_KEY_ENV = "COREKV_API_KEY"
#: corekv.server.limits.DEFAULT_MAX_REQUEST_BYTES, spelled here so building the parser imports no
#: server code (a test checks that the two agree)
DEFAULT_MAX_REQUEST_BYTES = "4MiB"


def add_serve_command(commands, common) -> None:
    from corekv.server.serving import LOG_LEVELS

    p = commands.add_parser("serve", parents=[common], help="serve the OpenAI API over HTTP",
                            **_parser_kwargs(
                                "Serve the config's model with an OpenAI-compatible API "
                                "(/v1/completions, /v1/chat/completions, /v1/models), plus "
                                "/health, /metrics and /admin/{warm,unpin,stats,info}. With an API "
                                "key, every endpoint but /health needs 'Authorization: Bearer KEY'. "
                                "SIGTERM or Ctrl-C stops accepting requests, lets those in flight "
                                "finish (at most --drain-timeout seconds), then closes the engine, "
                                "which writes pending blocks to the storage tiers.",
                                "  corekv serve --config cache.yaml\n"
                                "  COREKV_API_KEY=$(cat key.txt) corekv serve --config cache.yaml "
                                "--host 0.0.0.0\n"
                                "  corekv serve --served-model-name smollm2 --drain-timeout 10\n"))
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=_port, default=8000,
                   help="TCP port (default: 8000; 0 picks a free one, logged at startup)")
    p.add_argument("--served-model-name", metavar="NAME", type=_non_empty,
                   help="the model id clients send and /v1/models lists (default: the config's model)")
    p.add_argument("--drain-timeout", metavar="S", type=_seconds, default=30.0,
                   help="on shutdown, seconds to let requests in flight finish (default: 30)")
    p.add_argument("--log-level", metavar="L", type=_choice(LOG_LEVELS), default="info",
                   help=f"server log level: {', '.join(LOG_LEVELS)} (default: info)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
                        f"otherwise; the openai client sends its api_key so); default: "
                        f"${API_KEY_ENV}, else none. Prefer the variable: a flag shows in ps")
    p.add_argument("--max-request-bytes", metavar="SIZE", type=size_arg, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies are answered 413 before they are read (e.g. 4MiB, "
                        f"1MB, 65536; default: {DEFAULT_MAX_REQUEST_BYTES})")
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from corekv.server.serving import serve

    if not args.host.strip():
        raise UsageError("--host: got an empty string; pass an address such as 127.0.0.1 or 0.0.0.0")
    api_key = api_key_arg(args.api_key, "--api-key", API_KEY_ENV)
    cfg = _load(args)
    try:
        serve(cfg, args.host, args.port, served_model_name=args.served_model_name,
              drain_timeout=args.drain_timeout, log_level=args.log_level, api_key=api_key,
              max_request_bytes=args.max_request_bytes)
    except OSError as e:  # NOTE: the address cannot be bound; the message names it and the fix
        from corekv.errors import CoreKVError

        raise CoreKVError(str(e)) from e
    return 0


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
_port = number_arg(int, "an integer port in 0..65535", low=0, high=65535)
_seconds = number_arg(float, "a finite number of seconds >= 0", low=0.0)


def size_arg(text: str) -> int:
    """An argparse ``type``: a byte size >= 1 (``4MiB``, ``1MB``, ``65536``)."""
    value = parse_size(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a size >= 1 byte ({SIZE_EXAMPLES})")
    return value


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a non-empty name")
    return text


def _choice(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected one of {', '.join(choices)}")
        return text.lower()
    return parse
