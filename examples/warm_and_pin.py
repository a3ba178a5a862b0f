"""Warm and pin system prompts, and watch their time to first token fall — even after a restart.

For each system prompt in a file it runs three conversations (each with a new user question, so
only the system prompt can be reused) and prints one table row per conversation:

- ``cold``: a fresh engine computes the whole prompt;
- ``warmed``: after ``engine.warm(system prompt, pin=True)`` the system prompt's blocks are pinned
  on the device, so only the user turn is computed;
- ``restart``: the first engine is closed (its cached blocks are written to the LMDB tier) and a new
  engine — new device pool, empty host arena — on the same LMDB path reloads the system prompt's
  blocks from disk instead of recomputing them (``cached_tokens_by_tier`` shows ``lmdb``).

Run from the repository root (the LMDB path in tiered.yaml is relative to the working directory)::

    python examples/warm_and_pin.py --config examples/configs/tiered.yaml \\
        --prompts-file examples/system_prompts.txt --max-tokens 8

The prompts file holds one system prompt per line or, when it has blank lines, one per paragraph
(the paragraph's lines joined by spaces); lines starting with ``#`` are comments.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import corekv
from corekv.backend import PinLimitError

HERE = Path(__file__).resolve().parent
QUESTIONS = {  # NOTE: a new question per phase, so a hit can only come from the system prompt
    "cold": "What is a KV cache? Answer in one sentence.",
    "warmed": "Why does reusing a prompt prefix save time?",
    "restart": "Name one thing you can help me with.",
}


def read_system_prompts(path: Path) -> list[str]:
    """The system prompts in ``path``: one per paragraph when blank lines separate them, else one
    per line; ``#`` lines are comments."""
    if not path.is_file():
        raise SystemExit(f"--prompts-file {str(path)!r} is not a file; pass a text file with one "
                         "system prompt per line (or per blank-line separated paragraph)")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()
             if not ln.lstrip().startswith("#")]
    body = "\n".join(lines).strip()
    if "\n\n" in body:
        prompts = [" ".join(p.split("\n")) for p in body.split("\n\n")]
    else:
        prompts = body.split("\n")
    prompts = [p.strip() for p in prompts if p.strip()]
    if not prompts:
        raise SystemExit(f"--prompts-file {str(path)!r} holds no system prompt; write one per line")
    return prompts


def load(config_path: str, model: str | None) -> corekv.Config:
    cfg = corekv.load_config(config_path)
    if model is not None:
        cfg = dataclasses.replace(cfg, model=model)
    if not cfg.engine.enable_prefix_caching:
        raise SystemExit(f"{config_path}: engine.enable_prefix_caching is false; warming needs it on")
    return cfg


def conversation(system: str, phase: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[phase]}]


def ask(engine: corekv.Engine, system: str, phase: str, index: int, max_tokens: int) -> dict:
    params = corekv.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = engine.generate([conversation(system, phase)], params, use_tqdm=False)[0]
    tiers = ", ".join(f"{name}={n}" for name, n in out.cached_tokens_by_tier.items() if n) or "-"
    return {"phase": phase, "prompt": index, "tokens": len(out.prompt_token_ids),
            "cached": out.num_cached_tokens, "from": tiers, "by_tier": dict(out.cached_tokens_by_tier),
            "ttft_ms": 1000 * (out.ttft_s or 0.0), "text": out.text}


def warm_up(engine: corekv.Engine) -> None:
    # NOTE: the first forward pass of a process pays one-off costs (allocator, kernels); run it on
    # an unrelated prompt, kept off the storage tiers, so the ``cold`` row measures only compute.
    engine.generate("Hello", corekv.SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False,
                    offload=False)


def print_table(rows: list[dict]) -> None:
    header = f"{'phase':<8} {'prompt':>6} {'tokens':>6} {'cached':>6}  {'from':<24} {'TTFT ms':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['phase']:<8} {r['prompt']:>6} {r['tokens']:>6} {r['cached']:>6}  {r['from']:<24} "
              f"{r['ttft_ms']:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "configs" / "tiered.yaml"),
                        help="a corekv YAML config with an lmdb tier (default: %(default)s)")
    parser.add_argument("--prompts-file", default=str(HERE / "system_prompts.txt"),
                        help="system prompts, one per line or paragraph (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens to generate per answer")
    parser.add_argument("--model", default=None,
                        help="override the config's model (an alias, a Hugging Face folder, a .gguf)")
    args = parser.parse_args(argv)
    try:
        return run(args, parser)
    except (corekv.CoreKVError, PinLimitError) as e:  # config, model and pin-limit errors name their fix
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}; e.g. --max-tokens 8")
    prompts = read_system_prompts(Path(args.prompts_file))
    cfg = load(args.config, args.model)
    stores = [t for t in cfg.cache.tiers if t.type == "lmdb"]
    if not stores:
        print(f"note: {args.config} has no lmdb tier, so the restart rows recompute everything; "
              "use examples/configs/tiered.yaml to see the reload")

    rows = []
    with corekv.Engine.from_config(cfg) as engine:
        model = engine.model  # NOTE: the restarted engine serves the same loaded weights
        warm_up(engine)
        for i, system in enumerate(prompts, 1):
            rows.append(ask(engine, system, "cold", i, args.max_tokens))
        pinned = [engine.warm([{"role": "system", "content": s}], pin=True) for s in prompts]
        for i, system in enumerate(prompts, 1):
            rows.append(ask(engine, system, "warmed", i, args.max_tokens))
    # closing the engine wrote its cached blocks (the pinned ones included) to the lmdb tier
    with corekv.Engine.from_config(cfg, model=model) as engine:
        warm_up(engine)
        for i, system in enumerate(prompts, 1):
            rows.append(ask(engine, system, "restart", i, args.max_tokens))

    print(f"model {cfg.model}, block size {cfg.engine.block_size}, tiers "
          f"{[t.name for t in cfg.cache.tiers] or 'none'}; pinned tokens per prompt: {pinned}")
    print_table(rows)
    last = rows[-1]
    print(f"answer ({last['phase']}, prompt {last['prompt']}): {last['text']!r}")
    # NOTE: a cold row may hit the device legitimately (prompts that share their first block); a
    # hit on a persistent tier means an earlier run left these prompts in the store.
    if any(r["by_tier"].get(t.name) for r in rows if r["phase"] == "cold" for t in stores):
        print(f"note: the cold rows reloaded from {[t.options['path'] for t in stores]}: an earlier "
              "run left these prompts there; delete that directory for a cold start")
    for name in [t.name for t in stores]:
        reloaded = sum(r["by_tier"].get(name, 0) for r in rows if r["phase"] == "restart")
        print(f"restart: {reloaded} prompt tokens reloaded from {name} (tier '{name}') instead of recomputed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
