"""Index-only simulation: how many prompt tokens a backend would hit, without a model.

``hit_rate`` drives a real backend, built through the plugin manager, with the engine's own
admission (:func:`corekv.backend.admit`: match, acquire, allocate, cache) and ``free``, on
token-id requests. ``seed_workloads`` regenerates the four
synthetic workloads of the prefix-cache seed chapter (same ``random.seed(0)`` call order), on which
``hit_rate_table`` reproduces the chapter's table. Importing this module needs no torch.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from corekv.backend import PrefixCacheBackend, admit
from corekv.hashing import PrefixKey, chain_seed

#: (column label, backend name, block size) of the seed table
TABLE_COLUMNS = (("radix", "radix", 1), ("blocks 16", "hash_blocks", 16), ("blocks 64", "hash_blocks", 64))
WORKLOAD_NAMES = ("shared_system", "multi_turn", "few_shot", "parallel")

# NOTE: index-only runs never read block hashes: a backend that declares these options (the
# radix tree's track_hashes, every builtin's record_events) then never hashes or keeps events
# nobody drains. Options a backend does not declare are not passed.
_SIMULATION_OPTIONS = {"track_hashes": False, "record_events": False}


def seed_workloads() -> dict[str, list[list[int]]]:
    """The seed chapter's four workloads, token ids drawn in its exact order from ``random.seed(0)``.

    The global ``random`` state is saved and restored, so calling this has no side effect.
    """
    state = random.getstate()
    try:
        random.seed(0)
        draw = lambda n: [random.randrange(1000, 50000) for _ in range(n)]  # noqa: E731
        system = draw(1000)
        shared_system = [system + draw(random.randint(20, 200)) for _ in range(100)]
        multi_turn = []
        for _ in range(20):                 # 20 conversations of 8 turns
            history = draw(300)
            for _ in range(8):
                history = history + draw(random.randint(10, 60))     # the user's message
                multi_turn.append(list(history))
                history = history + draw(random.randint(50, 300))    # the model's answer
        examples = [draw(random.randint(100, 200)) for _ in range(5)]
        header = draw(37)
        few_shot = []
        for _ in range(100):
            shots = [t for example in examples[:random.randint(2, 5)] for t in example]
            few_shot.append(header + shots + draw(random.randint(20, 80)))
        parallel = []
        for _ in range(30):                 # 30 problems, 8 samples each
            problem = draw(random.randint(80, 400))
            parallel += [problem + draw(1) for _ in range(8)]
    finally:
        random.setstate(state)
    return dict(zip(WORKLOAD_NAMES, (shared_system, multi_turn, few_shot, parallel)))


def make_backend(backend: str | Callable[..., PrefixCacheBackend], num_blocks: int,
                 block_size: int, eviction: str | None = None) -> PrefixCacheBackend:
    """Build a backend by the name a plugin registers it under (builtin or third-party, through
    the plugin manager like the engine does) or from a factory.

    :param eviction: a registered eviction policy's name, for a backend that declares an
        ``eviction`` option (a factory gets it as ``eviction=``); ``None``: the backend's default.
    """
    if callable(backend):
        return backend(num_blocks, block_size, **({} if eviction is None else {"eviction": eviction}))
    from corekv.eviction import resolve_policy_options
    from corekv.plugin import make_plugin_manager
    manager = make_plugin_manager()
    specs = manager.backends()
    if backend not in specs:
        raise ValueError(f"backend {backend!r} is not registered; expected one of {sorted(specs)} "
                         "(install or list the plugin that provides it)")
    spec = specs[backend]
    options = {k: v for k, v in _SIMULATION_OPTIONS.items() if k in spec.options}
    if eviction is not None:
        if "eviction" not in spec.options:
            raise ValueError(f"backend {backend!r} takes no eviction policy (it declares no "
                             "'eviction' option); leave eviction out for it")
        options = resolve_policy_options(spec.options, {**options, "eviction": eviction}, manager)
    return spec.factory(num_blocks, block_size, **options)


def hit_rate(requests: Sequence[Sequence[int]], backend: str | Callable[..., PrefixCacheBackend] = "radix",
             block_size: int = 16, capacity: int | None = None, eviction: str | None = None) -> float:
    """Fraction of all request tokens served from the cache, requests processed in order.

    For each request: hits += the cached prefix of ``req[:-1]`` (whole blocks: the last token is
    always computed), total += ``len(req)``; then the whole request is inserted as the engine would
    (acquire the hit, allocate the rest, cache the full blocks, free). A request that cannot get
    its blocks even after evicting is counted but not inserted.

    :param backend: ``"radix"``, ``"hash_blocks"``, another registered name, or a factory
        ``(num_blocks, block_size) -> PrefixCacheBackend``.
    :param capacity: device pool size in tokens (``capacity // block_size`` blocks);
        ``None``: room for every request, so nothing is ever evicted.
    :param eviction: the backend's eviction policy by name (``"lfu"``); ``None``: its default (LRU).
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a list of token-id lists, got {type(requests).__name__}")
    for i, req in enumerate(requests):
        if isinstance(req, (str, bytes)) or not isinstance(req, Sequence) or not req:
            raise ValueError(f"requests[{i}] must be a non-empty list of token ids, got {req!r:.60}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if capacity is None:
        num_blocks = max(1, sum(-(-len(r) // block_size) for r in requests))
    elif not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < block_size:
        raise ValueError(f"capacity must be None or an int number of tokens >= block_size "
                         f"({block_size}), got {capacity!r}")
    else:
        num_blocks = capacity // block_size
    cache = make_backend(backend, num_blocks, block_size, eviction)
    namespace = chain_seed("corekv-bench", block_size)
    hits = total = 0
    for req in requests:
        key = PrefixKey(req, block_size, namespace)
        admission = admit(cache, key, len(req), cache=True)
        if admission is None:  # refused, and nothing changed: its hit still counts
            num_hit_blocks = len(cache.match(key, max_blocks=(len(req) - 1) // block_size))
        else:
            num_hit_blocks = len(admission.hit)
            cache.free(admission.table)
        hits += num_hit_blocks * block_size
        total += len(req)
    return hits / total if total else 0.0


def hit_rate_table(workloads: Mapping[str, Sequence[Sequence[int]]] | None = None,
                   capacity: int | None = None, eviction: str | None = None) -> list[dict[str, object]]:
    """One row per workload: ``{"workload": name, "radix": r, "blocks 16": b16, "blocks 64": b64}``
    (fractions), the radix tree at token granularity (page 1). Defaults to ``seed_workloads()``.
    With ``eviction`` (a policy's name) every backend evicts by it and each row also has
    ``"eviction": eviction``."""
    workloads = seed_workloads() if workloads is None else workloads
    policy = {} if eviction is None else {"eviction": eviction}
    return [
        {"workload": name, **policy, **{label: hit_rate(reqs, backend, size, capacity, eviction)
                                        for label, backend, size in TABLE_COLUMNS}}
        for name, reqs in workloads.items()
    ]


def row_label(row: Mapping[str, object]) -> str:
    """A row's name in tables and plots: the workload, with its eviction policy when it has one."""
    return f"{row['workload']} ({row['eviction']})" if "eviction" in row else str(row["workload"])


def format_table(rows: Sequence[Mapping[str, object]]) -> str:
    """The table as text, percentages with one decimal (like the seed chapter)."""
    if not rows:
        return ""
    labels = [k for k in rows[0] if k not in ("workload", "eviction")]
    width = max(len("workload"), *(len(row_label(r)) for r in rows))
    lines = [f"{'workload':<{width}}" + "".join(f"{label:>11}" for label in labels)]
    for row in rows:
        lines.append(f"{row_label(row):<{width}}" + "".join(f"{row[label]:>11.1%}" for label in labels))
    return "\n".join(lines)
