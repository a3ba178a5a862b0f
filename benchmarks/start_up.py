"""Start-up of the default engine: a fresh process to a ready ``Engine.from_config({"device": "cpu"})``
(SmolLM2 from its GGUF file), cold and warm.

*cold*: ``COREKV_CACHE_DIR`` and ``TORCH_EXTENSIONS_DIR`` in an empty folder, so the start converts
the GGUF file, builds the native kernels and times the GEMM plans, as a first start on a machine
does; *warm*: the same folders again, as every later start. Prints each start's phases (the
progress lines, forced on) and a table of wall times; ``--warm N`` warm starts (median shown).

    python benchmarks/start_up.py --warm 3
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
engine = corekv.Engine.from_config({"device": "cpu"})
print(f"READY {time.perf_counter() - t0:.2f}", flush=True)
engine.close()
"""


def start(env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds of the whole process, seconds to a ready engine inside it, its progress lines)"""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=3600)
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="corekv-start-") as root:
        env = dict(os.environ, COREKV_CACHE_DIR=os.path.join(root, "cache"),
                   TORCH_EXTENSIONS_DIR=os.path.join(root, "ext"), TQDM_DISABLE="1")
        rows = [("cold", *start(env))]
        rows += [("warm", *start(env)) for _ in range(args.warm)]
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| start | process wall s | to a ready engine s | phases |")
    print("|---|---:|---:|---|")
    for name, wall, ready, phases in rows:
        print(f"| {name} | {wall:.1f} | {ready:.1f} | {phases} |")
    warm = [ready for name, _, ready, _ in rows if name == "warm"]
    if warm:
        print(f"warm median to a ready engine: {statistics.median(warm):.2f} s")


if __name__ == "__main__":
    main()
