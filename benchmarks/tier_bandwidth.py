"""Get/put bandwidth of every tier for SmolLM2-135M blocks, next to a plain memcpy of the same bytes.

One block = 30 layers x 2 (K, V) x 3 KV heads x 16 tokens x 64 head_dim x 4 bytes (float32)
= 737,280 bytes. Each measurement moves ``--blocks`` blocks in batches of ``--batch`` and is the
median of ``--repeats`` runs after one untimed warm-up put; every put run uses fresh keys (a re-put of a present block is free
in most tiers and would flatter them). ``get`` includes header and checksum validation and the
copy into a preallocated pool buffer; ``get_into`` validates and copies straight from the tier's
storage into that buffer (what a reload costs before the host-to-device copy). memcpy rows show
the copy alone, in the get_into column. The "breakdown" rows split a host reload into its parts,
on the same bytes: the entry's tag alone (the key-bound xxh3-128 checksum, and the keyed BLAKE2b
MAC that ``cache.integrity`` turns on), a per-block numpy copy alone, a per-block copy through a
memoryview, and the staging-to-pool copy a prefetched reload makes at admission (one
``index_copy_`` of all rows into a pool tensor). Rows marked "MAC" run the same tier with an
integrity secret, so their ratio to the plain row is the MAC's cost on that tier.

    python benchmarks/tier_bandwidth.py [--blocks 32] [--batch 8] [--repeats 5] [--markdown]

``--reload-tokens 2048,4096,8192`` instead measures a whole prefix's reload from the host tier and
from a warm LMDB (in the page cache) through the offload facade the engine calls
(:class:`corekv.offload.Offload`: ``arrived`` then ``load`` into a real :class:`KVPool`), next to
a memcpy of the same bytes in the same run; see :func:`reload_rows`.
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
import uuid

import numpy as np
import torch

from corekv.block_format import HEADER_SIZE
from corekv.hashing import block_hashes, chain_seed
from corekv.tiers.fsspec import FsspecTier
from corekv.tiers.host import HostTier
from corekv.tiers.lmdb import LMDBTier
from corekv.tiers.shm import ShmTier

SHAPE = (30, 2, 3, 16, 64)  # layers, K/V, kv heads, block tokens, head_dim
BLOCK_BYTES = int(np.prod(SHAPE)) * 4
FINGERPRINT = b"bench-smollm2-135m-float32"
SECRET = b"bench-integrity-secret-of-32-byt"
#: the reload paths of --reload-tokens (see reload_rows)
WAYS = ("admit", "sync", "staged", "staged, fresh")


def cpu_description() -> str:
    """Vendor, model and the vector ISA torch dispatches to (AVX2, AVX512): benchmarks name the CPU."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, torch ISA {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs"


def median_seconds(fn, repeats: int) -> float:
    times = []
    for rep in range(repeats):
        start = time.perf_counter()
        fn(rep)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_rates(num_bytes: int, repeats: int) -> dict[str, float]:
    src = np.random.default_rng(0).integers(0, 256, num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)
    np.copyto(dst, src)  # NOTE: first touch of dst's pages is not part of a copy's steady state
    return {"memcpy (numpy copyto)": num_bytes / median_seconds(lambda _: np.copyto(dst, src), repeats),
            "memcpy (torch copy_)": num_bytes / median_seconds(lambda _: dst_t.copy_(src_t), repeats)}


_EVICTION: list[np.ndarray] = []


def evict_cpu_caches() -> None:
    """Touch every cache line of a buffer larger than the last-level cache: the next copy reads
    DRAM, as a reload of blocks stored earlier does (repeated copies of the same buffers would
    otherwise run from the cache, far faster; BENCHMARKS.md, "Tiers in the engine")."""
    if not _EVICTION:
        _EVICTION.append(np.ones(768 << 20, dtype=np.uint8))
    _EVICTION[0][::64] += 1


