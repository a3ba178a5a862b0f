"""TTFT of a prompt whose prefix is recomputed, hit on the device, or reloaded from a tier.

    python benchmarks/reload_vs_recompute.py --sizes 512,1024,2048,4096 --runs 3 --threads 2 --markdown

SmolLM2-135M-Instruct, float32, loaded once and shared by every engine of the run. The prompt is
``P`` prefix tokens (real text: the seed documents, ``--seeds``, tokenized) + 16 suffix tokens, block size
16, so a hit covers exactly the prefix and the suffix is always computed; ``max_tokens=1``, so TTFT
is the request's whole time (``RequestOutput.ttft_s``, arrival to first token).

Per prefix size, one engine with the tiers ``host``, ``lmdb``, ``redis`` (in that order; a
redis-server started on a free loopback port, LMDB in a temporary directory, ``sync: false``),
device pool = the prompt's blocks + 8. One untimed warm-up request first (first-forward costs).
Each of ``--runs`` runs uses a fresh ``cache_salt``, so its prefix is cached nowhere:

* (a) recompute: the first request of the run (nothing cached on the device or in any tier);
* (b) device: the same prompt again (the prefix hits in the device pool);
* (c-e) reload from host, lmdb, redis: the device copy is evicted, the tiers above the one
  measured drop the prefix's blocks (``Tier.delete``), then the same prompt again (the prefix
  must reload from that tier, and its tokens must equal (a)'s). Eviction takes every block of
  the pool through the backend's own ``allocate(num_free_blocks)`` and hands them back with
  ``free``: the backend evicts the cached prefix exactly as a filler request would (write-back
  offload to every tier lacking it) without spending a filler's prefill; then
  ``offload.flush()`` waits for the background writer.
* (d') lmdb cold: after the runs the engine is closed (LMDB unmapped), ``posix_fadvise(DONTNEED)``
  drops the data file's pages from the page cache (``fincore`` prints the resident bytes before
  and after), and a fresh engine with the LMDB tier alone reloads every run's prefix from disk.

The reload bandwidth is the bytes loaded / the time from the request's arrival (its prefetch
start) to the end of the reloader's ``load_prefix`` at admission (timed by wrapping the real method);
memcpy is the faster of ``numpy.copyto`` and ``torch.Tensor.copy_`` of the same number of bytes
between two preallocated uint8 buffers (the stricter reference), measured right after each reload,
and next to it the same bytes copied block by block (``numpy.copyto`` per 0.7 MiB row: the copy a
reload makes; see :func:`tier_bandwidth.memcpy_seconds` on why the two differ). Medians of ``--runs`` runs.
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

import torch

from corekv.config import CacheConfig, Config, EngineConfig, TierConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.models import load_model
from corekv.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_server import RedisServer  # noqa: E402  (the tests' helper: a real redis-server on loopback)
from seed_documents import add_seeds_argument, read_seeds  # noqa: E402  (benchmarks/ is sys.path[0])
from tier_bandwidth import memcpy_seconds  # noqa: E402  (the cache-cold memcpy reference)

BLOCK, SUFFIX = 16, 16
TIERS = ("host", "lmdb", "redis")
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def corpus_ids(model, n: int, seed_text: str) -> list[int]:
    """The first ``n`` token ids of ``seed_text`` (repeated as often as needed)."""
    ids = model.tokenizer.encode(seed_text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return [int(t) for t in ids[:n]]


class LoadTimer:
    """Wraps the offload reloader's ``load_prefix`` (admission's load; the real method still
    runs) and records (seconds, bytes) per call. The time runs from the request's arrival, when its
    prefetch started (or from the call, without one), to the end of the call: the whole reload,
    I/O overlapped with other work included, so the bandwidth is never flattered by the
    prefetch having run ahead."""

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


def evict_all(engine: Engine) -> None:
    """Evict every idle cached block through the backend's own allocate/free (write-back runs)."""
    backend = engine.backend
    blocks = backend.allocate(backend.num_free_blocks)
    assert blocks is not None, "the pool has blocks in use; evict_all needs an idle engine"
    backend.free(blocks)
    engine.offload.flush()


