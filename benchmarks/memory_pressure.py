"""Multi-turn conversations under memory pressure, with no tiers, a host tier, host + LMDB.

    python benchmarks/memory_pressure.py --scale 0.25 --repeats 3 --threads 1 --markdown

The seed's multi-turn workload (prefix-cache-hash-blocks-and-radix-tree.md): 20 conversations x 8
turns; each conversation starts from a 300-token history, each turn appends a user message
(10-60 tokens) and sends the history as the prompt, then appends a fixed "answer" (50-300 tokens,
not the generated text, as in the seed). ``--scale`` multiplies every length (the seed's lengths
make ~170K prompt tokens, hours of recompute on a small CPU box). Token ids are real text: slices
of the seed documents (``--seeds``) tokenized by SmolLM2's tokenizer, at random offsets
(``random.seed(0)``; ``workloads/chats.py``).
Each prompt generates ``--new-tokens`` tokens greedily (EOS ignored).

Turns are interleaved, as concurrent chat sessions are: turn 1 of all 20 conversations is
submitted together (one ``engine.generate`` call), then turn 2, and so on. The device pool holds
``--pool-fraction`` (default a quarter) of the working set, the sum of every conversation's final
prompt + new tokens. Configurations: ``none`` (device pool only), ``host`` (a host tier holding
the whole working set), ``host+lmdb`` (a host tier holding half of it above an LMDB with room for
all of it). The same model object serves every engine; each configuration starts from a fresh
engine and empty tiers.

Repeats are interleaved (none, host, host+lmdb, none, ...), so each repeat compares the
configurations under about the same load of this shared box; "time vs none" is the median of the
per-repeat ratios. Reports per configuration (medians of ``--repeats`` runs, each on a fresh
engine): total wall time, prompt tokens computed (prompt tokens minus those reused from the device or reloaded from a
tier), prompt tokens *recomputed* (computed minus what an unbounded cache would still compute, see
:func:`reuse_bound`: tokens whose KV had been computed before, in full blocks, and was lost), all
tokens computed (preemption recompute included), preemptions, per-tier reloaded blocks and skipped
offloads, and whether every generated token equals the ``none`` run's.

NOTE: "fewer prompt tokens computed than none" stays well below 100% at any scale of this workload:
the new tokens of each turn (the answer and the user message, about a fifth of all prompt tokens at
full length) must be computed by any cache. "Recomputed" excludes them, so it is the figure that
shows what the tiers save.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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
CONFIGS = ("none", "host", "host+lmdb")


def reuse_bound(turns) -> int:
    """Prompt tokens an unbounded device cache would still compute: a prompt can reuse at most the
    full blocks of its conversation's previous prompt (conversations share nothing), and never
    its own last token."""
    computed = 0
    for c in range(len(turns[0])):
        previous = 0
        for prompts in turns:
            n = len(prompts[c])
            computed += n - min(previous // BLOCK, (n - 1) // BLOCK) * BLOCK
            previous = n
    return computed


def tier_configs(name: str, workdir: str, working_set_bytes: int) -> tuple[TierConfig, ...]:
    if name == "none":
        return ()
    if name == "host":
        return (TierConfig(type="host", name="host", options={"size": working_set_bytes + (8 << 20)}),)
    return (TierConfig(type="host", name="host", options={"size": working_set_bytes // 2}),
            TierConfig(type="lmdb", name="lmdb", options={"path": os.path.join(workdir, "lmdb"),
                                                          "size": 2 * working_set_bytes + (64 << 20),
                                                          "sync": False}))


def run_once(model, name: str, turns, num_blocks: int, working_set_bytes: int, args) -> dict:
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    workdir = tempfile.mkdtemp(prefix="corekv-pressure-")
    try:
        config = Config(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                        engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK,
                                            max_num_batched_tokens=args.budget),
                        cache=CacheConfig(backend="radix", offload_queue_blocks=args.queue_blocks,
                                          tiers=tier_configs(name, workdir, working_set_bytes)))
        outputs = []
        t0 = time.perf_counter()
        with Engine(config, model=model) as engine:
            for t, prompts in enumerate(turns):
                outputs += [o.token_ids for o in engine.generate(prompts, params)]
                print(f"  {name}: turn {t + 1} done at {time.perf_counter() - t0:.1f} s "
                      f"(load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            seconds = time.perf_counter() - t0
            stats = engine.stats()
            prefetch = engine.offload.prefetch_stats() if engine.offload is not None else {}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"config": name, "seconds": seconds, "prompt_tokens": stats["prompt_tokens"],
            "prompt_tokens_computed": stats["prompt_tokens_computed"],
            "tokens_computed": stats["tokens_computed"], "preemptions": stats["num_preemptions"],
            "tiers": {k: {f: v.get(f, 0) for f in ("reloads", "offloads", "skips", "faults")}
                      for k, v in stats["tiers"].items()},
            "prefetch": prefetch,
            "outputs": outputs}


def median_row(runs: list[dict], base_runs: list[dict]) -> dict:
    """The run of median time among ``runs``, with every run's seconds and the median per-repeat
    speedup over ``base_runs`` (the ``none`` runs of the same repeats)."""
    ratios = sorted(b["seconds"] / r["seconds"] for r, b in zip(runs, base_runs))
    row = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    row["all_seconds"] = [r["seconds"] for r in runs]
    row["speedups"] = [b["seconds"] / r["seconds"] for r, b in zip(runs, base_runs)]
    row["speedup"] = ratios[len(ratios) // 2]
    row["outputs_agree"] = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    return row


def markdown(rows: list[dict], bound: int) -> str:
    base = rows[0]
    lines = [f"Unbounded-cache bound: {bound} prompt tokens computed.", "",
             "| config | total s (runs) | time vs none | prompt tokens | prompt tokens computed | fewer than none "
             "| prompt tokens recomputed | fewer than none | tokens computed | preemptions | reloaded blocks "
             "| skipped offloads | same tokens as none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    base_recomputed = base["prompt_tokens_computed"] - bound
    for r in rows:
        reloads = ", ".join(f"{k} {v['reloads']}" for k, v in r["tiers"].items()) or "-"
        skips = ", ".join(f"{k} {v['skips']}" for k, v in r["tiers"].items()) or "-"
        fewer = 1 - r["prompt_tokens_computed"] / base["prompt_tokens_computed"]
        recomputed = r["prompt_tokens_computed"] - bound
        fewer_re = 1 - recomputed / base_recomputed if base_recomputed else 0.0
        runs = "/".join(f"{s:.0f}" for s in r["all_seconds"])
        same = r["outputs"] == base["outputs"] and r["outputs_agree"]
        lines.append(f"| {r['config']} | {r['seconds']:.1f} ({runs}) | {r['speedup']:.2f}x faster "
                     f"| {r['prompt_tokens']} | {r['prompt_tokens_computed']} | {fewer:.0%} | {recomputed} "
                     f"| {fewer_re:.0%} | {r['tokens_computed']} | {r['preemptions']} | {reloads} | {skips} | {same} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=0.0625, help="multiplies every length of the seed's workload")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="device pool / working set")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per turn")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--budget", type=int, default=512, help="engine.max_num_batched_tokens")
    parser.add_argument("--queue-blocks", type=int, default=256, help="cache.offload_queue_blocks")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {CONFIGS}, 'none' first")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (interleaved; medians)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="write the rows here")
    add_seeds_argument(parser)
    args = parser.parse_args()
    configs = args.configs.split(",")
    if configs[0] != "none" or not set(configs) <= set(CONFIGS):
        parser.error(f"--configs: got {configs}; expected a subset of {CONFIGS} starting with 'none'")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 < args.scale <= 1 or not 0 < args.pool_fraction <= 1:
        parser.error(f"--scale and --pool-fraction must be in (0, 1], got {args.scale}, {args.pool_fraction}")
    seed_text = read_seeds(args.seeds)
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load average at start {os.getloadavg()}", file=sys.stderr)
    model = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
    turns = seed_chats(model.tokenizer, args.scale, seed_text)
    finals = [len(p) + args.new_tokens for p in turns[-1]]
    working_set_blocks = sum(-(-n // BLOCK) for n in finals)
    num_blocks = max(round(working_set_blocks * args.pool_fraction), -(-max(finals) // BLOCK) + 1)
    block_bytes = 30 * 2 * 3 * BLOCK * 64 * 4  # SmolLM2-135M, float32
    print(f"workload: {sum(len(p) for t in turns for p in t)} prompt tokens, working set "
          f"{working_set_blocks} blocks, device pool {num_blocks} blocks; an unbounded cache would still "
          f"compute {reuse_bound(turns)} prompt tokens", file=sys.stderr)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for rep in range(args.repeats):
        for name in configs:
            run = run_once(model, name, turns, num_blocks, working_set_blocks * block_bytes, args)
            run.update(scale=args.scale, repeat=rep, load=os.getloadavg())
            runs[name].append(run)
            print(f"repeat {rep + 1}: {name} {run['seconds']:.1f} s, load {run['load']}", file=sys.stderr, flush=True)
            if args.json:  # after every run, so an interrupted benchmark keeps what it measured
                Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"}
                                                       for rs in runs.values() for r in rs], indent=1))
    rows = [median_row(runs[name], runs["none"]) for name in configs]
    print(f"load average at end {os.getloadavg()}; working set {working_set_blocks} blocks, "
          f"pool {num_blocks} blocks", file=sys.stderr)
    summary = json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows], indent=1)
    if args.json:
        Path(args.json).with_suffix(".summary.json").write_text(summary)
    print(markdown(rows, reuse_bound(turns)) if args.markdown else summary)


if __name__ == "__main__":
    main()