def memcpy_seconds(num_bytes: int, repeats: int = 5, *, block_bytes: int = 0) -> float:
    """The faster of ``numpy.copyto`` and ``torch.Tensor.copy_`` between two preallocated uint8
    buffers of ``num_bytes`` (median of ``repeats`` each, the CPU caches evicted before each): the
    stricter reference. ``block_bytes``: instead, ``numpy.copyto`` row by row in rows of
    ``block_bytes``, the copy a reload makes.

    NOTE: glibc's memcpy switches to non-temporal stores above a size threshold (``ld.so
    --list-tunables`` prints it: ``glibc.cpu.x86_non_temporal_threshold``), which copy large
    buffers markedly faster (BENCHMARKS.md, "Tiers in the engine"); a copy of one block (0.7 MiB)
    stays under it unless ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=...`` lowers it.
    Hence both references.
    """
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty(num_bytes, dtype=torch.uint8)
    dst.copy_(src)  # first touch
    src_np, dst_np = src.numpy(), dst.numpy()
    copies = [lambda: dst.copy_(src), lambda: np.copyto(dst_np, src_np)]
    if block_bytes:
        rows = num_bytes // block_bytes
        src_rows = src_np[:rows * block_bytes].reshape(rows, block_bytes)
        dst_rows = dst_np[:rows * block_bytes].reshape(rows, block_bytes)

        def by_rows():
            for i in range(rows):
                np.copyto(dst_rows[i], src_rows[i])
        copies = [by_rows]
    best = float("inf")
    for copy in copies:
        times = []
        for _ in range(repeats):
            evict_cpu_caches()
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best


def breakdown_rates(num_blocks: int, repeats: int) -> dict[str, float]:
    """Bytes/s of each part of a host reload of ``num_blocks`` blocks (see the module docstring)."""
    import hashlib

    import xxhash

    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, (num_blocks, BLOCK_BYTES), dtype=np.uint8)
    dst = np.empty_like(src)
    pool = torch.empty((num_blocks + 4, *SHAPE), dtype=torch.float32)
    index = torch.arange(2, 2 + num_blocks)
    staged = torch.from_numpy(src).view(torch.float32).view(num_blocks, *SHAPE)
    src_views = [memoryview(row) for row in src]
    dst_views = [memoryview(row) for row in dst]

    def checksum(_):
        for row in src:
            xxhash.xxh3_128_digest(row)

    def mac(_):
        for row in src:
            hashlib.blake2b(row, key=SECRET, digest_size=16).digest()

    def copy_numpy(_):
        for i in range(num_blocks):
            np.copyto(dst[i], src[i])

    def copy_memoryview(_):
        for i in range(num_blocks):
            dst_views[i][:] = src_views[i]

    total = num_blocks * BLOCK_BYTES
    for part in (copy_numpy, lambda _: pool.index_copy_(0, index, staged)):
        part(None)  # first touch
    return {"breakdown: xxh3-128 checksum": total / median_seconds(checksum, repeats),
            "breakdown: keyed BLAKE2b MAC": total / median_seconds(mac, repeats),
            "breakdown: numpy copy per block": total / median_seconds(copy_numpy, repeats),
            "breakdown: memoryview copy per block": total / median_seconds(copy_memoryview, repeats),
            "breakdown: staging -> pool index_copy_": total / median_seconds(
                lambda _: pool.index_copy_(0, index, staged), repeats)}


def measure(tier, args) -> tuple[float, float, float]:
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in range(args.batch)]
    pool = np.empty((args.batch, BLOCK_BYTES), dtype=np.uint8)
    keys_by_rep = {rep: block_hashes(list(range(16 * args.blocks)), 16,
                                     chain_seed("bench", 16, f"rep-{rep}-{uuid.uuid4().hex}"))
                   for rep in range(-1, args.repeats)}

    def put(rep):
        keys = keys_by_rep[rep]
        for i in range(0, len(keys), args.batch):
            batch = keys[i:i + args.batch]
            stored = tier.put(list(zip(batch, payloads)))
            assert stored == len(batch), f"{tier.name} skipped {len(batch) - stored} blocks"

    def get(rep):
        keys = keys_by_rep[args.repeats - 1]
        for i in range(0, len(keys), args.batch):
            for row, payload in enumerate(tier.get(keys[i:i + args.batch])):
                pool[row] = np.frombuffer(payload, dtype=np.uint8)

    def get_into(rep):
        keys = keys_by_rep[args.repeats - 1]
        for i in range(0, len(keys), args.batch):
            assert all(tier.get_into(keys[i:i + args.batch], list(pool)))

    total = args.blocks * BLOCK_BYTES
    put(-1)  # NOTE: warm-up: first-touch page faults of a fresh arena or file are not steady state
    put_rate = total / median_seconds(put, args.repeats)
    get_rate = total / median_seconds(get, args.repeats)
    get_into_rate = total / median_seconds(get_into, args.repeats)
    assert tier.stats()["misses"] == 0 and tier.stats()["faults"] == 0
    return put_rate, get_rate, get_into_rate


