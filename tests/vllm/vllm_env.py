"""The environment a vLLM CPU process needs here, for the tests: the benchmarks' peer runner's
(``benchmarks/peers/runner.py``), so tests and benchmarks start vLLM alike."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # after the tests' own folders
from peers.runner import peer_env  # noqa: E402


def vllm_env(scratch: Path, **extra: str) -> dict[str, str]:
    """``os.environ`` plus what vLLM's CPU build wants: tcmalloc and Intel OpenMP preloaded (the
    latter ships in the venv), a small KV space, threads bound to this machine's cores, offline
    hubs, and caches under ``scratch``."""
    return peer_env(sys.executable, scratch=scratch, **extra)
