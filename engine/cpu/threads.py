"""How many threads corekv computes with on a CPU, and how they wait between parallel regions.

:func:`usable_cpus` counts the CPUs this process may run on: its affinity mask
(``taskset``, ``docker --cpuset-cpus``), capped by its cgroup's CPU quota (``docker --cpus``,
Kubernetes limits; cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us``), where
``os.cpu_count()`` would count every CPU of the host. :func:`apply_threads` gives torch (and so
OpenMP, MKL and corekv's native kernels, which share torch's OpenMP runtime) that many threads,
or ``engine.threads`` where it is set.

NOTE: :func:`prefer_passive_wait` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy.
OpenMP's threads otherwise spin for a while at the end of every parallel region, waiting for
their siblings; on a CPU shared with another process (a second worker, a router, a test run) a
spinning thread burns the time slice its descheduled sibling needs, and a request ran 20x slower
(BENCHMARKS.md, "A shared CPU"). OpenMP reads the variable once, when its runtime starts (on
``import torch``), so it is set on ``import corekv``, before torch loads, and taken out of the
environment again when an engine starts (torch has read it by then), so processes started later
inherit the user's environment, not corekv's choice. Where torch was imported first the
process is another's (vLLM's, with corekv's connector in it) or the user's script: the policy is
not set at all, since it could no longer reach this process's OpenMP, only the processes it starts
(vLLM's workers), whose threads are their host's to tune; an engine then logs so once and its
threads keep their spin.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
#: whether torch (so its OpenMP runtime) was loaded before prefer_passive_wait() set the policy
_torch_was_first = False
#: whether OMP_WAIT_POLICY in os.environ is corekv's, not the user's (apply_threads removes it)
_is_policy_ours = False


def prefer_passive_wait() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for an OpenMP runtime that has not started yet, unless the
    user set a policy or libgomp's ``GOMP_SPINCOUNT`` (see the module's docstring)."""
    global _torch_was_first, _is_policy_ours
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        _torch_was_first = "torch" in sys.modules
        if not _torch_was_first:
            _is_policy_ours = True
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def is_passive_wait_corekvs() -> bool:
    """Whether ``OMP_WAIT_POLICY`` in the environment is the one :func:`prefer_passive_wait` set
    (not the user's), until an engine starts and takes it out again."""
    return _is_policy_ours


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by its cgroup's CPU quota (at least 1)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # NOTE: not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def apply_threads(threads: int | None) -> int:
    """Give torch ``threads`` threads, or where ``None`` :func:`usable_cpus` (unless the user set
    ``OMP_NUM_THREADS``, which torch already follows); returns the count in force. Process-wide:
    the last engine started in a process sets it for all."""
    import torch

    global _is_policy_ours
    if _is_policy_ours:
        # NOTE: torch is loaded, so its OpenMP has read the policy: take it out of the environment
        # again, so processes the user starts from here (another engine's benchmark, a vLLM server)
        # get the environment the user set, not corekv's choice for its own process.
        _is_policy_ours = False
        if os.environ.get("OMP_WAIT_POLICY") == "PASSIVE":
            del os.environ["OMP_WAIT_POLICY"]
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        threads = usable_cpus()
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if _torch_was_first:
        _warn_spinning_once()
    return torch.get_num_threads()


def cgroup_cpu_quota(root: Path = _CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (2.5 for 250 ms per 100 ms), or ``None``
    where there is none or it cannot be read; ``root``: where the cgroup file system is mounted."""
    for relative in _cgroup_paths():
        for folder in (root / relative.lstrip("/"), root / "cpu" / relative.lstrip("/"),
                       root / "cpu,cpuacct" / relative.lstrip("/")):
            quota = _read_quota(folder)
            if quota is not None:
                return quota
    return None


def _cgroup_paths() -> list[str]:
    """This process's cgroup paths (v2's and v1's cpu controller), then the root: inside a
    container the mounted hierarchy is often its own root."""
    paths = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                paths.append(path)
    except (OSError, ValueError):
        pass
    return [*paths, "/"]


def _read_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # v1: -1 means no quota
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _warn_spinning_once() -> None:
    global _torch_was_first
    _torch_was_first = False
    logger.info("torch was imported before corekv, so OpenMP's threads spin-wait; on a shared CPU set "
                "OMP_WAIT_POLICY=PASSIVE in the environment (or import corekv first)")