def reload_rows(sizes: list[int], repeats: int, workdir: str, device: str = "cpu") -> list[dict]:
    """Per prefix length (tokens): bytes/s of reloading the prefix's blocks into a block-major
    ``KVPool`` on ``device`` (CPU, or CUDA: through pinned staging, timed to the copy's end)
    through :class:`~corekv.offload.Offload`, three ways, and of a memcpy of the same bytes,
    measured alternately (repeat after repeat) in the same run.

    * ``admit``: ``arrived`` then ``load`` at once (a request admitted as it arrives: its prefetch
      job is stopped after its current tier call and admission loads the rest into the pool);
    * ``sync``: no prefetch (``load`` without ``arrived``): admission reads every block into the pool;
    * ``staged``: ``arrived``, the prefetch job left to finish, then ``load`` (staging -> pool);
    * ``staged, fresh``: the same with the staging buffer allocated anew for every job instead of
      recycled (:class:`corekv.offload.pool_io.StagingBuffers`), as corekv did before: the A/B of
      that change, in the same run.

The references, per repeat: the one-call memcpy of the same bytes and a block-by-block one
(:func:`memcpy_seconds`), and the entry check alone (xxh3-128 over each
block, one thread), since a reload both checks and copies every byte.

    After one untimed warm-up repeat, each repeat stores the prefix under fresh keys (the offload writer's own path, out of the
    pool) and drops the previous repeat's, evicts the CPU caches (a reload reads blocks stored
    earlier, as :func:`memcpy_seconds`' reference does), then times arrival ->
    end of ``load`` and counts the minor page faults taken. Medians over repeats.
    """
    import xxhash

    import resource

    from corekv.engine.kv_pool import KVPool
    from corekv.hashing import PrefixKey
    from corekv.offload import Offload

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    rows = []
    for tokens in sizes:
        num = tokens // 16
        pool = KVPool(SHAPE[0], num + 8, SHAPE[3], SHAPE[2], SHAPE[4], dtype=torch.float32, device=device)
        pool.storage.view(torch.uint8).view(num + 8, -1)[:num].copy_(
            torch.randint(0, 256, (num, BLOCK_BYTES), dtype=torch.uint8))
        expected = pool.storage[:num].view(torch.uint8).clone()  # NOTE: bytes: random floats hold NaNs
        entry = BLOCK_BYTES + HEADER_SIZE
        kw = {"block_bytes": BLOCK_BYTES, "fingerprint": FINGERPRINT, "dtype": "float32", "shape": pool.block_shape}
        rates: dict[str, list[float]] = {}
        page_faults: dict[str, list[int]] = {}
        shm_path = f"/dev/shm/corekv-bench-{uuid.uuid4().hex[:12]}"
        for kind in ("host", "shm", "lmdb"):
            shutil.rmtree(f"{workdir}/lmdb-reload", ignore_errors=True)
            shutil.rmtree(shm_path, ignore_errors=True)
            size = 4 * (num + 8) * entry + (64 << 20)
            tier = (HostTier(size=(2 * num + 8) * entry, **kw) if kind == "host" else
                    ShmTier(path=shm_path, size=size, **kw) if kind == "shm" else
                    LMDBTier(path=f"{workdir}/lmdb-reload", size=size, sync=False, **kw))
            offload = Offload([tier], pool, queue_blocks=num + 8)
            previous: list[bytes] = []
            staging = getattr(offload.reloader, "staging", None)  # None: a corekv before StagingBuffers
            for rep in range(-1, repeats):  # NOTE: repeat -1 is a warm-up: the kept staging's first faults
                for way in WAYS if staging is not None else WAYS[:-1]:
                    key = PrefixKey(list(range(tokens)), 16, chain_seed("bench", 16, f"{kind}-{way}-{rep}"))
                    hashes = key.block_hashes
                    offload.flush(list(zip(hashes, range(num))))
                    tier.delete(previous)
                    previous = hashes
                    if staging is not None:
                        staging.is_recycled = way != "staged, fresh"  # the A/B switch: off, nothing is kept
                    evict_cpu_caches()
                    f0, t0 = faults(), time.perf_counter()
                    if way != "sync":  # NOTE: without arrived() there is no prefetch: admission reads all
                        offload.arrived(rep, key, 0, num)
                    if way.startswith("staged"):
                        offload.prefetches[rep].future.result()
                    loaded = offload.load(rep, key, 0, num, list(range(num)))
                    if pool.device.type == "cuda":
                        torch.cuda.synchronize()  # the host-to-device copies are asynchronous
                    seconds = time.perf_counter() - t0
                    assert loaded == {tier.name: num}, (kind, way, loaded)
                    if rep >= 0:
                        page_faults.setdefault(f"{kind} {way}", []).append(faults() - f0)
                        rates.setdefault(f"{kind} {way}", []).append(num * BLOCK_BYTES / seconds)
                if rep < 0:
                    continue
                total = num * BLOCK_BYTES  # NOTE: the reference, once per repeat, beside the reloads
                rates.setdefault("memcpy", []).append(total / memcpy_seconds(total, repeats=1))
                rates.setdefault("memcpy by block", []).append(
                    total / memcpy_seconds(total, repeats=1, block_bytes=BLOCK_BYTES))
                rows_u8 = pool.storage.view(torch.uint8).view(num + 8, -1).cpu().numpy()
                evict_cpu_caches()
                t0 = time.perf_counter()
                for i in range(num):
                    xxhash.xxh3_128_digest(rows_u8[i])
                rates.setdefault("xxh3", []).append(total / (time.perf_counter() - t0))
            assert torch.equal(pool.storage[:num].view(torch.uint8), expected), f"{kind}: the reloaded pool differs from what was stored"
            offload.close()
            shutil.rmtree(shm_path, ignore_errors=True)
        row = {"prefix_tokens": tokens, "kv_bytes": num * BLOCK_BYTES, "repeats": repeats}
        row.update({f"{k} GB/s": statistics.median(v) / 1e9 for k, v in rates.items()})
        row.update({f"{k} minor faults": statistics.median(v) for k, v in page_faults.items()})
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del pool, expected
    return rows


