"""corekv's backends as contenders for ../shared/peers/bench_peers.py (vLLM BlockPool, SGLang RadixCache).

    python ../shared/peers/bench_peers.py --scenarios noevict,evict32k --repeats 5 \\
        --contender benchmarks/backends_vs_peers.py:make,backend=radix,block_size=1 \\
        --contender benchmarks/backends_vs_peers.py:make,backend=hash_blocks,block_size=16 \\
        --contender benchmarks/backends_vs_peers.py:make,backend=hash_blocks,block_size=64

Each contender drives the real backend class through the verbs the engine uses, per request:
``prepare`` builds the :class:`~corekv.hashing.PrefixKey` (hashes are computed lazily, on the first
``match``, so hashing time lands in ``lookup`` for ``hash_blocks`` and never happens for the radix
tree, which indexes tokens); ``lookup`` = ``match`` on ``req[:-1]``'s whole blocks + ``acquire``;
``insert`` = ``allocate`` (evicting LRU as needed) + ``cache`` + ``free``. Backends run as an
index-only simulation would (no events kept, radix without hash tracking), like the peers, which run
with KV events off.
"""
from __future__ import annotations

from corekv.bench import make_backend
from corekv.hashing import PrefixKey, chain_seed


class CorekvContender:
    """The bench_peers.py contender protocol over one corekv backend."""

    def __init__(self, capacity_tokens: int, backend: str = "radix", block_size: int | None = None):
        if block_size is None:
            block_size = 1 if backend == "radix" else 16
        self.bs = block_size
        self.backend = make_backend(backend, capacity_tokens // block_size, block_size)
        self.name = f"corekv-{backend}-b{block_size}"
        self.published = "radix" if backend == "radix" and block_size == 1 else (
            f"block{block_size}" if block_size in (16, 64) else None)
        self.namespace = chain_seed("corekv-bench", block_size)

    def prepare(self, tokens: list[int]) -> PrefixKey:
        return PrefixKey(tokens, self.bs, self.namespace)

    def lookup(self, key: PrefixKey) -> tuple[int, list[int]]:
        hit = self.backend.match(key, (len(key.token_ids) - 1) // self.bs)
        self.backend.acquire(hit)
        return len(hit) * self.bs, hit

    def insert(self, key: PrefixKey, hit: list[int]) -> None:
        backend = self.backend
        fresh = backend.allocate(-(-len(key.token_ids) // self.bs) - len(hit))
        if fresh is None:  # the request alone is larger than the pool: not cached
            backend.free(hit)
            return
        table = hit + fresh
        backend.cache(key, table[:key.num_full_blocks])
        backend.free(table)

    def evicted_tokens(self) -> int:
        return self.backend.num_evicted_blocks * self.bs


def make(capacity_tokens: int, backend: str = "radix", block_size: int | None = None) -> CorekvContender:
    return CorekvContender(capacity_tokens, backend, block_size)
