"""corekv's native CPU kernels (``engine.compile``), built from ``paged_attention.cpp`` and
``small_linear.cpp``.

Two attention kernels read K/V straight from the pool blocks through block tables, one C++ call per
layer each, where the torch path copies the blocks into contiguous buffers and calls SDPA:

* ``paged_decode``: each decoding row's query over its context (a decode step of a small model is
  made of such per-layer ops and bytes on a CPU);
* ``paged_prefill``: every prefill chunk of the step, causally over its sequence's blocks: no
  gather, no mask tensor, no merge of a shared prefix's and a chunk's own parts.

and ``small_linear`` multiplies a decode step's few rows by a float32 or bfloat16 weight packed into
panels (:mod:`corekv.engine.cpu.linears` wires it into the model's Linear layers).

NOTE: compiled with -ffast-math, because a vectorised exp and reordered sums are what make the
kernels fast (a strict build is much slower: BENCHMARKS.md, "Native decode attention"); that is
sound for finite inputs, as a model's Q/K/V are. It is passed as compile flags only, so no code
that changes the process's floating-point mode (flush-to-zero) is linked in.

Built on first use by ``torch.utils.cpp_extension`` (g++ and ninja; tens of seconds on a small
machine) with ``-march=native`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``), which then
serves later processes at once; a cache shared by machines of different CPUs must be set per machine.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from corekv.errors import CoreKVError, describe_exception

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "small_linear.cpp")]
#: pool dtypes the kernels read (a float16 model keeps the torch path)
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_kernels: NativeKernels | None = None


class NativeKernels(NamedTuple):
    """The built kernels (signatures in the sources' headers)."""

    #: ``(q [R, H, G, D], k_pool, v_pool, block_tables, context_lens, scale) -> (out, lse)`` (float32)
    decode: Callable
    #: ``(q [T, H * G, D], k_pool, v_pool, block_tables, query_starts, start_pos, scale, out) -> None``
    prefill: Callable
    #: ``(weight [out, in] float32 or bfloat16) -> packed [out / 64, in, 64]`` (the same dtype)
    pack_linear_weight: Callable
    #: ``(x [rows, in], packed, bias | None) -> [rows, out]``, all of the packed weight's dtype
    small_linear: Callable


class NativeBuildError(CoreKVError):
    """The native attention could not be built (no C++ compiler, no ninja, a failed build)."""


def load_native_attention() -> NativeKernels:
    """The kernels, built once per process (see the module's docstring); raises :class:`NativeBuildError`."""
    global _kernels
    if _kernels is None:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:
            try:  # the `ninja` wheel's binary sits beside the venv's python, which may not be on PATH
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
        try:
            module = cpp_extension.load(name="corekv_native", sources=[str(path) for path in SOURCES],
                                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                                        extra_ldflags=["-fopenmp"])
        except Exception as exc:  # compiler, ninja and build failures come as several exception types
            raise NativeBuildError(
                f"could not build corekv's native kernels ({describe_exception(exc)}); it needs a "
                "C++ compiler (g++, or the one named by $CXX) and ninja (pip install ninja)") from exc
        _kernels = NativeKernels(module.paged_decode, module.paged_prefill, module.pack_linear_weight,
                                 module.small_linear)
    return _kernels
