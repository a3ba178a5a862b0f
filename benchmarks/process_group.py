"""Child processes that take their descendants with them, for the benchmarks that run vLLM.

vLLM's engine core and worker outlive a parent killed by a signal: they are reparented to init and
the worker keeps spinning on a core, which skews every later measurement on the machine. So a child
starts in a process group of its own, the group is killed when the child is done with (whatever
the child left running), and SIGTERM unwinds the driver like Ctrl-C so its ``finally`` blocks run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def start(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` in a new process group (see :func:`kill`); also makes
    SIGTERM exit this process through its ``finally`` blocks."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return subprocess.Popen(cmd, start_new_session=True, **kwargs)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of ``proc``'s process group (nothing where every process exited)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
