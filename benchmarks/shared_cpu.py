"""One corekv worker's generate on a CPU it shares: alone, and beside busy-looping processes (a
second worker, a router, a test run), under several thread settings.

Each setting runs in a fresh process (thread settings take effect when OpenMP starts): it starts
the default engine on the CPU (SmolLM2, device-only cache), then times ``--repeats`` requests of a
chat prompt generating ``--max-tokens`` tokens (each under its own cache_salt, so none hits the
prefix cache) and prints the median time and TTFT. ``--hogs N`` runs N ``while True: pass``
processes beside it.

    python benchmarks/shared_cpu.py --hogs 0 2 --settings default omp1 passive engine
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: setting name -> (environment variables, engine config fields)
SETTINGS = {
    # what a user got before issue 38: libgomp's own default, a thread per CPU spinning 300000 times
    # before it sleeps (GOMP_SPINCOUNT set, so `import corekv` leaves the wait alone)
    "default": ({"GOMP_SPINCOUNT": "300000"}, {"threads": None}),
    "omp1": ({"GOMP_SPINCOUNT": "300000", "OMP_NUM_THREADS": "1"}, {"threads": None}),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, {"threads": None}),
    # a shorter spin before sleeping
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, {"threads": None}),
    # corekv's defaults since issue 38 (nothing set by the user)
    "engine": ({}, {}),
}

_CHILD = """
import json, os, sys, time
t0 = time.perf_counter()
import corekv
fields = json.loads(sys.argv[1])
engine_cfg = {k: v for k, v in fields.items() if v is not None}
engine = corekv.Engine.from_config({"device": "cpu", "engine": engine_cfg})
start_s = time.perf_counter() - t0
import torch
params = corekv.SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0)
prompt = [{"role": "user", "content": "What is a KV cache? Explain it to a new engineer."}]
times, ttfts = [], []
for i in range(int(sys.argv[2])):
    t = time.perf_counter()
    out = engine.generate([prompt], params, cache_salt=f"run-{i}-{os.getpid()}")[0]
    times.append(time.perf_counter() - t)
    ttfts.append(out.ttft_s)
print("RESULT", json.dumps({"start_s": start_s, "times": times, "ttfts": ttfts,
                            "tokens": len(out.token_ids), "threads": torch.get_num_threads()}))
engine.close()
"""


def run_setting(name: str, hogs: int, repeats: int, max_tokens: int) -> dict:
    env_vars, fields = SETTINGS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_vars, TQDM_DISABLE="1")
    hog_procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(fields), str(repeats), str(max_tokens)],
                             env=env, capture_output=True, text=True, timeout=3600)
    finally:
        for proc in hog_procs:
            proc.kill()
            proc.wait()
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{name}: no result\n{out.stdout}\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result.update(setting=name, hogs=hogs, load=load)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--hogs", nargs="+", type=int, default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=31)
    args = parser.parse_args()
    print("| setting | busy loops beside it | threads | start s | generate s (median) | TTFT s (median) | "
          "load at start |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for hogs in args.hogs:
        for name in args.settings:
            r = run_setting(name, hogs, args.repeats, args.max_tokens)
            print(f"| {name} | {hogs} | {r['threads']} | {r['start_s']:.1f} | {statistics.median(r['times']):.2f} | "
                  f"{statistics.median(r['ttfts']):.3f} | {r['load']:.1f} |", flush=True)
            print(json.dumps(r), file=sys.stderr, flush=True)
            time.sleep(1)


if __name__ == "__main__":
    main()
