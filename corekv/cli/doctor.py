"""``corekv doctor`` and ``corekv prepare``: what a start on this machine will cost, and doing that
one-time work ahead (converting the model, building the native kernels, timing the GEMM plans).

``doctor`` loads nothing heavy: it reads the caches' folders, the compiler on ``PATH`` and the
thread settings, and says for each one-time step whether the next start still has it to do.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

from corekv.cli.args import parser_kwargs, read_config_arg


def add_doctor_commands(commands, common) -> None:
    p = commands.add_parser("doctor", parents=[common], help="what a start costs on this machine",
                            **parser_kwargs(
                                "Report the CPU, threads, compiler and corekv's caches, and what the "
                                "next start of the config's model will do once (convert the model, "
                                "build the native kernels).",
                                "  corekv doctor\n"
                                "  corekv doctor --config cache.yaml\n"))
    p.set_defaults(handler=cmd_doctor)
    p = commands.add_parser("prepare", parents=[common], help="do a first start's one-time work now",
                            **parser_kwargs(
                                "Start an engine from the config once and exit: converts a .gguf "
                                "model, builds the native kernels and times the GEMM plans, so later "
                                "starts (a server, a CI run) take seconds.",
                                "  corekv prepare\n"
                                "  corekv prepare --config cache.yaml\n"))
    p.set_defaults(handler=cmd_prepare)


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from corekv.engine import gguf_cache
    from corekv.engine.cpu import gemm_plan, native
    from corekv.engine.cpu.isa import cpu_info
    from corekv.engine.cpu.threads import cgroup_cpu_quota, is_passive_wait_corekvs, usable_cpus
    from corekv.engine.models import model_path

    cfg, plugin_manager = read_config_arg(args)
    pending = []
    quota = cgroup_cpu_quota()
    policy = os.environ.get("OMP_WAIT_POLICY")
    wait = (f"OMP_WAIT_POLICY={policy} (yours)" if policy and not is_passive_wait_corekvs()
            else "passive (corekv's default)")
    lines = [("cpu", cpu_info().describe()),
             ("threads", f"{usable_cpus()} usable CPUs (affinity {len(os.sched_getaffinity(0))}, cgroup quota "
                         f"{'none' if quota is None else f'{quota:g} CPUs'}); engine.threads "
                         f"{cfg.engine.threads or 'unset: the usable CPUs'}; OpenMP wait: {wait}"),
             ("torch", f"{torch.__version__}")]
    path = model_path(cfg.model, plugin_manager=plugin_manager)
    if path.is_file():
        folder = gguf_cache.existing_folder(path)
        if folder is None:
            pending.append("convert the model (tens of seconds)")
        lines.append(("model", f"{path} (converted: {folder or 'not yet'})"))
    else:
        lines.append(("model", str(path)))
    compiler = shutil.which(os.environ.get("CXX") or "c++")
    lines.append(("compiler", f"{compiler or 'none found: the native kernels cannot be built'}"
                              f" ($CXX {'= ' + os.environ['CXX'] if os.environ.get('CXX') else 'unset'})"))
    if cfg.engine.cpu_kernels != "torch" and (cfg.device == "cpu" or not torch.cuda.is_available()):
        folder = native.build_directory()
        is_built = (folder / "corekv_native.so").is_file()
        if not is_built and compiler:
            pending.append("build the native kernels (a minute or more)")
        lines.append(("native kernels", f"{folder} ({'built' if is_built else 'not built'})"))
    plans = gemm_plan.cache_path()
    lines.append(("GEMM plans", f"{plans} ({'present' if plans.is_file() else 'none yet: timed on the first start'})"))
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name + ':':<{width + 1}} {value}")
    if pending:
        print(f"the next start will {' and '.join(pending)} once: `corekv prepare` does it now")
    else:
        print("the next start reads everything from the caches")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    import corekv

    cfg, plugin_manager = read_config_arg(args)
    start = time.perf_counter()
    with corekv.Engine.from_config(cfg, plugin_manager=plugin_manager):
        pass
    print(f"prepared {cfg.model} in {time.perf_counter() - start:.1f} s: the converted model, the "
          "native kernels and the GEMM plans are cached for later starts")
    return 0

