"""TTFT of a prompt whose prefix is recomputed, hit on the device, or reloaded from each tier, with
the reload cost model off (``reload_policy: always``) and on (``cost``).

    python benchmarks/reload_vs_recompute.py --sizes 1024,2048,8160 --runs 2 --threads 2 --markdown

One model object (``--model``: SmolLM2-135M-Instruct float32 by default, or ``tiny``, the tests'
random 2-layer Llama, whose recompute costs next to nothing) is shared by every engine of the run.
The prompt is ``P`` prefix tokens (real text: the seed documents, ``--seeds``, tokenized) + 16
suffix tokens, block size 16, so a hit covers exactly the prefix and the suffix is always
computed; ``max_tokens=1``, so TTFT is the request's whole time (``RequestOutput.ttft_s``).

Per prefix size, one engine with the tiers ``host``, ``lmdb``, ``redis``, ``cluster``, ``s3`` in
that order: LMDB in a temporary directory (``sync: false``); a redis-server, a 6-node Redis Cluster
(3 primaries, 3 replicas) and moto's S3 server, each started on free loopback ports by the tests'
helpers (tests/redis_server.py, tests/redis_cluster.py) and ``moto_server`` in a process of its own
(in this process its request handling would share the GIL with the engine's steps); device
pool = the prompt's blocks + 8. The engine is built with ``reload_policy: cost``, so each tier is
measured when it opens (the cost model's seed); "off" sets the same engine's cost model to
``always`` for the request, "on" back to ``cost``, so both use one engine, one set of stores and
one history of measurements. One untimed warm-up request first (first-forward costs). Each of
``--runs`` runs uses a fresh ``cache_salt``, so its prefix is cached nowhere:

* (a) recompute: the first request of the run (nothing cached on the device or in any tier);
* (b) device: the same prompt again (the prefix hits in the device pool);
* per tier, off: the device copy is evicted, the tiers above the one measured drop the prefix's
  blocks (``Tier.delete``), then the same prompt again: it must reload the prefix from that
  tier, and its tokens must equal (a)'s. Eviction takes every block of the pool through the
  backend's own ``allocate(num_free_blocks)`` and hands them back with ``free`` (the backend
  evicts the prefix as a filler request would, write-back offload to every tier lacking it);
  then ``offload.flush()`` waits for the background writer;
* per tier, on: the same again (before "off" in every second run) with the cost model deciding: it loads the prefix from that tier
  or recomputes it (the column says which); the tokens must equal (a)'s.

The verdict per row is the worst, over the tiers, of on / min(recompute, off): the issue's target
is at most 1.10; and whether each of the cost model's choices (reload or recompute) was the faster
of the two as measured in the same run ("right"). The reload bandwidth is the bytes loaded / the time from the request's arrival
(its prefetch start) to the end of the reloader's ``load_prefix`` at admission. Medians of
``--runs`` runs. ``--cold`` adds (d'): the LMDB file dropped from the page cache and a fresh engine
with LMDB alone (``posix_fadvise(DONTNEED)``, ``fincore`` before and after). The memcpy reference
lives in ``tier_bandwidth.py --reload-tokens``.
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
import uuid
from pathlib import Path

import torch

from corekv.config import CacheConfig, Config, EngineConfig, TierConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from processes import free_port  # noqa: E402  (the tests' helpers: real servers on loopback)
from redis_cluster import RedisCluster  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from peers import runner  # noqa: E402  (benchmarks/ is sys.path[0])
from s3_server import FAKE_CREDENTIALS  # noqa: E402
from seed_documents import add_seeds_argument, read_seeds  # noqa: E402  (benchmarks/ is sys.path[0])

BLOCK, SUFFIX = 16, 16
TIERS = ("host", "lmdb", "redis", "cluster", "s3")
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
#: the target: with the cost model on, TTFT at most this times the better of recompute and reload
TARGET = 1.10


def cpu_description() -> str:
    """Vendor, model (family/model numbers), the vector ISA flags, torch's dispatch and the CPUs
    this process may use."""
    cpu = runner.cpu_description()
    return (f"{cpu['vendor']} {cpu['model']} (family {cpu['family']}, model {cpu['model_number']}), ISA "
            f"{'/'.join(cpu['isa']) or 'no AVX2'}, torch {torch.backends.cpu.get_cpu_capability()}, {cpu['cpus']} CPUs")


def corpus_ids(model, n: int, seed_text: str) -> list[int]:
    """The first ``n`` token ids of ``seed_text`` (repeated as often as needed)."""
    ids = model.tokenizer.encode(seed_text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return [int(t) for t in ids[:n]]


class LoadTimer:
    """Wraps the offload reloader's ``load_prefix`` (admission's load; the real method still
    runs) and records (seconds, bytes) per call, from the request's arrival (its prefetch start)
    to the end of the call: the whole reload, never flattered by the prefetch having run ahead."""

    def __init__(self, engine: Engine):
        self.records: list[tuple[float, int]] = []
        reloader, block_bytes = engine.offload.reloader, engine.kv_pool.bytes_per_block
        load_prefix = reloader.load_prefix

        def timed(key, start, stop, block_ids, prefetcher=None, prefetch=None):
            t0 = time.perf_counter() if prefetch is None else min(prefetch.started_at, time.perf_counter())
            loaded = load_prefix(key, start, stop, block_ids, prefetcher, prefetch)
            self.records.append((time.perf_counter() - t0, sum(loaded.values()) * block_bytes))
            return loaded

        reloader.load_prefix = timed


class DecisionTimer:
    """Wraps the cost model's entry points (``limit``, ``worth_asking``, ``num_blocks_to_load``;
    the real methods still run) and adds up their seconds: what "on" adds to a request beside
    the loads it chooses, measured apart from the stores' run-to-run spread."""

    def __init__(self, cost):
        self.seconds = 0.0
        for name in ("limit", "worth_asking", "num_blocks_to_load"):
            setattr(cost, name, self._timed(getattr(cost, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def evict_all(engine: Engine) -> None:
    """Evict every idle cached block through the backend's own allocate/free (write-back runs)."""
    backend = engine.backend
    blocks = backend.allocate(backend.num_free_blocks)
    assert blocks is not None, "the pool has blocks in use; evict_all needs an idle engine"
    backend.free(blocks)
    engine.offload.flush()


def make_config(model_name: str, tiers: tuple[TierConfig, ...], num_blocks: int, budget: int) -> Config:
    return Config(model=model_name, dtype="float32", device="cpu",
                  engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=budget),
                  # NOTE: an eviction batch larger than offload_queue_blocks (default 256) is
                  # skipped whole by Offload._enqueue; an 8K prefix is 513 blocks.
                  cache=CacheConfig(backend="radix", tiers=tiers, offload_queue_blocks=2048,
                                    reload_policy="cost"))


class Stores:
    """The remote stores of a run, started once: a redis-server, a Redis Cluster, moto's S3."""

    def __init__(self, workdir: str):
        os.environ.update(FAKE_CREDENTIALS)
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
        for name in ("redis", "cluster"):
            os.makedirs(os.path.join(workdir, name), exist_ok=True)
        self.redis = RedisServer(os.path.join(workdir, "redis")).start()
        self.cluster = RedisCluster(os.path.join(workdir, "cluster")).start()
        port = free_port()
        self.s3_endpoint = f"http://127.0.0.1:{port}"
        self.moto = runner.start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                 env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runner.wait_ready(lambda: _listening(port), self.moto, timeout_s=60, what="moto_server")

    def tier_configs(self, workdir: str, tier_bytes: int) -> tuple[TierConfig, ...]:
        """Fresh, empty stores for one prefix size."""
        import boto3
        import redis as redis_py

        redis_py.Redis.from_url(self.redis.url).flushdb()
        for port in self.cluster.primary_ports():
            with self.cluster.client(port) as client:
                client.flushall()
        bucket = f"corekv-rvr-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.s3_endpoint).create_bucket(Bucket=bucket)
        return (TierConfig(type="host", name="host", options={"size": tier_bytes}),
                TierConfig(type="lmdb", name="lmdb", options={"path": os.path.join(workdir, "lmdb"),
                                                              "size": 4 * tier_bytes, "sync": False}),
                # NOTE: a deadline of 10 s, not 1 s: one pipeline carries up to an 8K prefix (377 MB)
                TierConfig(type="redis", name="redis", options={"url": self.redis.url, "socket_timeout": 10.0}),
                TierConfig(type="redis", name="cluster", options={"url": self.cluster.url, "cluster": True,
                                                                  "socket_timeout": 10.0}),
                TierConfig(type="fsspec", name="s3", options={
                    "url": f"s3://{bucket}/kv", "storage_options": {"endpoint_url": self.s3_endpoint},
                    "timeout": 30.0}))

    def stop(self) -> None:
        runner.stop(self.moto)
        self.cluster.stop()
        self.redis.stop()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def resident_bytes(path: str) -> str:
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", path], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"fincore failed: {e}"


def drop_file_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_size(model, model_name: str, size: int, args, stores: Stores, results: dict, seed_text: str) -> None:
    prompt = corpus_ids(model, size + SUFFIX, seed_text)
    num_blocks = (size + SUFFIX) // BLOCK + 8
    row = results.setdefault(size, {"recompute": [], "device": [], "lmdb_cold": [], "bw": {}, "fincore": [],
                                    "decision_s": [],
                                    **{f"{k}_{p}": [] for k in TIERS for p in ("off", "on")},
                                    "decisions": {k: [] for k in TIERS}})
    workdir = tempfile.mkdtemp(prefix="corekv-rvr-")
    salts = [f"{model_name}-{size}-rep{rep}-{uuid.uuid4().hex[:6]}" for rep in range(args.runs)]
    try:
        with Engine(make_config(model_name, (), num_blocks, args.budget), model=model) as probe:
            block_bytes = probe.kv_pool.bytes_per_block
        tiers = stores.tier_configs(workdir, args.runs * (num_blocks + 8) * block_bytes)
        with Engine(make_config(model_name, tiers, num_blocks, args.budget), model=model) as engine:
            timer = LoadTimer(engine)
            manager, cost = engine.offload, engine.offload.cost
            decisions = DecisionTimer(cost)
            row["seed"] = {name: {"latency_s": cost.stats()["load_latency_s"][name],
                                  "s_per_block": cost.stats()["load_s_per_block"][name]}
                           for name in cost.stats()["seeded"]}
            for rep, salt in enumerate(salts):
                cost.policy = "always"
                first = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]  # (a)
                assert first.num_cached_tokens == 0, first.cached_tokens_by_tier
                row["recompute"].append(first.ttft_s)
                hit = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]  # (b)
                assert hit.cached_tokens_by_tier.get("device") == size, hit.cached_tokens_by_tier
                row["device"].append(hit.ttft_s)
                hashes = list(engine.prefix_key(prompt, salt).block_hashes[:size // BLOCK])
                for index, kind in enumerate(TIERS):
                    # NOTE: the order alternates run by run, so what drifts between the two
                    # requests (the store's state, the machine's load) falls on both alike
                    for policy in ("always", "cost") if rep % 2 == 0 else ("cost", "always"):
                        evict_all(engine)  # write-back puts the prefix in every tier lacking it
                        for upper in manager.tiers[:index]:  # so that the request must use `kind`
                            upper.delete(hashes)
                        cost.policy = policy
                        decisions.take()
                        out = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]
                        assert out.token_ids == first.token_ids, (kind, policy)
                        loaded = out.cached_tokens_by_tier.get(kind, 0)
                        if policy == "always":
                            assert loaded == size, (kind, out.cached_tokens_by_tier)
                            row[f"{kind}_off"].append(out.ttft_s)
                            seconds, nbytes = timer.records[-1]
                            row["bw"].setdefault(kind, []).append(nbytes / seconds)
                        else:
                            row[f"{kind}_on"].append(out.ttft_s)
                            row["decision_s"].append(decisions.take())
                            row["decisions"][kind].append(loaded)
                print(f"{model_name} size {size} {salt}: done ({time.strftime('%H:%M:%S')}, "
                      f"load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            cost.policy = "cost"
            row["cost_stats"] = cost.stats()
        if args.cold:
            bench_cold(model, model_name, prompt, size, tiers, salts, num_blocks, args.budget, workdir, row)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    row["block_bytes"] = block_bytes


def bench_cold(model, model_name, prompt, size, tiers, salts, num_blocks, budget, workdir, row) -> None:
    """(d'): the engine closed (LMDB unmapped), the data file dropped from the page cache, a
    fresh engine over the same LMDB alone reloads every salt's prefix from disk."""
    data = os.path.join(workdir, "lmdb", "data.mdb")
    before = resident_bytes(data)
    drop_file_cache(data)
    row["fincore"].append((before, resident_bytes(data)))
    lmdb_only = tuple(t for t in tiers if t.type == "lmdb")
    with Engine(make_config(model_name, lmdb_only, num_blocks, budget), model=model) as engine:
        engine.offload.cost.policy = "always"
        timer = LoadTimer(engine)
        for salt in salts:
            cold = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]
            assert cold.cached_tokens_by_tier.get("lmdb") == size, cold.cached_tokens_by_tier
            row["lmdb_cold"].append(cold.ttft_s)
            seconds, nbytes = timer.records[-1]
            row["bw"].setdefault("lmdb_cold", []).append(nbytes / seconds)
            evict_all(engine)


def warm_up(model, model_name: str, budget: int, seed_text: str) -> None:
    """One untimed recompute, device hit and host reload of a short prompt: the first forward of
    each shape pays one-off costs (allocator, kernels) that would otherwise land on (a) and (b)."""
    prompt = corpus_ids(model, 8 * BLOCK + SUFFIX, seed_text)
    host = TierConfig(type="host", name="host", options={"size": 64 << 20})
    with Engine(make_config(model_name, (host,), 32, budget), model=model) as engine:
        for _ in range(2):
            engine.generate(prompt, ONE_TOKEN)
        evict_all(engine)
        engine.generate(prompt, ONE_TOKEN)


def summarize(results: dict) -> list[dict]:
    med = statistics.median
    rows = []
    for size, r in sorted(results.items()):
        rec = med(r["recompute"])
        out = {"prefix_tokens": size, "kv_bytes": size // BLOCK * r["block_bytes"], "recompute_s": rec,
               "device_s": med(r["device"]), "runs": len(r["recompute"]), "seed": r.get("seed", {}),
               "reload_stats": r.get("cost_stats", {})}
        worst = 0.0
        for kind in TIERS:
            off, on = med(r[f"{kind}_off"]), med(r[f"{kind}_on"])
            best = min(rec, off)
            out[kind] = {"off_s": off, "on_s": on, "on_vs_best": on / best,
                         "off_runs_s": r[f"{kind}_off"], "on_runs_s": r[f"{kind}_on"],
                         "loaded_tokens_on": r["decisions"][kind], "GBps": med(r["bw"][kind]) / 1e9}
            worst = max(worst, on / best)
        out["worst_on_vs_best"] = worst
        # the cost model's own time per "on" request (median, max): what "on" adds beside its choice
        out["decision_us"] = (med(r["decision_s"]) * 1e6, max(r["decision_s"]) * 1e6)
        if r["lmdb_cold"]:
            out["lmdb_cold_s"] = med(r["lmdb_cold"])
            out["lmdb_cold_GBps"] = med(r["bw"]["lmdb_cold"]) / 1e9
            out["fincore_before_after"] = r["fincore"]
        rows.append(out)
    return rows


def markdown(rows: list[dict], model_name: str) -> str:
    head = " | ".join(f"{k} off / on s" for k in TIERS)
    lines = [f"| model | prefix tokens | KV MB | (a) recompute s | (b) device s | {head} | worst on / best |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(TIERS) + "---:|"]
    for r in rows:
        cells = []
        for kind in TIERS:
            c = r[kind]
            loads = c["loaded_tokens_on"]
            how = ("reload" if all(n == r["prefix_tokens"] for n in loads) else
                   "recompute" if not any(loads) else "mixed")
            faster = "reload" if c["off_s"] <= r["recompute_s"] else "recompute"
            cells.append(f"{c['off_s']:.3f} / {c['on_s']:.3f} ({how}{', right' if how == faster else ''})")
        lines.append(f"| {model_name} | {r['prefix_tokens']} | {r['kv_bytes'] / 1e6:.1f} | {r['recompute_s']:.3f} "
                     f"| {r['device_s']:.3f} | " + " | ".join(cells) + f" | {r['worst_on_vs_best']:.2f} |")
    lines += ["", "| model | prefix tokens | " + " | ".join(f"{k} GB/s" for k in TIERS)
              + " | cost model's time per request, median / max µs |",
              "|---|---:|" + "---:|" * (len(TIERS) + 1)]
    for r in rows:
        lines.append(f"| {model_name} | {r['prefix_tokens']} | " + " | ".join(f"{r[k]['GBps']:.2f}" for k in TIERS)
                     + " | {:.0f} / {:.0f} |".format(*r["decision_us"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="smollm2-135m-instruct, or tiny (the tests' random 2-layer Llama, 4096 positions)")
    parser.add_argument("--sizes", default="1024,2048,8160",
                        help="prefix lengths in tokens (multiples of 16; SmolLM2's context is 8192 tokens, "
                             "so 8K is 8160 + the 16-token suffix)")
    parser.add_argument("--runs", type=int, default=2, help="runs per size (each: a fresh salt)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--budget", type=int, default=1024, help="engine.max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--cold", action="store_true", help="also (d'): LMDB dropped from the page cache")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="write the summary here")
    add_seeds_argument(parser)
    args = parser.parse_args()
    seed_text = read_seeds(args.seeds)
    sizes = [int(s) for s in args.sizes.split(",")]
    bad = [s for s in sizes if s <= 0 or s % BLOCK]
    if bad:
        parser.error(f"--sizes: {bad} are not positive multiples of the block size {BLOCK}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    torch.set_num_threads(args.threads)
    started = time.strftime("%H:%M:%S UTC", time.gmtime())
    print(f"{cpu_description()}; threads {torch.get_num_threads()}, load average at start {os.getloadavg()}",
          file=sys.stderr)
    if args.model == "tiny":
        from corekv.engine.tiny_model import make_tiny_llama

        model = make_tiny_llama()
    else:
        from corekv.engine.models import load_model

        model = load_model(args.model, dtype="float32", device="cpu")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="corekv-rvr-stores-") as store_dir:
        stores = Stores(store_dir)
        try:
            warm_up(model, args.model, args.budget, seed_text)
            for size in sizes:
                bench_size(model, args.model, size, args, stores, results, seed_text)
                if args.json:  # after every size, so an interrupted run keeps what it measured
                    Path(args.json).write_text(json.dumps(summarize(results), indent=1))
        finally:
            stores.stop()
    rows = summarize(results)
    meta = {"cpu": cpu_description(), "threads": args.threads, "started": started,
            "ended": time.strftime("%H:%M:%S UTC", time.gmtime()), "load_average_end": os.getloadavg()}
    print(f"load average at end {os.getloadavg()}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta) + "\n" + (markdown(rows, args.model) if args.markdown else json.dumps(rows, indent=1)))


if __name__ == "__main__":
    main()
