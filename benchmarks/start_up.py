"""Start-up of the default engine: a fresh process to a ready ``Engine.from_config({"device": "cpu"})``
(SmolLM2 from its GGUF file), cold and warm.

*cold*: ``COREKV_CACHE_DIR`` and ``TORCH_EXTENSIONS_DIR`` in an empty folder, so the start converts
the GGUF file, builds the native kernels and times the GEMM plans, as a first start on a machine
does; *warm*: the same folders again, as every later start. Prints each start's phases (the
progress lines, forced on) and a table of wall times; ``--warm N`` warm starts (median shown).

``--reuse-caches`` skips the cold start and times warm starts on this machine's own caches (the
environment's ``COREKV_CACHE_DIR`` and ``TORCH_EXTENSIONS_DIR``, else their defaults; a first start
fills them if they are empty). ``--before`` alternates each warm start with one that loads the
model as corekv did before issue 38's start-up work (``from_pretrained`` on the converted folder,
the fingerprint hashed from every weight), in the same minutes, since other jobs move the numbers.

    python benchmarks/start_up.py --warm 3
    python benchmarks/start_up.py --reuse-caches --warm 7 --before
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD = """
import logging, time
t0 = time.perf_counter()
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
logging.getLogger("corekv.progress").setLevel(logging.INFO)  # the phases, as a terminal shows them
import corekv
{before}engine = corekv.Engine.from_config({{"device": "cpu"}})
print(f"READY {{time.perf_counter() - t0:.2f}}", flush=True)
engine.close()
"""


#: the model loaded as before: from_pretrained on the converted folder, every weight hashed
_BEFORE = """from corekv.engine import gguf_cache
gguf_cache.load_model_from = gguf_cache.remembered = lambda *args: None
gguf_cache.remember = lambda *args: None
"""


def start(env: dict[str, str], before: bool = False) -> tuple[float, float, str]:
    """(wall seconds of the whole process, seconds to a ready engine inside it, its progress lines)"""
    t = time.perf_counter()
    child = _CHILD.format(before=_BEFORE if before else "")
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    ready = [line for line in out.stdout.splitlines() if line.startswith("READY ")]
    if not ready:
        raise SystemExit(out.stdout + out.stderr[-3000:])
    phases = [line.removeprefix("corekv.progress: ") for line in out.stderr.splitlines()
              if line.startswith("corekv.progress: ")]
    return wall, float(ready[0].split()[1]), "; ".join(phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    parser.add_argument("--reuse-caches", action="store_true",
                        help="no cold start: warm starts on this machine's own caches")
    parser.add_argument("--before", action="store_true",
                        help="alternate each warm start with one that loads the model as before issue 38")
    args = parser.parse_args()
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="corekv-start-") as root:
        env = dict(os.environ, TQDM_DISABLE="1")
        if not args.reuse_caches:
            env.update(COREKV_CACHE_DIR=os.path.join(root, "cache"), TORCH_EXTENSIONS_DIR=os.path.join(root, "ext"))
        rows = [("cold", *start(env))] if not args.reuse_caches else []
        if args.reuse_caches:
            start(env)  # fills the caches where they are empty; not timed
        for _ in range(args.warm):
            rows.append(("warm", *start(env)))
            loads.append(os.getloadavg()[0])
            if args.before:
                rows.append(("warm, before", *start(env, before=True)))
                loads.append(os.getloadavg()[0])
    print(f"load average (1 min) {min(loads):.1f}-{max(loads):.1f}")
    print("| start | process wall s | to a ready engine s | phases |")
    print("|---|---:|---:|---|")
    for name, wall, ready, phases in rows:
        print(f"| {name} | {wall:.1f} | {ready:.1f} | {phases} |")
    for kind in ("warm", "warm, before"):
        ready = [r for name, _, r, _ in rows if name == kind]
        wall = [w for name, w, _, _ in rows if name == kind]
        if ready:
            print(f"{kind}: median to a ready engine {statistics.median(ready):.2f} s "
                  f"(process {statistics.median(wall):.2f} s) of {len(ready)}")


if __name__ == "__main__":
    main()
