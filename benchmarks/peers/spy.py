"""py-spy profiles of a peer's processes: recording a span of this process and its descendants
(vLLM's engine core and worker), and what the samples add up to, per process and per part.

A sample is one active thread seen at one tick (py-spy leaves idle threads out), so a part's
samples over the rate are the thread-seconds it was running or ready to run: a thread at nice 19
(corekv's offload writer) is sampled while it waits for the CPU that the forward holds, so its
seconds are not CPU seconds (the harness reads those from ``/proc``).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from peers import runner

#: corekv's packages as folders of the checkout (``corekv.tiers`` is ``tiers/``, and so on)
_COREKV = ("corekv", "tiers", "engine", "plugins")
_REPO = Path(__file__).resolve().parents[2]
#: the parts a sample is counted in: the first with a pattern that a frame of its stack holds
#: (py-spy names a file by its path under ``sys.path`` where it can, else by its whole path)
PARTS = (("corekv", tuple(f"({d}/" for d in _COREKV) + tuple(f"({_REPO / d}/" for d in _COREKV)),
         ("lmcache", ("(lmcache/",)), ("model forward", ("(vllm/model_executor/",)), ("scheduler", ("(vllm/v1/core/",)))
#: a process's role, by a frame any of its samples has
ROLES = (("worker", "WorkerProc"), ("engine core", "EngineCoreProc"))
_COUNT = re.compile(r" (\d+)$")


@contextlib.contextmanager
def recording(py_spy: str, out: Path, *, rate: int = 50) -> Iterator[None]:
    """py-spy samples this process and its descendants at ``rate`` Hz (without pausing them)
    while the block runs, and writes the stacks to ``out`` (py-spy's raw format)."""
    cmd = [py_spy, "record", "--pid", str(os.getpid()), "--subprocesses", "--nonblocking", "--rate", str(rate),
           "--format", "raw", "--output", str(out)]
    proc = runner.start(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # NOTE: py-spy attaches to every process of the tree before its first sample
    try:
        yield
    finally:
        runner.stop(proc, grace_s=60, signum=signal.SIGINT)  # SIGINT: py-spy writes what it has


def samples(raw: Path) -> Iterator[tuple[list[str], int]]:
    """(frames root first, count) per line of py-spy's raw output; a process's command line
    that holds newlines continues on the next lines."""
    pending = ""
    with open(raw) as f:
        for line in f:
            pending += line.rstrip("\n")
            m = _COUNT.search(pending)
            if not m:
                pending += "\\n"
                continue
            yield pending[:m.start()].split(";"), int(m.group(1))
            pending = ""


def _pid(frames: list[str]) -> str:
    procs = [f for f in frames if f.startswith("process ")]
    return procs[-1].split(":", 1)[0].removeprefix("process ") if procs else "?"


def shares(raw: Path, *, rate: int = 50, top: int = 8) -> dict[str, dict]:
    """Per process role (worker, engine core, the driver; the main thread of each apart from the
    threads it started): thread-seconds sampled, the seconds
    in each part of :data:`PARTS` (the rest under "other"), and the ``top`` frames of corekv's
    and LMCache's samples (their innermost frame of the connector's own code)."""
    rows = list(samples(raw))
    roles: dict[str, tuple[str, str]] = {}
    for frames, _ in rows:
        for role, marker in ROLES:
            if any(marker in f for f in frames):
                roles.setdefault(_pid(frames), (role, marker))
    out: dict[str, dict] = {}
    for frames, count in rows:
        role, marker = roles.get(_pid(frames), ("driver", ""))
        if not any(marker in f for f in frames):
            role += ", other threads"  # NOTE: a thread the process started (corekv's writer, say)
        row = out.setdefault(role, {"seconds": 0.0, "parts": Counter(), "top": Counter()})
        row["seconds"] += count / rate
        part, own = next(((name, mine) for name, patterns in PARTS
                          if (mine := [f for f in frames if any(p in f for p in patterns)])), ("other", None))
        row["parts"][part] += count / rate
        if part in ("corekv", "lmcache"):
            row["top"][own[-1]] += count / rate
    return {role: {"seconds": row["seconds"], "parts": dict(row["parts"]), "top": row["top"].most_common(top)}
            for role, row in out.items()}
