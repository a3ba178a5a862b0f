"""The environment a vLLM CPU process needs here, for tests and benchmarks."""
from __future__ import annotations

import os
import sys
from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def vllm_env(scratch: Path, **extra: str) -> dict[str, str]:
    """``os.environ`` plus what vLLM's CPU build wants: tcmalloc and Intel OpenMP preloaded (the
    latter ships in the venv), a small KV space, threads bound to this machine's cores, offline
    hubs, and caches under ``scratch``."""
    venv_lib = Path(sys.prefix) / "lib"
    preload = [p for p in (TCMALLOC, str(venv_lib / "libiomp5.so")) if os.path.exists(p)]
    env = dict(os.environ)
    env.update({
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "vllm-cache" / "inductor"),
        "COREKV_DISABLE_PLUGIN_AUTOLOAD": "1",
        "TMPDIR": str(scratch / "tmp"),  # vLLM's ZMQ socket files
    })
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(extra)
    return env
