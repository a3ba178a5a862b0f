"""What this CPU offers corekv's CPU kernels: vendor, model, torch's CPU capability and the
instruction-set features the kernels' choices depend on (:mod:`~corekv.engine.cpu.native` picks its
instruction set here, :mod:`~corekv.engine.cpu.linears` its GEMMs, ``benchmarks/cpu_kernels.py``
reports it).

corekv follows torch's capability (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``,
``AVX2``, ``DEFAULT``, ...), which torch's kernels and inductor use and ``ATEN_CPU_CAPABILITY``
lowers: with ``ATEN_CPU_CAPABILITY=avx2`` corekv's choices are an AVX2 machine's. MKL and oneDNN
read their own variables, so an AVX2 machine is reproduced on an AVX-512 one with all three
(:data:`RESTRICT_ENV`, set before the process starts).
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

#: the environment that makes torch, inductor, MKL, oneDNN and corekv's kernels act as on a CPU of
#: the named instruction set (``benchmarks/cpu_kernels.py --isa``, ``benchmarks/engine_w1_w2.py --isa``)
RESTRICT_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                         "ONEDNN_MAX_CPU_ISA": "AVX2"}}
#: native instruction sets (kernels.h) torch's capability lets corekv run, widest first
_CAPABILITY_TO_ISAS = {"AVX512": ("avx512", "avx2"), "AVX2": ("avx2",)}


@dataclass(frozen=True)
class CpuInfo:
    """This CPU as the kernels see it. ``flags`` are the kernel's (``/proc/cpuinfo``; empty where
    there is none) less what torch's capability masks: no ``avx512*`` or ``amx*`` flag below
    ``AVX512``, so a restricted process chooses as the smaller CPU would."""

    vendor: str        #: ``GenuineIntel``, ``AuthenticAMD``, ... ("" where unknown)
    model: str         #: the model name ("" where unknown)
    capability: str    #: torch's CPU capability
    flags: frozenset[str]

    @property
    def has_bf16_dot(self) -> bool:
        """Whether bfloat16 dot products run natively (AVX-512 BF16 or AMX): bfloat16 GEMMs then
        do twice float32's multiply-adds per instruction or more, instead of being upcast."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def describe(self) -> str:
        """One line for a benchmark's header: ``AMD EPYC (AuthenticAMD), torch AVX512, avx512_bf16``."""
        extras = sorted(f for f in self.flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))
        return f"{self.model or platform.processor() or '?'} ({self.vendor or '?'}), torch {self.capability}, " + \
            " ".join(extras)


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This process's :class:`CpuInfo` (read once)."""
    vendor = model = ""
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and not vendor:
            vendor = value
        elif key == "model name" and not model:
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return CpuInfo(vendor, model, capability, frozenset(flags))


def native_isa(built: list[str]) -> str | None:
    """The instruction set of the native kernels to run: the first of ``built`` (the build's sets
    this CPU runs, widest first) that torch's capability allows; ``generic`` (not x86) always."""
    allowed = _CAPABILITY_TO_ISAS.get(torch.backends.cpu.get_cpu_capability(), ()) + ("generic",)
    return next((isa for isa in built if isa in allowed), None)