def make_config(tiers: tuple[TierConfig, ...], num_blocks: int, budget: int) -> Config:
    return Config(model="smollm2-135m-instruct", dtype="float32", device="cpu",
                  engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=budget),
                  # NOTE: an eviction batch larger than offload_queue_blocks (default 256) is
                  # skipped whole by Offload._enqueue; a 4K prefix is 257 blocks.
                  cache=CacheConfig(backend="radix", tiers=tiers, offload_queue_blocks=1024))


def tier_cfg(kind: str, workdir: str, redis_url: str, tier_bytes: int) -> TierConfig:
    if kind == "host":
        return TierConfig(type="host", name="host", options={"size": tier_bytes})
    if kind == "lmdb":
        return TierConfig(type="lmdb", name="lmdb", options={"path": os.path.join(workdir, "lmdb"),
                                                             "size": 4 * tier_bytes, "sync": False})
    return TierConfig(type="redis", name="redis", options={"url": redis_url})


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


def bench_size(model, size: int, runs: int, budget: int, redis: RedisServer, results: dict,
               seed_text: str) -> None:
    import redis as redis_py

    prompt = corpus_ids(model, size + SUFFIX, seed_text)
    num_blocks = (size + SUFFIX) // BLOCK + 8
    row = results.setdefault(size, {"recompute": [], "device": [], "host": [], "lmdb": [], "redis": [],
                                    "lmdb_cold": [], "bw": {}, "memcpy_bw": {}, "memcpy_rows_bw": {},
                                    "fincore": []})
    redis_py.Redis.from_url(redis.url).flushdb()
    workdir = tempfile.mkdtemp(prefix="corekv-rvr-")
    block_bytes = 30 * 2 * 3 * BLOCK * 64 * 4  # SmolLM2-135M float32; checked against the pool below
    tiers = tuple(tier_cfg(k, workdir, redis.url, runs * (num_blocks + 8) * block_bytes) for k in TIERS)
    salts = [f"rep{rep}" for rep in range(runs)]
    try:
        with Engine(make_config(tiers, num_blocks, budget), model=model) as engine:
            assert engine.kv_pool.bytes_per_block == block_bytes, engine.kv_pool.bytes_per_block
            timer = LoadTimer(engine)
            manager = engine.offload
            for salt in salts:
                # (a) a salt never seen: nothing cached on the device or in any tier
                first = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]
                assert first.num_cached_tokens == 0, first.cached_tokens_by_tier
                row["recompute"].append(first.ttft_s)
                hit = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]  # (b)
                assert hit.cached_tokens_by_tier.get("device") == size, hit.cached_tokens_by_tier
                row["device"].append(hit.ttft_s)
                hashes = list(engine.prefix_key(prompt, salt).block_hashes[:size // BLOCK])
                for index, kind in enumerate(TIERS):  # (c), (d), (e)
                    evict_all(engine)  # write-back puts the prefix in every tier lacking it
                    for upper in manager.tiers[:index]:  # so that the next request must use `kind`
                        upper.delete(hashes)
                    reloaded = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]
                    assert reloaded.cached_tokens_by_tier.get(kind) == size, (kind, reloaded.cached_tokens_by_tier)
                    assert reloaded.token_ids == first.token_ids
                    row[kind].append(reloaded.ttft_s)
                    seconds, nbytes = timer.records[-1]
                    row["bw"].setdefault(kind, []).append(nbytes / seconds)
                    row["memcpy_bw"].setdefault(kind, []).append(nbytes / memcpy_seconds(nbytes))
                    row["memcpy_rows_bw"].setdefault(kind, []).append(
                        nbytes / memcpy_seconds(nbytes, block_bytes=block_bytes))
                print(f"size {size} {salt}: done ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
        # (d') cold: the engine closed (LMDB unmapped), the data file dropped from the page cache,
        # a fresh engine over the same LMDB reloads every salt's prefix from disk.
        data = os.path.join(workdir, "lmdb", "data.mdb")
        before = resident_bytes(data)
        drop_file_cache(data)
        row["fincore"].append((before, resident_bytes(data)))
        lmdb_only = tuple(t for t in tiers if t.type == "lmdb")
        with Engine(make_config(lmdb_only, num_blocks, budget), model=model) as engine:
            timer = LoadTimer(engine)
            for salt in salts:
                cold = engine.generate(prompt, ONE_TOKEN, cache_salt=salt)[0]
                assert cold.cached_tokens_by_tier.get("lmdb") == size, cold.cached_tokens_by_tier
                row["lmdb_cold"].append(cold.ttft_s)
                seconds, nbytes = timer.records[-1]
                row["bw"].setdefault("lmdb_cold", []).append(nbytes / seconds)
                evict_all(engine)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    row["block_bytes"] = block_bytes


def warm_up(model, budget: int, seed_text: str) -> None:
    """One untimed recompute, device hit and host reload of a short prompt: the first forward of
    each shape pays one-off costs (allocator, kernels) that would otherwise land on (a) and (b)."""
    prompt = corpus_ids(model, 8 * BLOCK + SUFFIX, seed_text)
    host = TierConfig(type="host", name="host", options={"size": 64 << 20})
    with Engine(make_config((host,), 32, budget), model=model) as engine:
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
               "n_recompute": len(r["recompute"])}
        for kind in ("device", "host", "lmdb", "lmdb_cold", "redis"):
            if r[kind]:
                out[f"{kind}_s"] = med(r[kind])
                out[f"{kind}_speedup"] = rec / med(r[kind])
                out[f"n_{kind}"] = len(r[kind])
        for kind, values in r["bw"].items():
            out[f"{kind}_GBps"] = med(values) / 1e9
        for kind, values in r["memcpy_bw"].items():
            out[f"memcpy_GBps_{kind}"] = med(values) / 1e9
        out["memcpy_GBps"] = med([v for vs in r["memcpy_bw"].values() for v in vs]) / 1e9
        out["memcpy_rows_GBps"] = med([v for vs in r["memcpy_rows_bw"].values() for v in vs]) / 1e9
        out["fincore_before_after"] = r["fincore"]
        rows.append(out)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| prefix tokens | KV MB | (a) recompute s | (b) device s (x) | (c) host s (x) | (d) lmdb warm s (x) "
             "| (d') lmdb cold s (x) | (e) redis s (x) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[f'{k}_s']:.3f} ({r[f'{k}_speedup']:.1f}x)" for k in ("device", "host", "lmdb", "lmdb_cold", "redis")]
        lines.append(f"| {r['prefix_tokens']} | {r['kv_bytes'] / 1e6:.1f} | {r['recompute_s']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| prefix tokens | host GB/s | lmdb warm GB/s | lmdb cold GB/s | redis GB/s | memcpy GB/s "
              "| memcpy by block GB/s | host / memcpy, by block | lmdb warm / memcpy, by block "
              "| redis / memcpy, by block |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        whole, by_block = r["memcpy_GBps"], r["memcpy_rows_GBps"]
        ratios = [f"{r[f'{k}_GBps'] / whole:.0%}, {r[f'{k}_GBps'] / by_block:.0%}" for k in ("host", "lmdb", "redis")]
        lines.append(f"| {r['prefix_tokens']} | {r['host_GBps']:.2f} | {r['lmdb_GBps']:.2f} | {r['lmdb_cold_GBps']:.2f} "
                     f"| {r['redis_GBps']:.2f} | {whole:.2f} | {by_block:.2f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024,2048,4096", help="prefix lengths in tokens (multiples of 16)")
    parser.add_argument("--runs", type=int, default=3, help="runs per size (each: a fresh salt)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--budget", type=int, default=1024, help="engine.max_num_batched_tokens (prefill chunk)")
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
    print(f"threads {torch.get_num_threads()}, load average at start {os.getloadavg()}", file=sys.stderr)
    model = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="corekv-redis-") as redis_dir:
        redis = RedisServer(redis_dir).start()
        try:
            warm_up(model, args.budget, seed_text)
            for size in sizes:
                bench_size(model, size, args.runs, args.budget, redis, results, seed_text)
                if args.json:  # after every size, so an interrupted run keeps what it measured
                    Path(args.json).write_text(json.dumps(summarize(results), indent=1))
        finally:
            redis.stop()
    rows = summarize(results)
    print(f"load average at end {os.getloadavg()}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
