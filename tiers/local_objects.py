"""Block objects on a local disk, read and written so that nothing at an entry's path can hang,
flood or litter the process: the fsspec tier's local case (``file://``) and its admin view.

* :func:`read_regular_file`: an entry path may hold anything a local user put there — a FIFO (a
  plain read blocks forever), a symlink to ``/dev/zero`` (reads without end), a 3 GiB sparse
  file (read whole before a size check) — so the final name is not followed, the open does not
  block, and only a regular file no larger than the entry (by ``fstat``, before any read) is read.
* :func:`write_aside`: an object is written under a temporary name and renamed into place (a
  reader or a crash never sees half an entry); a failed write (a full disk) removes its
  temporary object at once.
* :func:`sweep_temporary`: what a killed writer left behind, removed by ``corekv store clear``
  and ``verify`` once it is older than any write in progress can be.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import uuid
from collections.abc import Iterable

__all__ = ["TMP_MARK", "TMP_MAX_AGE_S", "read_regular_file", "write_aside", "sweep_temporary",
           "is_temporary"]

#: a writer's temporary object is ``<name>.tmp-<uuid>`` beside the object it becomes
TMP_MARK = ".tmp-"
#: a temporary object this old is a failed write's leftover, not a write in progress (an entry
#: is written in well under a second; a whole minute is already a stalled disk)
TMP_MAX_AGE_S = 600


def read_regular_file(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, which must hold at most ``max_bytes``.

    :raises FileNotFoundError: nothing at ``path``.
    :raises OSError: a symlink (``ELOOP``), not a regular file (``EINVAL``), or larger than
        ``max_bytes`` (``EFBIG``): none of them is read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than an entry's {max_bytes}", path)
        chunks, remaining = [], info.st_size
        while remaining > 0:  # NOTE: a regular file never blocks; a shrinking one ends early
            chunk = os.read(fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_aside(path: str, parts: Iterable[bytes]) -> None:
    """Write ``parts`` to ``path`` through a temporary object renamed into place; on any failure
    the temporary object is removed and the error raised."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as file:
            for part in parts:
                file.write(part)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_temporary(path: str) -> bool:
    """True for a writer's temporary object (readers and listings skip them)."""
    return TMP_MARK in path.rsplit("/", 1)[-1]


def sweep_temporary(root: str, *, max_age_s: float = TMP_MAX_AGE_S) -> int:
    """Remove temporary objects under ``root`` older than ``max_age_s``; returns how many."""
    num_removed, now = 0, time.time()
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not is_temporary(path):
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - os.lstat(path).st_mtime > max_age_s:
                    os.unlink(path)
                    num_removed += 1
    return num_removed
