"""Speculative decoding: W3 (input-grounded generation) decode speed with ``engine.speculative``
(ngram; SmolLM2 drafting for itself) against without, same model, same token ids, greedy; and W1/W2
(benchmarks/engine_w1_w2.py's workloads) with speculation on against off. The prompts are built in
benchmarks/workloads/ (``w3.py``, ``w1_w2.py``).

    python benchmarks/speculative_w3.py --runs 3 --markdown            # W3, and W1/W2 on and off
    python benchmarks/speculative_w3.py --workloads W3 --systems off,ngram

* W3: four requests that copy much of their input: add type hints to a Python module and reply
  with all of it, re-spell a text in British English, fill a Markdown table from a list, and
  summarise a text; the chat template, greedy, up to ``--max-tokens`` (384) new tokens each (EOS
  ends a request). Each request runs alone (decode speed at batch 1, where a CPU step is bound by
  reading the weights once), then all four together.
* W1/W2: as in engine_w1_w2.py (W2 ignores EOS), ngram with the default (adaptive) settings.

Per system: decode tokens/s (output tokens after the first over the time after the first token,
summed over the requests run alone), the batch's wall time, the acceptance (tokens a verification
emits, the target's own included, and the fraction of drafts accepted) and whether every token
equals the run without speculation. Systems run in turn within each run (off, ngram, ...), so a
load that drifts touches all of them alike; the table gives medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from corekv.config import CacheConfig, Config, EngineConfig, SpeculativeConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.models import DEFAULT_MODEL, load_model
from corekv.engine.sampling import SamplingParams
from seed_documents import add_seeds_argument, read_seeds  # benchmarks/ is sys.path[0]
from waves import on_corekv
from workloads.w1_w2 import as_waves, max_new_tokens, w1_prompts, w2_prompts
from workloads.w3 import w3_prompts

SPECULATIVE = {
    "off": SpeculativeConfig(),
    "ngram": SpeculativeConfig(method="ngram"),  # the defaults: k=4, n-grams of 2..5, adaptive
    "ngram-k8": SpeculativeConfig(method="ngram", num_speculative_tokens=8),
    "draft": SpeculativeConfig(method="draft", model=DEFAULT_MODEL, num_speculative_tokens=4),
}


def run_w3(loaded, prompts, speculative: SpeculativeConfig, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    cfg = Config(engine=EngineConfig(num_blocks=sum(len(p) + max_tokens for p in prompts) // 16 + 64,
                                     speculative=speculative),
                 cache=CacheConfig(backend="radix"))
    with Engine(cfg, model=loaded) as engine:
        engine.generate([prompts[0][:32]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        alone, decode_s, decode_tokens = [], 0.0, 0
        for prompt in prompts:
            t0 = time.perf_counter()
            out = engine.generate([prompt], params)[0]
            elapsed = time.perf_counter() - t0
            alone.append(list(out.token_ids))
            decode_s += elapsed - out.ttft_s
            decode_tokens += len(out.token_ids) - 1
        alone_stats = dict(engine.stats()["speculative"])
        t0 = time.perf_counter()
        batch = [list(o.token_ids) for o in engine.generate(prompts, params)]
        batch_s = time.perf_counter() - t0
        stats = engine.stats()["speculative"]
    return dict(tokens=alone, batch_tokens=batch, decode_tok_s=decode_tokens / decode_s, decode_s=decode_s,
                batch_s=batch_s, out_tokens=sum(map(len, alone)), spec_alone=alone_stats, spec=stats)


def run_w1_w2(loaded, workload: str, speculative: SpeculativeConfig, seeds) -> dict:
    prompts = w1_prompts(loaded) if workload == "W1" else w2_prompts(loaded, seeds)
    max_new, ignore_eos = max_new_tokens(workload)
    waves = as_waves(workload, prompts)
    num_tokens = sum(len(p) + max_new for w in waves for p in w)
    cfg = Config(engine=EngineConfig(num_blocks=num_tokens // 16 + 64, speculative=speculative),
                 cache=CacheConfig(backend="radix"))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos)
    with Engine(cfg, model=loaded) as engine:
        run = on_corekv(engine, waves, params)
        stats = engine.stats()["speculative"]
    return dict(total=run["total"], tokens=run["tokens"], out_tokens=sum(map(len, run["tokens"])), spec=stats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="W3,W1,W2")
    parser.add_argument("--systems", default="off,ngram,ngram-k8,draft",
                        help=f"W3's systems, from {', '.join(SPECULATIVE)} (W1/W2 run off and ngram)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--dump-prompts", default=None, metavar="JSON",
                        help="write W3's prompts as token ids (for benchmarks/peers/vllm_speculative_w3.py) and exit")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(DEFAULT_MODEL, dtype=args.dtype, device="cpu")
    if args.dump_prompts:
        with open(args.dump_prompts, "w") as f:
            json.dump({"W3": w3_prompts(loaded), "max_tokens": args.max_tokens}, f)
        return
    workloads = args.workloads.split(",")
    systems = args.systems.split(",")
    results: dict = {}
    seeds = read_seeds(args.seeds) if {"W1", "W2"} & set(workloads) else None
    prompts = w3_prompts(loaded)
    for run in range(args.runs):
        for workload in workloads:
            for system in (systems if workload == "W3" else ["off", "ngram"]):
                if workload == "W3":
                    r = run_w3(loaded, prompts, SPECULATIVE[system], args.max_tokens)
                else:
                    r = run_w1_w2(loaded, workload, SPECULATIVE[system], seeds)
                results.setdefault((workload, system), []).append(r)
                print(f"run {run} {workload} {system}: " + (
                    f"{r['decode_tok_s']:.1f} decode tok/s alone, batch {r['batch_s']:.2f} s" if workload == "W3"
                    else f"{r['total']:.2f} s") + f", load {os.getloadavg()[0]:.2f}, {r['spec']}", file=sys.stderr,
                      flush=True)
    rows = []
    for (workload, system), runs in results.items():
        base = results[(workload, "off")][0]
        same = all(r["tokens"] == base["tokens"] and r.get("batch_tokens") == base.get("batch_tokens") for r in runs)
        spec = runs[0]["spec"]
        row = dict(workload=workload, system=system, runs=len(runs), same_tokens=same, out_tokens=runs[0]["out_tokens"],
                   acceptance_length=spec["mean_acceptance_length"], acceptance_rate=spec["acceptance_rate"],
                   num_proposed=spec["num_proposed_tokens"])
        if workload == "W3":
            row.update(decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs),
                       batch_s=statistics.median(r["batch_s"] for r in runs),
                       alone_acceptance_length=runs[0]["spec_alone"]["mean_acceptance_length"])
        else:
            row.update(total_s=statistics.median(r["total"] for r in runs),
                       total_min_s=min(r["total"] for r in runs), total_max_s=max(r["total"] for r in runs))
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.markdown:
        print("| Workload | System | Decode tok/s (alone) | Batch of 4 (s) | Acceptance length | Drafts accepted | Same tokens |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if r["workload"] == "W3":
                print(f"| W3 | {r['system']} | {r['decode_tok_s']:.1f} | {r['batch_s']:.2f} | "
                      f"{r['alone_acceptance_length']:.2f} | {r['acceptance_rate']:.0%} | {r['same_tokens']} |")
        print()
        print("| Workload | System | Total s (median, min-max) | Acceptance length | Drafts verified | Same tokens |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["workload"] != "W3":
                print(f"| {r['workload']} | {r['system']} | {r['total_s']:.2f} ({r['total_min_s']:.2f}-"
                      f"{r['total_max_s']:.2f}) | {r['acceptance_length']:.2f} | {r['num_proposed']} | {r['same_tokens']} |")
    else:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
