"""One line per slow start-up phase (reading a model, converting it, building the native kernels)
on stderr, so a first start that takes minutes does not look hung.

A phase prints ``corekv: <what> ...`` when it starts and ``done in 12.3 s`` when it ends, on a
terminal only: output piped to a file or read by a test stays clean. ``COREKV_QUIET=1`` (the CLI's
``--quiet``) turns the lines off; off a terminal each phase is still logged (INFO) with its time.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

logger = logging.getLogger("corekv.progress")


def is_shown() -> bool:
    """Whether phases are printed: stderr is a terminal and ``COREKV_QUIET`` is not set."""
    if os.environ.get("COREKV_QUIET", "") not in ("", "0"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # NOTE: a replaced or closed stderr
        return False


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Announce ``what`` on stderr (a terminal only) and, when it ends, how long it took."""
    shown = is_shown()
    if shown:
        print(f"corekv: {what} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        if shown:
            print(" failed", file=sys.stderr, flush=True)
        raise
    elapsed = time.perf_counter() - start
    if shown:
        print(f" done in {elapsed:.1f} s", file=sys.stderr, flush=True)
    logger.info("%s: %.1f s", what, elapsed)
