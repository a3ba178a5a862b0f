"""TTFT and reuse per eviction policy: multi-turn chats under memory pressure, with host + LMDB tiers.

    python benchmarks/eviction_policies.py --scale 0.25 --threads 1 --markdown --json ep.json

The seed's multi-turn workload (``workloads/chats.py``: 20 conversations x 8 turns, lengths times
``--scale``, real token ids from the seed documents), turn t of all conversations submitted
together, ``--new-tokens`` greedy tokens per turn. Every structure that evicts is under pressure:
the device pool holds ``--pool-fraction`` of the working set (the final prompts plus new tokens),
a host tier ``--host-fraction`` of it, above an LMDB (``sync: false``) with room for all of it
(``--tiers host+lmdb``, the default; with ``--tiers host`` there is no LMDB, so what the host
tier drops is recomputed and the policy shows in the prompt tokens computed).
For each policy (``--policies``) the radix backend and both tiers evict by it; under ``priority``
the even-numbered conversations are sent with priority 1 ("paid"), the others with 0 (tiers see
no request priorities, so there it is LRU). Each policy runs on a fresh engine and empty tiers;
the same model object serves all of them.

Reports per policy: total wall time, mean / p50 / p90 TTFT (from a turn's submission to each
request's first token) over all requests and over the paid half, prompt tokens computed (prompt
tokens minus those hit on the device or reloaded from a tier), blocks reloaded per tier, and
whether every generated token equals the first policy's (the policy changes where KV comes from,
never what the model computes).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from corekv.config import CacheConfig, Config, EngineConfig, TierConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.models import load_model
from corekv.engine.sampling import SamplingParams
from seed_documents import add_seeds_argument, read_seeds  # benchmarks/ is sys.path[0]
from workloads.chats import seed_chats

BLOCK = 16
BLOCK_BYTES = 30 * 2 * 3 * BLOCK * 64 * 4  # SmolLM2-135M, float32


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_policy(model, policy: str, turns, num_blocks: int, working_set_bytes: int, args) -> dict:
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    num_conversations = len(turns[0])
    priorities = [1 if policy == "priority" and c % 2 == 0 else 0 for c in range(num_conversations)]
    workdir = tempfile.mkdtemp(prefix="corekv-eviction-")
    tiers = (TierConfig(type="host", name="host",
                        options={"size": int(working_set_bytes * args.host_fraction), "eviction": policy}),
             TierConfig(type="lmdb", name="lmdb",
                        options={"path": os.path.join(workdir, "lmdb"), "size": 2 * working_set_bytes + (64 << 20),
                                 "sync": False, "eviction": policy}))[:2 if args.tiers == "host+lmdb" else 1]
    config = Config(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                    engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=args.budget),
                    cache=CacheConfig(backend="radix", backend_options={"eviction": policy}, tiers=tiers))
    ttfts: list[float] = []
    paid_ttfts: list[float] = []
    outputs = []
    try:
        t0 = time.perf_counter()
        with Engine(config, model=model) as engine:
            for t, prompts in enumerate(turns):
                for c, out in enumerate(engine.generate(prompts, params, priority=priorities)):
                    outputs.append(out.token_ids)
                    ttfts.append(out.ttft_s)
                    if c % 2 == 0:
                        paid_ttfts.append(out.ttft_s)
                print(f"  {policy}: turn {t + 1} done at {time.perf_counter() - t0:.1f} s "
                      f"(load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            seconds = time.perf_counter() - t0
            stats = engine.stats()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"policy": policy, "seconds": seconds, "load": os.getloadavg(),
            "ttft_mean": statistics.mean(ttfts), "ttft_p50": quantile(ttfts, 0.5), "ttft_p90": quantile(ttfts, 0.9),
            "paid_ttft_mean": statistics.mean(paid_ttfts), "paid_ttft_p90": quantile(paid_ttfts, 0.9),
            "prompt_tokens": stats["prompt_tokens"], "prompt_tokens_computed": stats["prompt_tokens_computed"],
            "reloads": {k: v.get("reloads", 0) for k, v in stats["tiers"].items()}, "outputs": outputs}


def markdown(rows: list[dict]) -> str:
    lines = ["| policy | total s | mean TTFT s | p50 | p90 | paid half: mean TTFT s | p90 | prompt tokens "
             "computed | reloaded blocks | same tokens as the first |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        reloads = ", ".join(f"{k} {v}" for k, v in r["reloads"].items())
        same = r["outputs"] == rows[0]["outputs"]
        lines.append(f"| {r['policy']} | {r['seconds']:.1f} | {r['ttft_mean']:.2f} | {r['ttft_p50']:.2f} "
                     f"| {r['ttft_p90']:.2f} | {r['paid_ttft_mean']:.2f} | {r['paid_ttft_p90']:.2f} "
                     f"| {r['prompt_tokens_computed']} of {r['prompt_tokens']} | {reloads} | {same} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="lru,lfu,priority", help="comma-separated eviction policies")
    parser.add_argument("--scale", type=float, default=0.25, help="multiplies every length of the seed's workload")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="device pool / working set")
    parser.add_argument("--host-fraction", type=float, default=0.25, help="host tier / working set")
    parser.add_argument("--tiers", choices=("host+lmdb", "host"), default="host+lmdb",
                        help="the tiers below the device pool")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per turn")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--budget", type=int, default=512, help="engine.max_num_batched_tokens")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="write the rows here (after every policy)")
    add_seeds_argument(parser)
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not 0 < args.scale <= 1 or not 0 < args.pool_fraction <= 1 or not 0 < args.host_fraction <= 1:
        parser.error("--scale, --pool-fraction and --host-fraction must be in (0, 1]")
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load average at start {os.getloadavg()}", file=sys.stderr)
    model = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
    turns = seed_chats(model.tokenizer, args.scale, read_seeds(args.seeds))
    finals = [len(p) + args.new_tokens for p in turns[-1]]
    working_set_blocks = sum(-(-n // BLOCK) for n in finals)
    num_blocks = max(round(working_set_blocks * args.pool_fraction), -(-max(finals) // BLOCK) + 1)
    print(f"workload: {sum(len(p) for t in turns for p in t)} prompt tokens in {sum(map(len, turns))} "
          f"requests, working set {working_set_blocks} blocks, device pool {num_blocks} blocks, host tier "
          f"{int(working_set_blocks * args.host_fraction)} blocks", file=sys.stderr)
    # NOTE: a throwaway engine serves one request first, so the first policy does not pay the
    # process's first-call costs (kernel set-up, allocator growth) alone
    warm = Config(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                  engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=args.budget))
    with Engine(warm, model=model) as engine:
        engine.generate(turns[0][0], SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
    rows = []
    for policy in policies:
        rows.append(run_policy(model, policy, turns, num_blocks, working_set_blocks * BLOCK_BYTES, args))
        print(f"{policy}: {rows[-1]['seconds']:.1f} s, load {rows[-1]['load']}", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows],
                                                  indent=1))
    print(f"load average at end {os.getloadavg()}", file=sys.stderr)
    print(markdown(rows) if args.markdown else json.dumps([{k: v for k, v in r.items() if k != "outputs"}
                                                            for r in rows], indent=1))


if __name__ == "__main__":
    main()
