"""Keep glibc's malloc from handing a step's activation buffers back to the OS.

A prefill step on CPU allocates and frees the same multi-MB activations (a 1,024-token MLP
output is 6 MB in float32) in every layer. glibc serves blocks that large with ``mmap`` and
returns them with ``munmap`` (or trims the heap top), so every layer page-faults its buffers in
again. :func:`tune_glibc_malloc` sets fixed thresholds once per process so freed buffers stay in
the heap and are reused.

NOTE: both thresholds must be set. Setting either one turns off glibc's dynamic adjustment of the
other, and either one alone is slower than glibc's defaults; only both together are faster
(BENCHMARKS.md, "glibc malloc thresholds"). The same settings are available without code as
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...``.
"""
from __future__ import annotations

import ctypes
import logging
import platform
import sys

logger = logging.getLogger(__name__)

#: mallopt parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (larger blocks are still mmapped)
MMAP_THRESHOLD = 32 * 2**20
#: free memory at the heap top kept instead of trimmed back to the OS
TRIM_THRESHOLD = 256 * 2**20

_applied = False


def tune_glibc_malloc() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); returns whether they are set.

    Returns False, changing nothing, where the C library is not glibc (macOS, musl) or ``mallopt``
    refuses a value.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.warning("glibc mallopt refused the mmap/trim thresholds; CPU steps keep glibc's defaults")
        return False
    _applied = True
    return True
