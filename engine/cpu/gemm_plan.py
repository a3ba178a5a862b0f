"""Which GEMM a CPU Linear of one shape runs, for a step's few rows and for a prefill's many:
timed on this machine when a model is prepared, once, then read from a cache on disk.

Where GEMMs run fastest depends on the CPU and the libraries more than on anything corekv can
read off the CPU's flags: MKL takes its AVX2 path on AMD CPUs with AVX-512, oneDNN its AVX-512
(and AVX-512 BF16) kernels there; a bfloat16 GEMM beats float32 on a CPU with bfloat16 dot
products only if oneDNN uses them (BENCHMARKS.md, "Linears by shape"). So :func:`gemm_plan` times
the candidates at :data:`FEW_ROWS` and :data:`MANY_ROWS` rows (or the row counts asked for) on the
layer's own weight (or on all of a model's weights of that shape) and keeps the default (the first
candidate) unless another is at least :data:`MARGIN` times faster.

NOTE: the plan is cached (``$COREKV_CACHE_DIR``, default ``~/.cache/corekv``, file
``gemm_plans.json``) under a key of the CPU, torch's capability, the libraries' restrictions,
torch's version, the thread count, dtype and shape (and the native kernels' sources, where they
are a candidate), so that a machine keeps its choice across
starts: its greedy tokens do not change with a timing's noise, and a second start does not time
again. An unwritable cache only means timing every start.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

#: rows timed for a step's few rows (a batch of decodes) and for a prefill's many
FEW_ROWS, MANY_ROWS = 32, 256
#: a candidate replaces the default only when this much faster (timings on a busy machine are noisy)
MARGIN = 1.15
#: each candidate is timed this long at least (after one untimed call), the best call counting
_TIME_BUDGET_S = 0.02
_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def gemm_plan(dtype: torch.dtype, shape: tuple[int, int],
              candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]],
              rows: dict[str, int] | None = None, weights: int = 1, revision: str = "") -> dict[str, str]:
    """``{label: name}``: the candidate (``name -> op(x)``; the first is the default) that runs
    ``x`` of each label's row count (``rows``, default ``{"few": FEW_ROWS, "many": MANY_ROWS}``),
    for a weight of ``shape`` ``(out, in)`` and ``dtype`` (or ``weights`` of them in turn, when
    each op runs on that many); from the cache when it has this machine's plan for them, else
    timed and cached. ``revision`` names the candidates' own code where it can change under the
    same names (corekv's native kernels): a plan timed on other code is timed again."""
    rows = rows or {"few": FEW_ROWS, "many": MANY_ROWS}
    key = _key(dtype, shape, candidates, rows, weights, revision)
    cache = _read_cache()
    plan = cache.get(key)
    if isinstance(plan, dict) and set(plan) == set(rows) and set(plan.values()) <= set(candidates):
        return plan
    plan = {label: _fastest(candidates, torch.randn(count, shape[1]).to(dtype)) for label, count in rows.items()}
    cache[key] = plan
    _write_cache(cache)
    return plan


def cache_path() -> Path:
    """Where plans are cached (see the module's docstring)."""
    root = os.environ.get("COREKV_CACHE_DIR") or Path.home() / ".cache" / "corekv"
    return Path(root) / "gemm_plans.json"


def _fastest(candidates, x) -> str:
    names = list(candidates)
    times = {name: _best_time(candidates[name], x) for name in names}
    best = min(names, key=times.get)
    return best if times[best] * MARGIN < times[names[0]] else names[0]


def _best_time(op, x) -> float:
    op(x)
    best, spent = float("inf"), 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        op(x)
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent >= _TIME_BUDGET_S:
            break
    return best


def _key(dtype, shape, candidates, rows, weights, revision) -> str:
    from corekv.engine.cpu.isa import cpu_info

    info = cpu_info()
    env = ",".join(f"{k}={os.environ[k]}" for k in _ENV if k in os.environ)
    return "|".join([info.vendor, info.model, info.capability, "bf16dot" if info.has_bf16_dot else "", env,
                     f"torch {torch.__version__}", f"{torch.get_num_threads()} threads", str(dtype),
                     f"{shape[0]}x{shape[1]}", "/".join(candidates)]
                    + ([] if set(rows) == {"few", "many"} else ["rows " + ",".join(map(str, rows.values()))])
                    + ([f"{weights} weights"] if weights > 1 else [])
                    + ([f"kernels {revision}"] if revision else []))


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
        os.replace(tmp, path)  # NOTE: whole-file replace, so a reader never sees half a file
    except OSError as exc:
        logger.info("corekv: could not cache GEMM plans in %s (%s); they are timed again next start", path, exc)
