"""Thread settings: the CPUs a process may use (affinity, cgroup quota), ``engine.threads``, and
OpenMP's passive wait set on ``import corekv`` (checked in fresh processes, where OpenMP starts)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from corekv.engine.cpu.threads import cgroup_cpu_quota, usable_cpus

#: a fresh process's OpenMP settings as libgomp itself reports them when it starts
_SHOW_OPENMP = {"OMP_DISPLAY_ENV": "VERBOSE"}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**base, **env})


def spin_count(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    return line.split("=")[1].strip().strip("'")


def test_usable_cpus_is_the_affinity_at_most():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("content, expected", [("250000 100000", 2.5), ("max 100000", None), ("garbage", None)])
def test_cgroup_v2_quota_is_read_in_cpus(tmp_path, content, expected):
    (tmp_path / "cpu.max").write_text(content + "\n")
    assert cgroup_cpu_quota(tmp_path) == expected


def test_cgroup_v1_quota_is_read_in_cpus_and_minus_one_is_none(tmp_path):
    folder = tmp_path / "cpu"
    folder.mkdir()
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    (folder / "cpu.cfs_quota_us").write_text("150000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None


def test_import_corekv_before_torch_makes_openmp_wait_passively():
    """libgomp spins 300000 times at each barrier by default; corekv's passive wait is a spin
    count of 0, in force only when corekv is imported before torch starts OpenMP."""
    first = run_python("import corekv, torch; torch.ones(2).sum()", **_SHOW_OPENMP)
    assert spin_count(first.stderr) == "0", first.stderr[-2000:]
    late = run_python("import torch, corekv; torch.ones(2).sum()", **_SHOW_OPENMP)
    assert spin_count(late.stderr) == "300000", late.stderr[-2000:]


def test_corekv_imported_after_torch_leaves_the_environment_to_its_host():
    """In a process that loaded torch first (vLLM's, with corekv's connector imported into it)
    corekv sets no wait policy: the processes that one starts (vLLM's workers) keep their host's."""
    out = run_python("import os, torch, corekv; print('ENV', os.environ.get('OMP_WAIT_POLICY'))")
    assert "ENV None" in out.stdout, out.stdout + out.stderr[-2000:]
    first = run_python("import os, corekv, torch; print('ENV', os.environ.get('OMP_WAIT_POLICY'))")
    assert "ENV PASSIVE" in first.stdout, first.stdout + first.stderr[-2000:]


@pytest.mark.parametrize("env, expected", [({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
                                           ({"GOMP_SPINCOUNT": "1000"}, "1000")])
def test_a_wait_policy_the_user_set_is_kept(env, expected):
    out = run_python("import corekv, torch; torch.ones(2).sum()", **_SHOW_OPENMP, **env)
    assert spin_count(out.stderr) == expected, out.stderr[-2000:]


def test_engine_threads_sets_torch_threads_and_unset_means_the_usable_cpus():
    code = ("import corekv, torch\n"
            "from corekv.config import Config, EngineConfig\n"
            "from corekv.engine.llm_engine import Engine\n"
            "from corekv.engine.tiny_model import make_tiny_llama\n"
            "from corekv.engine.cpu.threads import usable_cpus\n"
            "tiny = make_tiny_llama()\n"
            "torch.set_num_threads(7)\n"
            "e = Engine(Config(model='tiny', engine=EngineConfig(num_blocks=16, cpu_kernels='torch')), model=tiny)\n"
            "print('AUTO', e.num_threads == torch.get_num_threads() == usable_cpus())\n"
            "e = Engine(Config(model='tiny', engine=EngineConfig(num_blocks=16, cpu_kernels='torch', threads=1)),"
            " model=tiny)\n"
            "print('ONE', e.num_threads, torch.get_num_threads())\n"
            "import os; print('ENV', os.environ.get('OMP_WAIT_POLICY'))\n")
    out = run_python(code, **_SHOW_OPENMP)
    assert "AUTO True" in out.stdout and "ONE 1 1" in out.stdout, out.stdout + out.stderr[-2000:]
    # the engine's process waits passively; the processes it starts get the user's environment
    assert spin_count(out.stderr) == "0" and "ENV None" in out.stdout, out.stdout + out.stderr[-2000:]


def test_engine_threads_is_validated():
    import corekv

    with pytest.raises(corekv.ConfigError, match="engine.threads"):
        corekv.load_config({"engine": {"threads": 0}})
