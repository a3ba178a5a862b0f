"""``tune_glibc_malloc``: freed multi-MB buffers stay in the heap instead of being faulted in again.

Checked on the real glibc through the process's minor page faults, each case in a fresh Python.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from corekv.config import load_config
from corekv.errors import ConfigError

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")

# A prefill layer's pattern: several activations of a few MB alive at once, then all freed.
_CHILD = """
import ctypes, json, resource, sys
from corekv.engine.cpu.malloc import tune_glibc_malloc
applied = tune_glibc_malloc() if sys.argv[1] == "tuned" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 6 << 20
def layer():
    blocks = [libc.malloc(size) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
layer()  # the first layer faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    layer()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_tuned_malloc_reuses_freed_buffers_where_glibc_defaults_fault_them_in_again():
    tuned, default = _faults("tuned"), _faults("default")
    pages = 4 * 3 * (6 << 20) // 4096  # what faulting every page of every later layer would cost
    assert tuned["applied"] is True
    assert tuned["faults"] < pages // 20, tuned
    assert default["faults"] > pages // 2, default  # the defaults do fault: the test can tell them apart


def test_tune_cpu_malloc_is_a_validated_engine_switch():
    assert load_config({"engine": {"tune_cpu_malloc": False}}).engine.tune_cpu_malloc is False
    with pytest.raises(ConfigError, match="engine.tune_cpu_malloc"):
        load_config({"engine": {"tune_cpu_malloc": "sometimes"}})
