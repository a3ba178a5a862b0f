"""corekv's native CPU kernels (``engine.cpu_kernels``, on by default), built from ``paged_attention.cpp``,
``small_linear.cpp`` and the kernels' code for each instruction set (``kernels_isa.h``).

Two attention kernels read K/V straight from the pool blocks through block tables, one C++ call per
layer each, where the torch path copies the blocks into contiguous buffers and calls SDPA:

* ``paged_decode``: each decoding row's query over its context (a decode step of a small model is
  made of such per-layer ops and bytes on a CPU);
* ``paged_prefill``: every prefill chunk of the step, causally over its sequence's blocks: no
  gather, no mask tensor, no merge of a shared prefix's and a chunk's own parts.

``small_linear`` multiplies a decode step's few rows by a float32 or bfloat16 weight packed into
panels (:mod:`corekv.engine.cpu.linears` wires it into the model's Linear layers), and ``rms_norm``,
``silu_mul`` and ``rotary`` are a Llama decoder layer's elementwise ops in one pass each
(:mod:`corekv.engine.cpu.elementwise` wires them in).

NOTE: compiled with -ffast-math, because a vectorised exp and reordered sums are what make the
kernels fast (a strict build is much slower: BENCHMARKS.md, "Native decode attention"); that is
sound for finite inputs, as a model's Q/K/V are. It is passed as compile flags only, so no code
that changes the process's floating-point mode (flush-to-zero) is linked in.

One build holds the kernels for several instruction sets and the CPU chooses at run time: on x86-64
with GCC, AVX-512 and AVX2 + FMA code (``isa_avx512.cpp``, ``isa_avx2.cpp``), each with the register
blocking of its own register file; the rest of the build targets the baseline x86-64, so the same
build runs on every x86-64 CPU with AVX2 (within the AVX-512 code, a bfloat16 prefill's scores use
AVX-512 BF16's pair dot products where the CPU has them, checked at run time). Elsewhere (another
architecture, or another compiler) one ``generic`` set, built with ``-march=native`` for the building machine. :func:`load_native_attention`
gives the widest set both this CPU and torch's ``ATEN_CPU_CAPABILITY`` allow
(:func:`corekv.engine.cpu.isa.native_isa`), or the one named (a test runs the AVX2 code on an
AVX-512 machine that way).

Built on first use by ``torch.utils.cpp_extension`` (g++ and ninja; minutes on a small machine,
announced on a terminal) into a folder of torch's extension cache (``TORCH_EXTENSIONS_DIR``) named
by a digest of what the build depends on (:func:`build_key`), which then serves later processes at
once. NOTE: keyed, not named ``corekv_native`` alone: two checkouts or venvs (another torch or
python, other sources or the same ones in another folder) would otherwise rebuild each other's
kernels, wait on each other's build lock and load whichever build the other made; processes of
one environment share one build.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from corekv.engine import progress
from corekv.errors import CoreKVError, describe_exception

SOURCES = [Path(__file__).with_name(name) for name in
           ("paged_attention.cpp", "small_linear.cpp", "elementwise.cpp", "isa_avx512.cpp", "isa_avx2.cpp",
            "isa_generic.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("kernels.h", "kernels_isa.h")]
#: pool dtypes the kernels read (a float16 model keeps the torch path)
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
#: the built extension module (its submodules: one per instruction set this CPU runs)
_module = None
#: the kernels of each instruction set asked for, by name
_kernels: dict[str, NativeKernels] = {}
_warned = False  # wants_native_kernels logged a failed build
#: why the build failed in this process: not tried again (it would fail the same way, in seconds)
_build_error: NativeBuildError | None = None
logger = logging.getLogger(__name__)


class NativeKernels(NamedTuple):
    """The built kernels (signatures in the sources' headers)."""

    #: ``(q [R, H, G, D], k_pool, v_pool, block_tables, context_lens, scale) -> (out, lse)`` (float32)
    decode: Callable
    #: ``(q [T, H * G, D], k_pool, v_pool, block_tables, query_starts, start_pos, scale, out) -> None``
    prefill: Callable
    #: ``(weight [out, in] float32 or bfloat16, out a multiple of 64) -> packed [out / P, in, P]`` (the
    #: same dtype; P, the panel width, is the instruction set's: 64 for AVX-512, 16 for AVX2)
    pack_linear_weight: Callable
    #: ``(x [rows, in], packed, bias | None) -> [rows, out]``, all of the packed weight's dtype
    small_linear: Callable
    #: ``(x [..., n], weight [n], eps) -> out`` (LlamaRMSNorm; n a multiple of 16)
    rms_norm: Callable
    #: ``(gate, up) -> silu(gate) * up`` (LlamaMLP's activation; a multiple of 16 values)
    silu_mul: Callable
    #: ``(x [1, heads, tokens, D], cos [1, tokens, D], sin) -> x rotated`` (apply_rotary_pos_emb's
    #: rotate_half form for one of q and k; D a multiple of 32)
    rotary: Callable
    #: the instruction set whose code they run: ``avx512``, ``avx2`` or ``generic``
    isa: str
    #: a digest of the sources they were built from (plans timed on other code are timed again)
    revision: str


class NativeBuildError(CoreKVError):
    """The native kernels could not be built (no C++ compiler, no ninja, a failed build) or have no
    code this CPU runs."""


def load_native_attention(isa: str | None = None) -> NativeKernels:
    """The kernels of instruction set ``isa`` (default: the widest this CPU and torch allow), built
    once per process (see the module's docstring); raises :class:`NativeBuildError`, also for an
    ``isa`` this build or this CPU does not have."""
    module = _build()
    built = built_isas()
    if isa is None:
        from corekv.engine.cpu.isa import native_isa

        isa = native_isa(built)
        if isa is None:
            raise NativeBuildError(f"corekv's native kernels run {built or 'no instruction set'} on this CPU, and "
                                   f"torch's CPU capability ({torch.backends.cpu.get_cpu_capability()}) allows none")
    if isa not in built:
        raise NativeBuildError(f"corekv's native kernels for {isa!r}: this build and CPU run {built}; pick one of them")
    if isa not in _kernels:
        sub = getattr(module, isa)
        _kernels[isa] = NativeKernels(sub.paged_decode, sub.paged_prefill, sub.pack_linear_weight, sub.small_linear,
                                      sub.rms_norm, sub.silu_mul, sub.rotary, isa, _revision())
    return _kernels[isa]


def wants_native_kernels(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a runner on ``device`` for ``dtype`` takes the native kernels under
    ``engine.cpu_kernels`` = ``setting`` (``auto``, ``native``, ``torch``); builds them to know.
    Raises :class:`NativeBuildError` for ``native`` where they cannot be built; ``auto`` logs why
    once and answers False (the torch path serves)."""
    if setting == "torch" or device.type != "cpu" or dtype not in NATIVE_DTYPES:
        return False
    try:
        load_native_attention()
    except NativeBuildError as exc:
        if setting == "native":
            raise
        global _warned
        if not _warned:
            _warned = True
            logger.warning("%s; serving on the torch path (engine.cpu_kernels: torch skips the build)", exc)
        return False
    return True


def built_isas() -> list[str]:
    """The instruction sets the built kernels have code for and this CPU runs, widest first (builds
    the kernels first if this process has not; raises :class:`NativeBuildError`)."""
    return list(_build().isas())


def _source_folders() -> list[str]:
    """The folders the build's compile commands name the sources by."""
    return sorted({os.path.abspath(path.parent) for path in SOURCES})


def _revision() -> str:
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_key() -> str:
    """A digest of what the kernels' build depends on: the sources and where they are, the
    compile flags, the compiler named by ``$CXX``, the machine, python's and torch's versions and
    where torch is installed.

    NOTE: the folders too, not the versions and contents alone: the build's compile commands name
    torch's include folder and each source file's path, and ninja rebuilds everything when a
    command changes, so two venvs with the same torch version in one folder rebuilt each other's
    kernels on every switch, and so did copies of one checkout (snapshots for benchmarks, CI
    folders) started with one venv: nine builds of one folder in an hour, starts of 1-5 minutes
    (BENCHMARKS.md, "Start-up")."""
    digest = hashlib.sha256()
    for part in (_revision(), *_source_folders(), *_cflags(), os.environ.get("CXX", ""),
                 platform.machine(), sys.version, sys.abiflags, torch.__version__, os.path.dirname(torch.__file__)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build_directory() -> Path:
    """Where this environment's build of the kernels lives (see the module's docstring)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"corekv_native-{build_key()}"


def _cflags() -> list[str]:
    # NOTE: no -march on x86-64: the ISA files choose their targets, the rest stays baseline
    march = [] if platform.machine().lower() in ("x86_64", "amd64") else ["-march=native"]
    return ["-O3", "-fopenmp", "-ffast-math", *march]


def _build():
    global _module, _build_error
    if _build_error is not None:
        raise _build_error
    if _module is None:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:
            try:  # the `ninja` wheel's binary sits beside the venv's python, which may not be on PATH
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
        folder = build_directory()
        is_built = (folder / "corekv_native.so").is_file()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with (contextlib.nullcontext() if is_built else progress.phase(
                    "building corekv's native kernels (once per environment; a minute, more on a busy machine)")):
                _module = cpp_extension.load(name="corekv_native", sources=[str(path) for path in SOURCES],
                                             extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                                             build_directory=str(folder))
        except Exception as exc:  # compiler, ninja and build failures come as several exception types
            _build_error = NativeBuildError(
                f"could not build corekv's native kernels ({describe_exception(exc)}); it needs a "
                "C++ compiler (g++, or the one named by $CXX) and ninja (pip install ninja)")
            raise _build_error from exc
    return _module
