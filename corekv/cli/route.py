"""``corekv route``: the command-line side of :mod:`corekv.router`.

The config (``--config``) names the workers' model: the router loads only its tokenizer, to see
prompts as the workers' engines do. The router speaks the workers' API, so its client key
(``$COREKV_API_KEY``) and request size limit are spelled as ``corekv serve``'s. Workers may be
vLLM servers: ``--worker-events`` names the KV-event publisher that their missing
``GET /admin/info`` cannot announce.
"""
from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

from corekv.cli.args import (API_KEY_ENV, DEFAULT_MAX_REQUEST_SIZE, UsageError, api_key_arg,
                             float_at_least, fraction, int_at_least, parser_kwargs, read_config_arg,
                             port_arg, positive_seconds, size_arg)
from corekv.config.values import did_you_mean
from corekv.router.policy import POLICY_NAMES
from corekv.router.workers import EventEndpoints

DEFAULT_PORT = 8080
#: where --worker-api-key is read from when the flag is not given
WORKER_API_KEY_ENV = "COREKV_WORKER_API_KEY"
#: where --admin-key is read from when the flag is not given
ADMIN_KEY_ENV = "COREKV_ROUTER_ADMIN_KEY"
#: --worker-events' shape, and the options after its endpoint
WORKER_EVENTS_FORM = "URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC]"
WORKER_EVENTS_OPTIONS = ("replay", "topic")
WORKER_EVENTS_EXAMPLE = "http://gpu1:8000=tcp://gpu1:5557,replay=tcp://gpu1:5558"


def add_route_command(commands, common) -> None:
    p = commands.add_parser("route", parents=[common], help="route requests across workers",
                            **parser_kwargs(
                                "A cache-aware router in front of several `corekv serve` workers "
                                "(or vLLM servers).\n"
                                "Each OpenAI request goes to the worker most likely to hold its "
                                "prompt's prefix\n(known from the workers' KV events, else from the "
                                "prompts sent to them),\nunless load is skewed; unhealthy workers are "
                                "skipped, and a request whose\nworker fails before answering is "
                                "retried on another one.",
                                "  corekv route --workers http://127.0.0.1:8001 "
                                "http://127.0.0.1:8002 --port 8080\n"
                                "  corekv route --config serve.yaml --workers http://gpu1:8000 "
                                "http://gpu2:8000 --cache-threshold 0.5\n"
                                "  corekv route --workers http://127.0.0.1:8001 "
                                "http://127.0.0.1:8002 --policy round_robin\n"
                                f"  {API_KEY_ENV}=client-key {WORKER_API_KEY_ENV}=worker-key "
                                "corekv route --workers http://gpu1:8000 http://gpu2:8000\n"
                                "  corekv route --config vllm-model.yaml --workers http://gpu1:8000 "
                                f"--worker-events {WORKER_EVENTS_EXAMPLE}\n",
                                "endpoints: POST /v1/completions, POST /v1/chat/completions, "
                                "GET /v1/models, GET /health,\nGET /workers (each worker's state). "
                                "With an API key, every endpoint but /health\nneeds "
                                "'Authorization: Bearer KEY'. See docs/route.md.\n\n"))
    p.add_argument("--workers", metavar="URL", nargs="+", required=True,
                   help="the workers' base URLs (http://HOST:PORT), each once")
    p.add_argument("--worker-events", metavar=WORKER_EVENTS_FORM, action="append", default=[],
                   help="where the worker at URL (one of --workers) publishes its KV events: a "
                        "ZMQ address tcp://HOST:PORT or ipc://PATH, with its replay socket if it "
                        "has one; once per worker. For vLLM servers (their "
                        "--kv-events-config endpoint, replay_endpoint and topic), which do not "
                        "announce them on GET /admin/info as corekv serve does; takes precedence "
                        "over an announced publisher")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", metavar="P", type=port_arg(can_pick_free=False), default=DEFAULT_PORT,
                   help=f"port to listen on (default: {DEFAULT_PORT})")
    p.add_argument("--policy", choices=POLICY_NAMES, default="cache_aware",
                   help="cache_aware (default) or round_robin (the cache-blind baseline)")
    p.add_argument("--cache-threshold", metavar="F", type=fraction, default=0.3,
                   help="follow the longest cached prefix when it covers at least this fraction "
                        "of the prompt, else pick the worker with the most free cache "
                        "(default: 0.3)")
    p.add_argument("--balance-abs-threshold", metavar="N", type=int_at_least(0), default=32,
                   help="load is imbalanced when the most and least loaded workers' in-flight "
                        "requests differ by more than N ... (default: 32)")
    p.add_argument("--balance-rel-threshold", metavar="R", type=float_at_least(1.0), default=1.5,
                   help="... and the most loaded has more than R times the least's; then the least "
                        "loaded worker gets the request (default: 1.5)")
    p.add_argument("--health-interval", metavar="S", type=positive_seconds, default=2.0,
                   help="seconds between health checks of each worker (default: 2)")
    p.add_argument("--max-retries", metavar="N", type=int_at_least(0), default=2,
                   help="other workers to try when a worker fails before answering (default: 2)")
    p.add_argument("--tree-blocks", metavar="N", type=int_at_least(1), default=65536,
                   help="blocks each worker's cache view keeps when it is built from routed prompts "
                        "(least recently routed evicted first; default: 65536)")
    p.add_argument("--request-timeout", metavar="S", type=positive_seconds, default=600.0,
                   help="seconds to wait for a worker's answer (or next stream bytes) "
                        "(default: 600)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' from clients on every endpoint but "
                        f"/health (401 otherwise); default: ${API_KEY_ENV}, else none")
    p.add_argument("--worker-api-key", metavar="KEY",
                   help=f"the key the workers were started with (their --api-key), sent with "
                        f"every request to them, health checks included; the clients' key is "
                        f"never forwarded. Default: ${WORKER_API_KEY_ENV}, else none. Prefer the "
                        f"variables: flags show in ps")
    p.add_argument("--admin-key", metavar="KEY",
                   help=f"require this key (not --api-key's) for GET /workers, which shows every "
                        f"worker's traffic; default: ${ADMIN_KEY_ENV}, else --api-key guards it")
    p.add_argument("--max-request-bytes", metavar="SIZE", type=size_arg,
                   default=DEFAULT_MAX_REQUEST_SIZE,
                   help=f"larger request bodies are answered 413 before they are read "
                        f"(default: {DEFAULT_MAX_REQUEST_SIZE})")
    p.set_defaults(handler=cmd_route)