def reload_markdown(rows: list[dict]) -> str:
    """Two tables: GB/s (and the share of the same run's one-call memcpy) per path, then the
    minor page faults per reload."""
    paths = [f"{k} {w}" for k in ("host", "shm", "lmdb") for w in WAYS]
    lines = ["| prefix tokens | KV MB | memcpy GB/s | memcpy by block | xxh3 alone | "
             + " | ".join(paths) + " |", "|---:|---:|---:|---:|---:|" + "---:|" * len(paths)]
    for r in rows:
        memcpy = r["memcpy GB/s"]
        cells = [f"{r[f'{p} GB/s']:.2f} ({r[f'{p} GB/s'] / memcpy:.0%})" if f"{p} GB/s" in r else "-" for p in paths]
        lines.append(f"| {r['prefix_tokens']} | {r['kv_bytes'] / 1e6:.0f} | {memcpy:.2f} | {r['memcpy by block GB/s']:.2f} "
                     f"| {r['xxh3 GB/s']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "| prefix tokens | " + " | ".join(f"{p} faults" for p in paths) + " |",
              "|---:|" + "---:|" * len(paths)]
    for r in rows:
        lines.append(f"| {r['prefix_tokens']} | " + " | ".join(
            f"{r[f'{p} minor faults']:.0f}" if f"{p} minor faults" in r else "-" for p in paths) + " |")
    return "\n".join(lines)


