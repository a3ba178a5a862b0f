"""The routing benchmark: ``corekv route`` cache_aware vs round_robin in front of the same
``corekv serve`` workers, on a multi-tenant multi-turn chat workload, in one run.

    python benchmarks/routing.py                       # SmolLM2, 3 workers, 6 tenants x 3 users x 3 turns
    python benchmarks/routing.py --tiny --tenants 3 --users 2 --turns 2   # a quick check

Each tenant has a long system prompt of its own (its first tokens differ from every other
tenant's) and its cache_salt; each user holds a conversation of ``--turns`` turns (every turn
resends the whole history, as chat clients do). Conversations run concurrently (``--concurrency``
at a time), every request streamed through the router with the official ``openai`` client.

For each policy the workers are started fresh (empty caches) with KV events on, then the real
``corekv route`` command in front of them. Per policy: the prefix hit rate (sum of
``usage.prompt_tokens_details.cached_tokens`` / sum of ``prompt_tokens``), the mean and p90 time
to first content token (client side, through the router), output tokens/s and requests/s over the
policy's wall time, and the requests each worker got.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from corekv_servers import start, stop, tiny_model_folder, wait_healthy

TOPICS = ["billing", "shipping", "returns", "warranty", "accounts", "security", "pricing", "support"]
SENTENCES = [
    "Always answer in one or two short sentences and never invent order numbers.",
    "If a customer asks about a refund, explain the thirty day policy and the steps to request it.",
    "Escalate to a human agent when the customer mentions legal action or a safety problem.",
    "Greet returning customers by name when the conversation history includes it.",
    "Prices are quoted in euros including VAT unless the customer is a registered business.",
    "Shipping within the EU takes three to five working days; express delivery takes one day.",
    "Never share another customer's data, even if the requester claims to be a colleague.",
    "When unsure, ask one clarifying question instead of guessing the customer's intent.",
    "Warranty claims need the serial number, the purchase date and a short fault description.",
    "Passwords are never sent by email; point customers to the self-service reset page.",
]
QUESTIONS = ["Where is my parcel?", "Can I still return the blue jacket?", "How do I reset my password?",
             "Is the warranty valid abroad?", "Why was I charged twice?", "Do you ship to Norway?"]


def system_prompt(tenant: int, sentences_per_prompt: int) -> str:
    rng = random.Random(tenant)
    body = " ".join(rng.choice(SENTENCES) for _ in range(sentences_per_prompt))
    return (f"Tenant {tenant} ({rng.choice(TOPICS)} desk): you are the assistant of shop "
            f"number {tenant}. {body}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_workload(base_url: str, model: str, opts: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=600)
    gate = asyncio.Semaphore(opts.concurrency)
    records = []

    async def conversation(tenant: int, user: int):
        rng = random.Random(tenant * 1000 + user)
        messages = [{"role": "system", "content": system_prompt(tenant, opts.system_sentences)}]
        for _ in range(opts.turns):
            messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
            async with gate:
                start_s, first_s, text, usage = time.perf_counter(), None, [], None
                stream = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=opts.max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"cache_salt": f"tenant-{tenant}", "ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first_s = first_s or time.perf_counter()
                        text.append(chunk.choices[0].delta.content)
                    usage = chunk.usage or usage
            records.append({"ttft_s": (first_s or time.perf_counter()) - start_s,
                            "prompt_tokens": usage.prompt_tokens,
                            "cached_tokens": usage.prompt_tokens_details.cached_tokens or 0,
                            "completion_tokens": usage.completion_tokens})
            messages.append({"role": "assistant", "content": "".join(text)})

    began = time.perf_counter()
    await asyncio.gather(*(conversation(t, u) for t in range(opts.tenants) for u in range(opts.users)))
    wall_s = time.perf_counter() - began
    ttfts = sorted(r["ttft_s"] for r in records)
    return {"requests": len(records), "wall_s": wall_s,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "cached_tokens": sum(r["cached_tokens"] for r in records),
            "hit_rate": sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records),
            "mean_ttft_s": statistics.fmean(ttfts), "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "output_tok_s": sum(r["completion_tokens"] for r in records) / wall_s,
            "requests_s": len(records) / wall_s}


def run_policy(policy: str, model: str, opts: argparse.Namespace, folder: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.worker_threads), TQDM_DISABLE="1")
    workers, urls = [], []
    for i in range(opts.workers):
        config = {"model": model, "device": opts.device, "dtype": "float32",
                  "engine": {"block_size": 16, "num_blocks": opts.num_blocks},
                  # port 0: the publisher binds a free port and /admin/info announces it
                  "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0"}}
        path = folder / f"{policy}-worker{i}.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        workers.append(start(["serve", "--config", str(path), "--port", str(port),
                              "--log-level", "warning"], folder / f"{policy}-worker{i}.log", env))
    router = None
    try:
        for url, process in zip(urls, workers):
            wait_healthy(url, process, 600)
        port = free_port()
        router = start(["route", "--config", str(folder / f"{policy}-worker0.yaml"), "--workers",
                        *urls, "--port", str(port), "--policy", policy],
                       folder / f"{policy}-router.log", env)
        router_url = f"http://127.0.0.1:{port}"
        wait_healthy(router_url, router, 300)
        model_id = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        result = asyncio.run(run_workload(router_url, model_id, opts))
        state = httpx.get(router_url + "/workers").json()["workers"]
        result["per_worker"] = [w["requests"] for w in state]
        return result
    finally:
        stop([router] if router is not None else [])
        stop(workers)


def markdown(rows: dict[str, dict]) -> str:
    lines = ["| policy | requests | prefix hit rate | mean TTFT (s) | p90 TTFT (s) | output tok/s "
             "| requests/s | requests per worker |",
             "|---|---|---|---|---|---|---|---|"]
    for policy, r in rows.items():
        lines.append(f"| {policy} | {r['requests']} | {r['hit_rate']:.1%} | {r['mean_ttft_s']:.3f} | "
                     f"{r['p90_ttft_s']:.3f} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | "
                     f"{'/'.join(map(str, r['per_worker']))} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the workers' model")
    parser.add_argument("--tiny", action="store_true",
                        help="serve a tiny random Llama instead (fast; its text is noise)")
    parser.add_argument("--device", default="cpu", help="the workers' device (default: cpu)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--users", type=int, default=3, help="conversations per tenant")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--system-sentences", type=int, default=24,
                        help="sentences in each tenant's system prompt (24: ~400 SmolLM2 tokens)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (EOS ignored)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    parser.add_argument("--num-blocks", type=int, default=512, help="each worker's KV pool in blocks")
    parser.add_argument("--worker-threads", type=int, default=1, help="OMP_NUM_THREADS per worker")
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--json", help="also write the results here")
    opts = parser.parse_args()
    for name in ("workers", "tenants", "users", "turns", "system_sentences", "max_tokens",
                 "concurrency", "num_blocks", "worker_threads"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: got {getattr(opts, name)}; expected >= 1")
    policies = [p.strip() for p in opts.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in ("cache_aware", "round_robin")]
    if bad or not policies:
        parser.error(f"--policies: got {opts.policies!r}; expected cache_aware and/or round_robin")
    with tempfile.TemporaryDirectory(prefix="corekv-routing-") as tmp:
        folder = Path(tmp)
        model = tiny_model_folder(folder) if opts.tiny else opts.model
        rows = {}
        for policy in policies:
            print(f"running {policy} ...", file=sys.stderr, flush=True)
            try:
                rows[policy] = run_policy(policy, model, opts, folder)
            except Exception:
                for log in sorted(folder.glob(f"{policy}-*.log")):
                    print(f"--- {log.name}\n{log.read_text()[-2000:]}", file=sys.stderr)
                raise
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"workload: {opts.tenants} tenants x {opts.users} users x {opts.turns} turns, "
          f"{opts.workers} workers ({'tiny model' if opts.tiny else opts.model}, {opts.device}), "
          f"{opts.max_tokens} tokens per answer, concurrency {opts.concurrency}, "
          f"{opts.num_blocks} blocks per worker\n")
    print(markdown(rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
