"""Two tenants, one system prompt, no shared KV: ``cache_salt`` isolates tenants' prefix caches.

Tenants A and B send the same system prompt with their own ``cache_salt``. The salt seeds the
chained block hashes, so the same tokens under two salts are two different cache keys: B's first
request must compute everything even though A's identical request just cached it (no cross-tenant
hit, hence no timing side channel), while each tenant's second request reuses that tenant's system
prompt blocks. A request without a salt sees neither tenant's blocks.

Run from the repository root::

    python examples/multi_tenant.py --config examples/configs/multitenant.yaml --max-tokens 8

It prints each request and each check, and exits with status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import secrets
import sys
from pathlib import Path

import corekv

HERE = Path(__file__).resolve().parent
SYSTEM = ("You are the assistant of a travel agency. Answer questions about flights, hotels, "
          "trains and travel documents; be brief and concrete, give prices in euros, and say when "
          "you do not know. Never share one customer's bookings with another customer.")
QUESTIONS = ("Which documents do I need to fly within the European Union?",
             "How early should I be at the airport for a short flight?")


def ask(engine: corekv.Engine, tenant: str, salt: str | None, question: str, max_tokens: int) -> dict:
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    params = corekv.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = engine.generate([conversation], params, cache_salt=salt, use_tqdm=False)[0]
    tiers = ", ".join(f"{name}={n}" for name, n in out.cached_tokens_by_tier.items() if n) or "-"
    row = {"tenant": tenant, "salt": salt, "question": QUESTIONS.index(question) + 1,
           "tokens": len(out.prompt_token_ids), "cached": out.num_cached_tokens, "from": tiers,
           "token_ids": out.token_ids, "text": out.text}
    print(f"{tenant:<9} {str(salt):<16} {row['question']:>8} {row['tokens']:>6} {row['cached']:>6}  {tiers}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "configs" / "multitenant.yaml"),
                        help="a corekv YAML config (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens to generate per answer")
    parser.add_argument("--model", default=None,
                        help="override the config's model (an alias, a Hugging Face folder, a .gguf)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}; e.g. --max-tokens 8")
    try:
        return run(args)
    except corekv.CoreKVError as e:  # config and model errors name their fix
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    cfg = corekv.load_config(args.config)
    if args.model is not None:
        cfg = dataclasses.replace(cfg, model=args.model)
    if not cfg.engine.enable_prefix_caching:
        raise SystemExit(f"{args.config}: engine.enable_prefix_caching is false; nothing is cached")
    persistent = [t.name for t in cfg.cache.tiers if t.type in ("lmdb", "redis", "fsspec")]
    suffix = ""
    if persistent:
        # NOTE: blocks an earlier run stored under the same salt are legitimate same-tenant hits
        # that would make the first requests hit; a per-run suffix keeps the checks about this run.
        suffix = "-" + secrets.token_hex(3)
        print(f"note: tiers {persistent} keep blocks across runs, so this run's salts end in "
              f"{suffix!r} and the unsalted request is skipped")
    with corekv.Engine.from_config(cfg) as engine:
        bs = engine.block_size
        system_tokens = len(engine.encode([{"role": "system", "content": SYSTEM}],
                                          add_generation_prompt=False))
        system_blocks = system_tokens // bs * bs
        print(f"model {cfg.model}, block size {bs}; the shared system prompt is {system_tokens} "
              f"tokens ({system_blocks} in full blocks)")
        print(f"{'tenant':<9} {'salt':<16} {'question':>8} {'tokens':>6} {'cached':>6}  from")
        a1 = ask(engine, "A", "tenant-a" + suffix, QUESTIONS[0], args.max_tokens)
        a2 = ask(engine, "A", "tenant-a" + suffix, QUESTIONS[1], args.max_tokens)
        b1 = ask(engine, "B", "tenant-b" + suffix, QUESTIONS[0], args.max_tokens)
        b2 = ask(engine, "B", "tenant-b" + suffix, QUESTIONS[1], args.max_tokens)
        unsalted = None if persistent else ask(engine, "no salt", None, QUESTIONS[0], args.max_tokens)
    print(f"answer to question 1: {a1['text']!r}")
    checks = [
        (b1["cached"] == 0, f"no cross-tenant hit: B's first request (the same prompt A just cached) "
                            f"reused {b1['cached']} tokens (expected 0)"),
        (a2["cached"] >= system_blocks > 0, f"same-tenant hit: A's second request reused "
                                           f"{a2['cached']} tokens (expected >= {system_blocks}, the "
                                           "system prompt's full blocks)"),
        (b2["cached"] >= system_blocks > 0, f"same-tenant hit: B's second request reused "
                                           f"{b2['cached']} tokens (expected >= {system_blocks})"),
        (a1["token_ids"] == b1["token_ids"], "the salt changes caching, not answers: A and B "
                                             "generated the same tokens for the same prompt"),
    ]
    if unsalted is not None:
        checks += [
            (unsalted["cached"] == 0, f"no hit without a salt: the unsalted request reused "
                                      f"{unsalted['cached']} tokens (expected 0)"),
            (unsalted["token_ids"] == a1["token_ids"], "the unsalted request generated the same "
                                                       "tokens as A and B"),
        ]
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    failed = sum(not ok for ok, _ in checks)
    print(f"{len(checks) - failed} of {len(checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