def start_redis(workdir: str):
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32, help="blocks per run")
    parser.add_argument("--batch", type=int, default=8, help="blocks per tier call")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (median)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--reload-tokens", help="prefix lengths (tokens, multiples of 16), e.g. 2048,4096,8192: "
                        "measure whole-prefix reloads instead (see reload_rows)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="the pool's device for --reload-tokens: cpu, cuda or cuda:N")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.reload_tokens:
        sizes = [int(s) for s in args.reload_tokens.split(",")]
        if any(s <= 0 or s % 16 for s in sizes):
            parser.error(f"--reload-tokens: {sizes} must be positive multiples of 16")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
        if args.device != "cpu" and not args.device.startswith("cuda"):
            parser.error(f"--device {args.device}: must be cpu, cuda or cuda:N")
        gpu = f"; GPU: {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""
        print(f"CPU: {cpu_description()}{gpu}; load average {os.getloadavg()}")
        with tempfile.TemporaryDirectory(prefix="corekv-bench-") as workdir:
            rows = reload_rows(sizes, args.repeats, workdir, args.device)
        print(f"median of {args.repeats}; torch {torch.__version__}, Python {sys.version.split()[0]}; "
              f"load average {os.getloadavg()}")
        print(reload_markdown(rows) if args.markdown else json.dumps(rows, indent=1))
        return
    total = args.blocks * BLOCK_BYTES
    kw = {"block_bytes": BLOCK_BYTES, "fingerprint": FINGERPRINT, "dtype": "float32", "shape": SHAPE}
    rows = [(name, None, None, rate) for name, rate in memcpy_rates(total, args.repeats).items()]
    rows += [(name, None, None, rate) for name, rate in breakdown_rates(args.blocks, args.repeats).items()]
    workdir = tempfile.mkdtemp(prefix="corekv-bench-")
    redis_proc, redis_url = start_redis(workdir)
    entry = BLOCK_BYTES + HEADER_SIZE
    factories = {
        "host": lambda: HostTier(size=(args.blocks + 8) * entry, **kw),  # evicts: steady state
        "lmdb (sync=True)": lambda: LMDBTier(path=f"{workdir}/lmdb-sync", size=4 * args.blocks * args.repeats * entry, **kw),
        "lmdb (sync=False)": lambda: LMDBTier(path=f"{workdir}/lmdb-nosync", size=4 * args.blocks * args.repeats * entry,
                                              sync=False, **kw),
        "shm (/dev/shm)": lambda: ShmTier(path=f"/dev/shm/corekv-bench-{uuid.uuid4().hex[:12]}",
                                          size=4 * args.blocks * args.repeats * entry, **kw),
        "fsspec file://": lambda: FsspecTier(url=f"file://{workdir}/fsspec", **kw),
        "fsspec memory://": lambda: FsspecTier(url=f"memory://corekv-bench-{uuid.uuid4().hex}", **kw),
    }
    if redis_url:
        from corekv.tiers.redis import RedisTier
        factories["redis (loopback)"] = lambda: RedisTier(url=redis_url, **kw)
    try:
        for name, factory in factories.items():
            for keyed in (False, True):
                if keyed and name.startswith(("lmdb (sync=True)", "fsspec memory")):
                    continue  # the MAC's cost shows on the other rows; these only repeat it
                if name.startswith("lmdb"):
                    shutil.rmtree(f"{workdir}/lmdb-sync", ignore_errors=True)
                    shutil.rmtree(f"{workdir}/lmdb-nosync", ignore_errors=True)
                with factory() as tier:
                    if keyed:
                        tier.codec = tier.codec.with_secret(SECRET)
                    rows.append((name + (" MAC" if keyed else ""), *measure(tier, args)))
                if name.startswith("shm"):
                    shutil.rmtree(tier.path, ignore_errors=True)
    finally:
        if redis_proc is not None:
            redis_proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    memcpy = max(rate for name, put, get, rate in rows if name.startswith("memcpy"))
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        HIREDIS_AVAILABLE = False
    print(f"CPU: {cpu_description()}")
    print(f"{args.blocks} blocks x {BLOCK_BYTES} bytes per run, batches of {args.batch}, "
          f"median of {args.repeats}; torch {torch.__version__}, Python {sys.version.split()[0]}, "
          f"hiredis {'yes' if HIREDIS_AVAILABLE else 'no'}; load average {os.getloadavg()}")
    text = lambda rate: f"{rate / 1e9:.2f}" if rate is not None else "-"
    if args.markdown:
        print("\n| path | put GB/s | get GB/s | get_into GB/s | get_into / memcpy |\n|---|---:|---:|---:|---:|")
    for name, put, get, get_into in rows:
        if args.markdown:
            print(f"| {name} | {text(put)} | {text(get)} | {text(get_into)} | {get_into / memcpy:.0%} |")
        else:
            print(f"{name:22s} put {text(put):>6s}  get {text(get):>6s}  get_into {text(get_into):>6s} GB/s"
                  f"  ({get_into / memcpy:.0%} of memcpy)")


if __name__ == "__main__":
    main()
