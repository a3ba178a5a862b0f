"""corekv's native CPU decode attention (``engine.compile``), built from ``paged_decode.cpp``.

Each decoding row's query attends its KV read straight from the pool blocks in one C++ call per
layer, where the torch path copies the blocks into a contiguous buffer and calls SDPA: fewer ops
and bytes per layer, which is what a decode step of a small model is made of on a CPU.

NOTE: compiled with -ffast-math (vectorised exp, reordered sums: 0.6x the time of a strict build
here) for finite inputs, as a model's Q/K/V are; only compile flags, so no code that changes the
process's floating-point mode (flush-to-zero) is linked in.

Built on first use by ``torch.utils.cpp_extension`` (g++ and ninja; about 25 s on 2 cores)
with ``-march=native`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``), which then serves
later processes at once; a cache shared by machines of different CPUs must be set per machine.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from corekv.errors import CoreKVError, describe_exception

SOURCE = Path(__file__).with_name("paged_decode.cpp")
#: pool dtypes the kernel reads (a float16 model keeps the torch path)
NATIVE_DECODE_DTYPES = (torch.float32, torch.bfloat16)
_decode: Callable | None = None


class NativeBuildError(CoreKVError):
    """The native decode attention could not be built (no C++ compiler, no ninja, a failed build)."""


def load_paged_decode() -> Callable:
    """``paged_decode(q, k_pool, v_pool, block_tables, context_lens, scale) -> (out, lse)`` (see the
    source's header), building it once per process; raises :class:`NativeBuildError`."""
    global _decode
    if _decode is None:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:
            try:  # the `ninja` wheel's binary sits beside the venv's python, which may not be on PATH
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
        try:
            module = cpp_extension.load(name="corekv_paged_decode", sources=[str(SOURCE)],
                                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                                        extra_ldflags=["-fopenmp"])
        except Exception as exc:  # compiler, ninja and build failures come as several exception types
            raise NativeBuildError(
                f"could not build corekv's native decode attention ({describe_exception(exc)}); it needs a "
                "C++ compiler (g++, or the one named by $CXX) and ninja (pip install ninja)") from exc
        _decode = module.paged_decode
    return _decode
