"""The engine benchmarks: corekv's Engine vs transformers' continuous batching and sequential
``model.generate``, on the same model, the same token ids, greedy, in one process.

    python benchmarks/engine_w1_w2.py --dtypes float32,bfloat16 --runs 3 --cb-w2-runs 1 --markdown

* W1: six questions after one long system prompt (chat template), 32 new tokens; the first request
  alone, then the other five together (wave 2). Each run starts from a fresh engine / manager.
* W2: 32 prompts of exactly 512 token ids sharing an exact 384-token prefix (real text tokenized:
  the seed documents, ``--seeds``), 128 distinct tokens each, 16 new tokens with EOS ignored.
  Both are built in benchmarks/workloads/w1_w2.py.

Per system and workload: total wall time, output tokens/s, mean TTFT (from the moment a wave is
submitted, every request of a wave arriving then, to that request's first token), the peak RSS
sampled while that system ran, and whether its tokens equal sequential ``model.generate``'s.
``--profile`` instead profiles corekv's decode steps (see benchmarks/engine_profile.py).

corekv runs with its default configuration (native CPU kernels where they build), compiled
(``engine.compile``), and on the torch path (``engine.cpu_kernels: torch``). The CPU, torch's
capability and the native kernels' instruction set are logged first; ``--isa avx2`` measures as on
an AVX2 machine (a restart with torch, inductor, MKL, oneDNN and the native kernels restricted).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.models import load_model, reference_attention
from corekv.engine.sampling import SamplingParams
from engine_profile import profile_decode
from seed_documents import add_seeds_argument, read_seeds  # benchmarks/ is sys.path[0]
from waves import on_corekv
from workloads.w1_w2 import QUESTIONS, W2_PROMPTS, as_waves, max_new_tokens, w1_prompts, w2_prompts


class RssSampler:
    """Samples this process's RSS every 20 ms between ``start()`` and ``stop()``; ``stop`` returns
    the peak seen (bytes). Invariant: at most one sampling thread runs at a time."""

    def __init__(self):
        self._proc = psutil.Process()
        self._thread = None

    def start(self):
        self._peak = self._proc.memory_info().rss
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while self._running:
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(0.02)

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        return max(self._peak, self._proc.memory_info().rss)


# -- systems -----------------------------------------------------------------------------------
#: engine.tune_cpu_malloc for every corekv engine here (--no-malloc-tuning turns it off, e.g. to
#: compare glibc settings given through GLIBC_TUNABLES; mallopt's settings last for the process)
TUNE_CPU_MALLOC = True


def run_corekv(loaded, wave_list, max_new, ignore_eos, prefix_caching, compile=False, cpu_kernels="auto"):
    num_tokens = sum(len(p) + max_new for w in wave_list for p in w)
    cfg = Config(engine=EngineConfig(num_blocks=num_tokens // 16 + 64, enable_prefix_caching=prefix_caching,
                                     compile=compile, cpu_kernels=cpu_kernels, tune_cpu_malloc=TUNE_CPU_MALLOC),
                 cache=CacheConfig(backend="radix"))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos)
    with Engine(cfg, model=loaded) as engine:
        return on_corekv(engine, wave_list, params)


class _FirstToken:
    """A generate() streamer that records when the first new token arrives (the first put() is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def run_hf_generate(loaded, wave_list, max_new, ignore_eos):
    eos = sorted(loaded.eos_token_ids)
    tokens, ttfts, wave_times = [], [], []
    with reference_attention(loaded) as model, torch.no_grad():
        t0 = time.perf_counter()
        for wave in wave_list:
            w0 = time.perf_counter()
            for ids in wave:
                x = torch.tensor([ids])
                streamer = _FirstToken()
                kw = dict(min_new_tokens=max_new) if ignore_eos else {}
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos[0], streamer=streamer, **kw)
                tokens.append(out[0, len(ids):].tolist())
                ttfts.append(streamer.first - w0)
            wave_times.append(time.perf_counter() - w0)
        total = time.perf_counter() - t0
    return dict(total=total, waves=wave_times, ttfts=ttfts, tokens=tokens)


