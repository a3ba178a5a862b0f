"""``corekv generate`` and ``corekv warm``: the commands that load the config's model and cache
into an :class:`corekv.Engine`, the one to generate a reply, the other to compute and keep a
prefix for later requests."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from corekv.cli.args import UsageError, float_at_least, int_at_least, parser_kwargs, read_config_arg
from corekv.cli.output import progress


def add_generate_command(commands, common) -> None:
    p = commands.add_parser("generate", parents=[common], help="generate text for one prompt",
                            **parser_kwargs(
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
    p.add_argument("--max-tokens", metavar="N", type=int_at_least(1), default=64,
                   help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", metavar="T", type=float_at_least(0.0), default=0.0,
                   help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--stats", action="store_true",
                   help="also print, one line each on stderr, the cached tokens, the cached tokens "
                        "by tier and the time to first token")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead: the text, the request's cache facts and "
                        "the whole engine.stats()")
    p.set_defaults(handler=cmd_generate)


def add_warm_command(commands, common) -> None:
    p = commands.add_parser("warm", parents=[common], help="compute and keep a prefix",
                            **parser_kwargs(
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
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a system message through the model's chat template (as "
                        "cache.pinned's chat: true does), the prefix of later chat requests")
    p.add_argument("--salt", metavar="S", help="cache_salt the prefix is kept for")
    p.add_argument("--pin", action="store_true",
                   help="also pin it in this process's device pool, until the command exits (to keep "
                        "a prefix pinned in a server, list it under cache.pinned)")
    p.add_argument("--stats", action="store_true", help="also print the engine's stats (stderr)")
    p.add_argument("--json", action="store_true", help="with --stats: the stats as JSON")
    p.set_defaults(handler=cmd_warm)


def cmd_generate(args: argparse.Namespace) -> int:
    import corekv

    cfg, plugin_manager = read_config_arg(args)
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    params = corekv.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    # NOTE: on a terminal the answer appears as it is generated; piped, it is printed whole (the same text)
    is_streamed = not args.json and sys.stdout.isatty()
    with corekv.Engine.from_config(cfg, plugin_manager=plugin_manager) as engine:
        out = (_generate_streaming(engine, prompt, params, args.salt) if is_streamed
               else engine.generate([prompt], params, cache_salt=args.salt)[0])
        stats = engine.stats() if args.json or args.stats else None
    if args.json:
        print(json.dumps({"text": out.text, "num_cached_tokens": out.num_cached_tokens,
                          "cached_tokens_by_tier": out.cached_tokens_by_tier, "ttft_s": out.ttft_s,
                          "stats": stats}, indent=2, default=str))
        return 0
    if not is_streamed:
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


def _generate_streaming(engine: Any, prompt: Any, params: Any, salt: str | None) -> Any:
    """Run one request, printing its text as it comes; returns its output (the text ends with a
    newline on stdout, as the whole answer printed at once would)."""
    request_id = engine.add_request(prompt, params, cache_salt=salt)
    stream = engine.text_stream(request_id)
    printed = ""
    while True:
        finished = [o for o in engine.step() if o.request_id == request_id]
        for _, delta in stream.deltas():
            printed += delta
            print(delta, end="", flush=True)
        if finished:
            out = finished[0]
            print(out.text[len(printed):] if out.text.startswith(printed) else "")
            return out


def cmd_warm(args: argparse.Namespace) -> int:
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
    cfg, plugin_manager = read_config_arg(args)
    with corekv.Engine.from_config(cfg, plugin_manager=plugin_manager) as engine:
        counts = [engine.warm([{"role": "system", "content": p}] if args.chat else p, pin=args.pin,
                              cache_salt=args.salt)
                  for p in progress(prompts, "warm", unit="prompt")]
        stats = engine.stats() if args.stats else None
        tier_names = [tier.name for tier in cfg.cache.tiers]
    what = f"{counts[0]} prompt tokens" if len(counts) == 1 else f"{sum(counts)} prompt tokens in {len(counts)} prompts"
    # NOTE: say where the KV outlives this command: only in the config's tiers; a pin does not
    if not tier_names:
        where = "no tier is configured, so they are gone when this command exits"
    else:
        where = f"kept in tier{'s' if len(tier_names) > 1 else ''} {', '.join(tier_names)} for later processes"
    print(f"warmed {what}: {where}" + ("; pinned until this command exits" if args.pin else ""))
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
