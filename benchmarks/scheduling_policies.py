"""The waiting-queue policies (``engine.scheduling``) on batches of prompts that share prefixes.

    python benchmarks/scheduling_policies.py --pool-fraction 0.25 --markdown

The engine's real :class:`Scheduler`, :class:`BlockManager` and backend over a real (tiny) KV
pool, with no model: a step is scheduled, advanced and post-processed as the engine does it, and
every sampled token is a fixed non-EOS id, so each request generates exactly its ``max_tokens``.
That makes a run deterministic and fast, and it measures the decisions alone: which prompt
tokens are reused, which are computed, how many steps the batch takes.

Workloads: the prefix-cache seed chapter's four (``corekv.bench.seed_workloads``: a shared
system prompt, multi-turn histories, few-shot prompts with 2-5 of the same examples, 30 problems
sampled 8 times), each submitted at once as one offline batch in a shuffled order
(``random.seed(0)``), as requests of many groups arrive mixed. Each request gets ``max_tokens``
from ``--short``/``--long``: ``--long-fraction`` of them the long length, the rest the short one.
The device pool holds ``--pool-fraction`` of the working set (the distinct full blocks of all
prompts), but never less than twice what the longest request needs.

Reported per workload and policy: prompt tokens computed (prompt tokens minus those reused from
the pool), *recomputed* (computed minus what the same batch computes in a pool that holds it all:
KV that had been computed and was evicted before its next use), the hit rate, all tokens computed
(preemptions' recompute included), preemptions, the steps the batch takes and the mean number of
sequences decoding per step.

``--cost`` instead times each policy's ordering of one waiting queue (what a step pays for it):
queues of 1K-token prompts in 16 groups sharing their first 512 tokens, half the groups cached.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from corekv.bench import WORKLOAD_NAMES, make_backend, seed_workloads
from corekv.hashing import PrefixKey, chain_seed
from corekv.engine.block_manager import BlockManager, blocks_for
from corekv.engine.kv_pool import KVPool
from corekv.engine.sampling import SamplingParams
from corekv.engine.scheduler import SCHEDULING_POLICIES, Scheduler
from corekv.engine.sequence import Sequence

TOKEN = 7  # every sampled token: not EOS, so each request runs to its max_tokens


def make_batch(prompts, *, short: int, long: int, long_fraction: float, seed: int = 0):
    """(prompt, max_tokens) pairs in a shuffled arrival order, the same for every policy."""
    rng = random.Random(seed)
    batch = [(list(p), long if rng.random() < long_fraction else short) for p in prompts]
    rng.shuffle(batch)
    return batch


def run(batch, policy: str, *, num_blocks: int, block_size: int, backend: str, max_num_seqs: int,
        budget: int) -> dict:
    cache = make_backend(backend, num_blocks, block_size)
    pool = KVPool(1, num_blocks, block_size, 1, 1, torch.float32, "cpu")
    scheduler = Scheduler(BlockManager(cache, pool), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, scheduling=policy, eos_token_ids=[0])
    namespace = chain_seed("scheduling-bench", block_size)
    for i, (prompt, max_tokens) in enumerate(batch):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        scheduler.add(Sequence(f"r{i}", prompt, params, PrefixKey(prompt, block_size, namespace)))
    num_steps = num_decodes = 0
    start = time.perf_counter()
    while scheduler.has_unfinished:
        items = scheduler.schedule()
        num_steps += 1
        num_decodes += sum(1 for item in items if item.num_tokens == 1)
        seqs, _ = scheduler.advance(items)
        scheduler.postprocess(seqs, [TOKEN] * len(seqs))
    return {
        "policy": policy,
        "prompt_tokens": scheduler.num_prompt_tokens,
        "prompt_tokens_computed": scheduler.num_prompt_tokens - scheduler.num_cached_prompt_tokens,
        "hit_rate": scheduler.num_cached_prompt_tokens / scheduler.num_prompt_tokens,
        "tokens_computed": scheduler.num_computed_tokens,
        "steps": num_steps,
        "mean_decoding": num_decodes / num_steps,
        "preemptions": scheduler.num_preemptions,
        "seconds": time.perf_counter() - start,
    }


def ordering_cost(backend: str, queue_lengths=(128, 512, 1024, 4096), repeats: int = 10) -> list[dict]:
    """The fastest of ``repeats`` orderings per policy and queue length (the box is shared)."""
    from corekv.engine.scheduling import ORDER_BY_POLICY
    rng = random.Random(0)
    groups = [[rng.randrange(1000, 50000) for _ in range(512)] for _ in range(16)]
    namespace = chain_seed("scheduling-bench", 16)
    cache = make_backend(backend, 8192, 16)
    blocks = BlockManager(cache, KVPool(1, 8192, 16, 1, 1, torch.float32, "cpu"))
    for group in groups[:8]:
        table = cache.allocate(32)
        cache.cache(PrefixKey(group, 16, namespace), table)
        cache.free(table)
    seqs = []
    for i in range(max(queue_lengths)):
        prompt = groups[i % 16] + [rng.randrange(1000, 50000) for _ in range(512)]
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 256)),
                       PrefixKey(prompt, 16, namespace))
        seq.key.block_hashes  # NOTE: hashed at arrival in the engine (prefetch, in-flight checks)
        seqs.append(seq)
    rows = []
    for n in queue_lengths:
        for policy, order in ORDER_BY_POLICY.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                order(seqs[:n], lambda s: len(blocks.match(s)))
                times.append(time.perf_counter() - start)
            rows.append({"backend": backend, "waiting": n, "policy": policy, "ms": min(times) * 1e3})
    return rows


def working_set_blocks(prompts, block_size: int) -> int:
    namespace = chain_seed("scheduling-bench", block_size)
    return len({h for p in prompts for h in PrefixKey(p, block_size, namespace).block_hashes})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES))
    parser.add_argument("--policies", default=",".join(SCHEDULING_POLICIES))
    parser.add_argument("--backend", default="radix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--short", type=int, default=16, help="max_tokens of most requests")
    parser.add_argument("--long", type=int, default=256, help="max_tokens of the long ones")
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--num-requests", type=int, help="the first N of each shuffled batch (default: all)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--cost", action="store_true", help="time the ordering of one queue instead")
    args = parser.parse_args(argv)
    if args.cost:
        rows = ordering_cost(args.backend)
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        print("| waiting | " + " | ".join(policies) + " |")
        print("|---" * (len(policies) + 1) + "|")
        for n in dict.fromkeys(r["waiting"] for r in rows):
            print(f"| {n} | " + " | ".join(f"{r['ms']:.2f} ms" for r in rows if r["waiting"] == n) + " |")
        return 0
    workloads = seed_workloads()
    policies = args.policies.split(",")
    results = []
    for name in args.workloads.split(","):
        prompts = workloads[name]
        batch = make_batch(prompts, short=args.short, long=args.long,
                           long_fraction=args.long_fraction)[:args.num_requests]
        prompts = [p for p, _ in batch]
        bs = args.block_size
        longest = max(blocks_for(len(p) + n, bs) for p, n in batch)
        num_blocks = max(int(args.pool_fraction * working_set_blocks(prompts, bs)),
                         2 * longest)
        common = dict(block_size=bs, backend=args.backend, max_num_seqs=args.max_num_seqs,
                      budget=args.budget)
        everything = sum(blocks_for(len(p) + n, bs) for p, n in batch)
        bound = run(batch, "fcfs", num_blocks=everything, **common)["prompt_tokens_computed"]
        for policy in policies:
            row = run(batch, policy, num_blocks=num_blocks, **common)
            row.update(workload=name, num_requests=len(batch), num_blocks=num_blocks,
                       prompt_tokens_recomputed=row["prompt_tokens_computed"] - bound)
            results.append(row)
            print(f"{name:>13} {policy:>10}: {num_blocks} blocks, computed {row['prompt_tokens_computed']}, "
                  f"recomputed {row['prompt_tokens_recomputed']}, hit {row['hit_rate']:.1%}, "
                  f"{row['steps']} steps, {row['mean_decoding']:.2f} decoding/step, "
                  f"{row['preemptions']} preemptions, {row['tokens_computed']} tokens computed "
                  f"({row['seconds']:.1f} s)", file=sys.stderr)
    if args.markdown:
        print("| workload | requests | pool blocks | policy | prompt tokens computed | recomputed "
              "| hit rate | all tokens computed | preemptions | steps | decoding per step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['workload']} | {r['num_requests']} | {r['num_blocks']} | {r['policy']} "
                  f"| {r['prompt_tokens_computed']:,} | {r['prompt_tokens_recomputed']:,} | {r['hit_rate']:.1%} "
                  f"| {r['tokens_computed']:,} | {r['preemptions']} | {r['steps']:,} | {r['mean_decoding']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
