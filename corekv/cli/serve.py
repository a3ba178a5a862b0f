"""``corekv serve``: the command-line side of :mod:`corekv.server` (an OpenAI-compatible server).

Building the parser imports no server code but :mod:`corekv.server.serving`'s log levels (a
module of constants and the uvicorn runner, which imports uvicorn only when it serves).
"""
from __future__ import annotations

import argparse

from corekv.cli.args import (API_KEY_ENV, DEFAULT_MAX_REQUEST_SIZE, UsageError, api_key_arg,
                             choice_arg, non_empty, parser_kwargs, port_arg, read_config_arg,
                             seconds_at_least_0, size_arg)


def add_serve_command(commands, common) -> None:
    from corekv.server.serving import LOG_LEVELS

    p = commands.add_parser("serve", parents=[common], help="serve the OpenAI API over HTTP",
                            **parser_kwargs(
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
    p.add_argument("--port", type=port_arg(can_pick_free=True), default=8000,
                   help="TCP port (default: 8000; 0 picks a free one, logged at startup)")
    p.add_argument("--served-model-name", metavar="NAME", type=non_empty,
                   help="the model id clients send and /v1/models lists (default: the config's model)")
    p.add_argument("--drain-timeout", metavar="S", type=seconds_at_least_0, default=30.0,
                   help="on shutdown, seconds to let requests in flight finish (default: 30)")
    p.add_argument("--log-level", metavar="L", type=choice_arg(LOG_LEVELS), default="info",
                   help=f"server log level: {', '.join(LOG_LEVELS)} (default: info)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
                        f"otherwise; the openai client sends its api_key so); default: "
                        f"${API_KEY_ENV}, else none. Prefer the variable: a flag shows in ps")
    p.add_argument("--api-keys", metavar="FILE",
                   help="per-tenant keys instead of one --api-key: a YAML file 'admin: KEY' and "
                        "'tenants: {NAME: KEY}'; a tenant's requests run under cache_salt NAME, "
                        "/admin/* and /metrics need the admin key, usage is counted per tenant")
    p.add_argument("--max-request-bytes", metavar="SIZE", type=size_arg, default=DEFAULT_MAX_REQUEST_SIZE,
                   help=f"larger request bodies are answered 413 before they are read (e.g. 4MiB, "
                        f"1MB, 65536; default: {DEFAULT_MAX_REQUEST_SIZE})")
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from corekv.server.serving import serve

    if not args.host.strip():
        raise UsageError("--host: got an empty string; pass an address such as 127.0.0.1 or 0.0.0.0")
    api_keys = None
    if args.api_keys is not None:
        from corekv.server.tenants import TenantKeys

        if args.api_key is not None:
            raise UsageError("--api-key and --api-keys exclude each other; pass one")
        try:
            api_keys = TenantKeys.from_file(args.api_keys)
        except ValueError as e:
            raise UsageError(str(e)) from None
        api_key = None  # NOTE: $COREKV_API_KEY is ignored when a key file is given
    else:
        api_key = api_key_arg(args.api_key, "--api-key", API_KEY_ENV)
    cfg, plugin_manager = read_config_arg(args)
    try:
        serve(cfg, args.host, args.port, served_model_name=args.served_model_name,
              drain_timeout=args.drain_timeout, log_level=args.log_level, api_key=api_key,
              max_request_bytes=args.max_request_bytes, plugin_manager=plugin_manager,
              api_keys=api_keys)
    except OSError as e:  # NOTE: the address cannot be bound; the message names it and the fix
        from corekv.errors import CoreKVError

        raise CoreKVError(str(e)) from e
    return 0