def run_hf_cb(loaded, wave_list, max_new, ignore_eos, size_pool=True):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = sorted(loaded.eos_token_ids)
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1 if ignore_eos else eos,
                           pad_token_id=eos[0])
    tokens, ttfts, wave_times = [], [], []
    with reference_attention(loaded) as model:
        t0 = time.perf_counter()
        for wave in wave_list:
            w0 = time.perf_counter()
            # NOTE: a fresh manager per wave (generate_batch's default); its block sharing (prefix
            # caching) is on by default, so it only shares within a wave.
            # NOTE: on CPU its default pool is sized from free host memory (GBs, allocated per
            # manager); size_pool gives it corekv's pool instead: the wave's tokens in 256-token pages.
            cb_cfg = ContinuousBatchingConfig(
                num_blocks=sum(-(-(len(p) + max_new) // 256) for p in wave) + 4) if size_pool else ContinuousBatchingConfig()
            res = model.generate_batch(wave, generation_config=gen, continuous_batching_config=cb_cfg,
                                       record_timestamps=True, progress_bar=False)
            wave_times.append(time.perf_counter() - w0)
            for out in res.values():
                tokens.append(list(out.generated_tokens))
                ttfts.append(out.timestamps[0] - w0 if out.timestamps else float("nan"))
        total = time.perf_counter() - t0
    return dict(total=total, waves=wave_times, ttfts=ttfts, tokens=tokens)


# -- the run -----------------------------------------------------------------------------------
def summarise(results, reference_tokens):
    med = lambda xs: statistics.median(xs)  # noqa: E731
    totals = [r["total"] for r in results]
    out_tokens = sum(len(t) for t in results[0]["tokens"])
    row = dict(runs=len(results), total_s=med(totals), total_min_s=min(totals), total_max_s=max(totals),
               out_tok_s=out_tokens / med(totals), out_tokens=out_tokens,
               mean_ttft_s=med([statistics.fmean(r["ttfts"]) for r in results]),
               waves_s=[med([r["waves"][i] for r in results]) for i in range(len(results[0]["waves"]))])
    if "prompt_tokens_computed" in results[0]:
        row["prompt_tokens_computed"] = results[0]["prompt_tokens_computed"]
    toks = results[0]["tokens"]
    row["mismatches"] = sum(a != b for a, b in zip(toks, reference_tokens)) if reference_tokens else None
    row["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                               for a, b in zip(toks, reference_tokens) if a != b] if reference_tokens else None
    row["deterministic"] = all(r["tokens"] == toks for r in results)
    return row


def bench_dtype(dtype, args, log):
    loaded = load_model("smollm2-135m-instruct", dtype=dtype, device="cpu")
    prompts = {"W1": w1_prompts(loaded), "W2": w2_prompts(loaded, args.seed_text)}
    spec = {wl: max_new_tokens(wl) for wl in ("W1", "W2")}
    rows = {}
    # warm-up (untimed): one short request through each system, so first-call costs are not timed.
    warm = [prompts["W1"][0][:64]]
    run_corekv(loaded, [warm], 2, False, True)
    if not args.systems or "compiled" in args.systems:
        # NOTE: the compiled engine compiles its step shapes when built (ModelRunner.warm_up);
        # the first build per dtype pays for it (a minute or two), untimed.
        t0 = time.perf_counter()
        run_corekv(loaded, [warm], 2, False, True, compile=True)
        log(f"{dtype} compiled warm-up (compile) {time.perf_counter() - t0:.1f} s")
    run_hf_generate(loaded, [warm], 2, False)
    run_hf_cb(loaded, [warm], 2, False)
    sampler = RssSampler()
    for wl in args.workloads:
        max_new, ignore_eos = spec[wl]
        wl_waves = as_waves(wl, prompts[wl])
        gen_runs = args.generate_w2_runs if wl == "W2" and args.generate_w2_runs else args.runs
        systems = [("hf generate (sequential, sdpa)", lambda: run_hf_generate(loaded, wl_waves, max_new, ignore_eos), gen_runs),
                   ("corekv (prefix caching on)", lambda: run_corekv(loaded, wl_waves, max_new, ignore_eos, True), args.runs)]
        systems.append(("corekv (prefix caching on, compiled)",
                        lambda: run_corekv(loaded, wl_waves, max_new, ignore_eos, True, compile=True), args.runs))
        systems.append(("corekv (prefix caching on, torch kernels)",
                        lambda: run_corekv(loaded, wl_waves, max_new, ignore_eos, True, cpu_kernels="torch"), args.runs))
        if wl == "W2" or args.w1_nocache:
            systems.append(("corekv (prefix caching off)", lambda: run_corekv(loaded, wl_waves, max_new, ignore_eos, False),
                            args.nocache_w2_runs if wl == "W2" and args.nocache_w2_runs else args.runs))
        cb_runs = args.cb_w2_runs if wl == "W2" else args.runs
        if cb_runs:
            systems.append(("hf continuous batching (generate_batch, sdpa)",
                            lambda: run_hf_cb(loaded, wl_waves, max_new, ignore_eos, not args.cb_default_pool), cb_runs))
        reference = None
        for name, fn, n in systems:
            if args.systems and not any(name == k[1:] if k.startswith("=") else k in name
                                        for k in args.systems.split(",")):
                continue
            sampler.start()
            results = []
            for i in range(n):
                results.append(fn())
                log(f"{dtype} {wl} {name} run {i}: {results[-1]['total']:.2f} s (waves "
                    f"{', '.join(f'{w:.2f}' for w in results[-1]['waves'])}), load {os.getloadavg()[0]:.2f}")
            peak = sampler.stop()
            if reference is None:
                reference = results[0]["tokens"]
            row = summarise(results, reference)
            row["peak_rss_mib"] = peak / 2**20
            rows[(wl, name)] = row
            if args.on_row:
                args.on_row(dtype, wl, name, row)
    return rows


def render_markdown(data) -> str:
    """The result tables (one per dtype and workload) and corekv's speed-ups, as markdown."""
    rows, lines = data["rows"], []
    groups = {}
    for key, row in rows.items():
        dtype, wl, name = key.split("|")
        groups.setdefault((dtype, wl), []).append((name, row))
    for (dtype, wl), items in groups.items():
        wave = " | wave 2 s" if wl == "W1" else ""
        lines += [f"**{wl}, {dtype}**", "", f"| system | runs | total s (median, min-max){wave} | output tok/s | "
                  "mean TTFT s | peak RSS MiB | prompt tokens computed | tokens = generate's |",
                  "|---|---:|---:|" + ("---:|" if wave else "") + "---:|---:|---:|---:|---|"]
        for name, r in items:
            w2 = f" | {r['waves_s'][1]:.2f}" if wave else ""
            computed = r.get("prompt_tokens_computed")
            computed = " + ".join(map(str, computed)) if isinstance(computed, list) else "-"
            agree = ("reference" if name.startswith("hf generate") else
                     "yes" if r["mismatches"] == 0 else
                     f"{r['mismatches']} of {len(QUESTIONS) if wl == 'W1' else W2_PROMPTS} requests differ "
                     f"(first differing output token: {', '.join(map(str, r['first_divergence']))})")
            lines.append(f"| {name} | {r['runs']} | {r['total_s']:.2f} ({r['total_min_s']:.2f}-{r['total_max_s']:.2f}){w2} | "
                         f"{r['out_tok_s']:.1f} | {r['mean_ttft_s']:.3f} | {r['peak_rss_mib']:.0f} | {computed} | {agree} |")
        core = dict(items).get("corekv (prefix caching on)")
        if core:
            ratios = []
            for name, r in items:
                if name.startswith("corekv (prefix caching on)"):
                    continue
                text = f"{r['total_s'] / core['total_s']:.1f}x vs {name}"
                if wave:
                    text += f" (wave 2: {r['waves_s'][1] / core['waves_s'][1]:.1f}x)"
                ratios.append(text)
            lines += ["", "corekv (prefix caching on) total-time speed-up: " + "; ".join(ratios) + "."]
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cb-w2-runs", type=int, default=1, help="runs of transformers CB on W2 (slow)")
    ap.add_argument("--generate-w2-runs", type=int, default=0, help="runs of sequential generate on W2 (default --runs)")
    ap.add_argument("--nocache-w2-runs", type=int, default=0, help="runs of corekv without caching on W2 (default --runs)")
    ap.add_argument("--w1-nocache", action="store_true", help="also run corekv on W1 without prefix caching")
    ap.add_argument("--systems", default="", help="comma-separated substrings of system names to run, or =name for exactly that one (default all)")
    ap.add_argument("--cb-default-pool", action="store_true", help="transformers CB with its default (memory-sized) pool")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--isa", choices=("avx2",), default=None,
                    help="run as on a CPU of this instruction set: restarts with torch, inductor, MKL, oneDNN and "
                         "corekv's native kernels restricted to it (corekv.engine.cpu.isa.RESTRICT_ENV)")
    ap.add_argument("--no-malloc-tuning", action="store_true",
                    help="engine.tune_cpu_malloc off (glibc's malloc as the environment sets it)")
    ap.add_argument("--render", default=None, help="print the markdown tables of a --json file and exit")
    ap.add_argument("--dump-prompts", default=None, metavar="FILE",
                    help="write the W1 and W2 prompts' token ids as JSON ({'W1': [...], 'W2': [...]}) and exit "
                         "(benchmarks/peers/vllm_w1_w2.py runs vLLM on them)")
    add_seeds_argument(ap)
    args = ap.parse_args()
    if args.isa:
        from corekv.engine.cpu.isa import RESTRICT_ENV

        restrict = RESTRICT_ENV[args.isa]
        if any(os.environ.get(k) != v for k, v in restrict.items()):  # the libraries read them at start
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **restrict})
    args.workloads = args.workloads.split(",")
    if args.render:
        print(render_markdown(json.loads(Path(args.render).read_text())))
        return
    args.seed_text = read_seeds(args.seeds)  # NOTE: before any model loads, so a missing folder fails at once
    if args.dump_prompts:
        # NOTE: built by the same functions the timed runs use, so a peer system gets the exact token ids.
        loaded = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
        Path(args.dump_prompts).write_text(json.dumps({"W1": w1_prompts(loaded), "W2": w2_prompts(loaded, args.seed_text)}))
        return
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    global TUNE_CPU_MALLOC
    TUNE_CPU_MALLOC = not args.no_malloc_tuning
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    import corekv.engine
    # NOTE: under benchmarks/snapshot_head.sh the code measured is the snapshot's commit, not the tree's.
    snapshot = Path(corekv.engine.__file__).parents[3] / "COMMIT"
    commit = snapshot.read_text().strip() if snapshot.exists() else subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    env = dict(commit=commit, engine_path=corekv.engine.__file__, torch=torch.__version__, threads=torch.get_num_threads(),
               python=sys.version.split()[0], load_start=os.getloadavg())
    import transformers
    env["transformers"] = transformers.__version__
    from corekv.engine.cpu.isa import RESTRICT_ENV, cpu_info
    from corekv.engine.cpu.native import NativeBuildError, load_native_attention

    env["cpu"] = cpu_info().describe()
    env["restrictions"] = {k: os.environ[k] for r in RESTRICT_ENV.values() for k in r if k in os.environ}
    try:
        env["native_isa"] = load_native_attention().isa
    except NativeBuildError as exc:
        env["native_isa"] = f"none ({exc})"
    log(json.dumps(env))
    if args.profile:
        reports = {dtype: profile_decode(dtype, log, args.seed_text) for dtype in args.dtypes.split(",")}
        print(json.dumps(dict(env=env, profile=reports), indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=env, profile=reports), indent=1))
        return
    all_rows = {}

    def on_row(dtype, wl, name, row):  # NOTE: saved as they come, so a cut-short run keeps its rows
        all_rows[f"{dtype}|{wl}|{name}"] = row
        env["load_now"] = os.getloadavg()
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=env, rows=all_rows), indent=1))

    args.on_row = on_row
    for dtype in args.dtypes.split(","):
        bench_dtype(dtype, args, log)
    env["load_end"] = os.getloadavg()
    env["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(dict(env=env, rows=all_rows), indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(env=env, rows=all_rows), indent=1))


if __name__ == "__main__":
    main()
