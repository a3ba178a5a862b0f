"""Chained block-hashing throughput: corekv (xxh3_128, sha256) against vLLM's real request hasher.

    PEERS_HOME=/work/.peers-home /work/.venv-peers/bin/python benchmarks/hashing.py --repeats 5

Hashes every request of the four seed workloads (``corekv.bench.seed_workloads``) into chained
block hashes, as a prompt is hashed when it arrives, and prints the median ns per token and MB/s
of token ids (4 bytes each) over ``--repeats`` runs. corekv: ``PrefixKey(...).block_hashes`` (one
vectorised packing pass, then one digest per block). vLLM: its own
``kv_cache_utils.get_request_block_hasher`` with the hash functions of ``vllm/utils/hashing.py``
(``sha256`` is vLLM's default: sha256 over a pickle of ``(parent, tokens, extra_keys)`` per block),
building the request as ``bench_peers.py`` does. vLLM's files come from ``../shared/peers/extract.sh``
(never committed); without them only corekv's rows are printed.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time

from corekv.bench import seed_workloads
from corekv.hashing import PrefixKey, chain_seed

PEERS_DIR = os.environ.get("PEERS_DIR", os.path.join(
    os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/corekv-peers")), "peers"))


def corekv_hasher(block_size: int, algorithm: str):
    seed = chain_seed("corekv-bench", block_size, algorithm=algorithm)
    return lambda tokens: PrefixKey(tokens, block_size, seed, algorithm).block_hashes


def vllm_hasher(block_size: int, hash_name: str):
    if PEERS_DIR not in sys.path:
        sys.path.insert(0, PEERS_DIR)
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request  # the peers' stub: hashes in __init__ like the real one

    hash_fn = get_hash_fn_by_name(hash_name)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
    return lambda tokens: Request(0, tokens, hasher).block_hashes


def time_once(hash_request, requests) -> float:
    gc.collect()
    gc.freeze()
    try:
        t0 = time.perf_counter()
        for tokens in requests:
            hash_request(tokens)
        return time.perf_counter() - t0
    finally:
        gc.unfreeze()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-sizes", default="16,64")
    args = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its per-process xxhash seed warning
    requests = [r for w in seed_workloads().values() for r in w]
    num_tokens = sum(map(len, requests))
    contenders = []
    for bs in (int(b) for b in args.block_sizes.split(",")):
        contenders += [(f"corekv xxh3_128 b{bs}", corekv_hasher(bs, "xxh3_128")),
                       (f"corekv sha256 b{bs}", corekv_hasher(bs, "sha256"))]
        try:
            for name in ("sha256", "sha256_cbor", "xxhash"):
                contenders.append((f"vllm {name} b{bs}", vllm_hasher(bs, name)))
        except ImportError as e:
            print(f"# vLLM not available from {PEERS_DIR} ({e}); run ../shared/peers/extract.sh")
    times: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for _ in range(args.repeats + 1):          # the first round is a warm-up
        for name, fn in contenders:            # round-robin: load drift hits all alike
            times[name].append(time_once(fn, requests))
    print(f"# {len(requests)} requests, {num_tokens} tokens; median of {args.repeats} runs "
          f"(min in brackets); python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    print(f"{'hasher':24} {'ns/token':>9} {'(min)':>8} {'MB/s':>8}")
    for name, runs in times.items():
        med, low = statistics.median(runs[1:]), min(runs[1:])
        print(f"{name:24} {1e9 * med / num_tokens:9.1f} {1e9 * low / num_tokens:8.1f} "
              f"{4 * num_tokens / med / 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
