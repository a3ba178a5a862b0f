"""``corekv serve`` and ``corekv route`` processes for the benchmarks that run a fleet on one box
(``routing.py``, ``fleet.py``): started with their output in a log, waited on until healthy,
stopped, and the tests' tiny model saved as a folder a server can load."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx


def start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``corekv ARGS`` in a process of its own, its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "corekv.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def stop(processes: list[subprocess.Popen]) -> None:
    """Terminate ``processes``, killing any that has not exited within a minute."""
    for p in processes:
        p.terminate()
    for p in processes:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until ``url``'s ``/health`` answers 200; raises if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} was not healthy within {timeout_s:.0f} s")


def tiny_model_folder(folder: Path) -> str:
    """The tests' tiny random Llama saved under ``folder / "tiny"`` (for ``--tiny`` runs)."""
    from corekv.engine.tiny_model import make_tiny_llama

    tiny = make_tiny_llama()
    path = str(folder / "tiny")
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path