def cmd_route(args: argparse.Namespace) -> int:
    import uvicorn

    from corekv.engine.models import load_tokenizer
    from corekv.router.app import build_app
    from corekv.router.policy import CacheAwareConfig, make_policy
    from corekv.router.health import WorkerPool

    urls = [_worker_url(url) for url in args.workers]
    duplicates = sorted({u for u in urls if urls.count(u) > 1})
    if duplicates:
        raise UsageError(f"--workers: got {', '.join(duplicates)} more than once; name each worker once")
    worker_events = _worker_events(args.worker_events, urls)
    api_key = api_key_arg(args.api_key, "--api-key", API_KEY_ENV)
    worker_api_key = api_key_arg(args.worker_api_key, "--worker-api-key", WORKER_API_KEY_ENV)
    admin_key = api_key_arg(args.admin_key, "--admin-key", ADMIN_KEY_ENV)
    cfg, plugin_manager = read_config_arg(args)
    tokenizer = load_tokenizer(cfg.model, plugin_manager=plugin_manager)
    policy = make_policy(args.policy, CacheAwareConfig(
        cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold))
    pool = WorkerPool(urls, block_size=cfg.engine.block_size, max_tree_blocks=args.tree_blocks,
                      health_interval_s=args.health_interval, worker_api_key=worker_api_key,
                      worker_events=worker_events)
    app = build_app(pool, policy, tokenizer, max_retries=args.max_retries,
                    request_timeout_s=args.request_timeout, api_key=api_key,
                    max_request_bytes=args.max_request_bytes, admin_key=admin_key)
    print(f"corekv route: http://{args.host}:{args.port} -> {len(urls)} workers "
          f"({args.policy}, model {cfg.model})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _worker_url(text: str, flag: str = "--workers") -> str:
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UsageError(f"{flag}: got {text!r}; expected a worker's base URL "
                         "http://HOST:PORT (e.g. http://127.0.0.1:8001), without a path")
    return f"{parts.scheme}://{parts.netloc}"


def _worker_events(texts: list[str], urls: list[str]) -> dict[str, EventEndpoints]:
    """``--worker-events`` as ``{worker URL: EventEndpoints}``, every part checked."""
    named: dict[str, EventEndpoints] = {}
    for text in texts:
        url_text, sep, rest = text.partition("=")
        if not sep or not url_text or not rest:
            raise UsageError(f"--worker-events: got {text!r}; expected {WORKER_EVENTS_FORM} "
                             f"(e.g. {WORKER_EVENTS_EXAMPLE})")
        url = _worker_url(url_text, "--worker-events")
        if url not in urls:
            raise UsageError(f"--worker-events: got events for {url}, which is not one of "
                             f"--workers; add it to --workers, or use one of their URLs")
        if url in named:
            raise UsageError(f"--worker-events: got {url} more than once; name each worker's "
                             "events once")
        endpoint, *options = rest.split(",")
        settings: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if key not in WORKER_EVENTS_OPTIONS or not sep:
                raise UsageError(f"--worker-events: got {option!r} in {text!r}; expected "
                                 f"replay=ENDPOINT or topic=TOPIC after the endpoint"
                                 f"{did_you_mean(key.partition('_')[0], WORKER_EVENTS_OPTIONS)}")
            if key in settings:
                raise UsageError(f"--worker-events: got {key}= twice in {text!r}; give it once")
            settings[key] = value
        _zmq_address(endpoint, url)
        replay = settings.get("replay")
        if replay is not None:
            _zmq_address(replay, url)
            if replay == endpoint:
                raise UsageError(f"--worker-events: got {endpoint} as both the endpoint and the "
                                 f"replay endpoint of {url}; the replay socket has an address of "
                                 "its own (vLLM's replay_endpoint)")
        named[url] = EventEndpoints(endpoint, replay, settings.get("topic", ""))
    return named


def _zmq_address(text: str, url: str) -> None:
    """``tcp://HOST:PORT`` (HOST may be ``*``: the worker's host) or ``ipc://PATH``."""
    scheme, sep, rest = text.partition("://")
    host, colon, port = rest.rpartition(":")
    is_tcp = scheme == "tcp" and colon and host and port.isdigit() and 1 <= int(port) <= 65535
    if not sep or not (is_tcp or (scheme == "ipc" and rest)):
        raise UsageError(f"--worker-events: got the address {text!r} for {url}; expected a ZMQ "
                         "address the router can connect to, tcp://HOST:PORT or ipc://PATH "
                         f"(e.g. {WORKER_EVENTS_EXAMPLE})")
