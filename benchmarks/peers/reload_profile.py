"""Where a reloaded prefix's TTFT goes inside vLLM: one vLLM process (the connector's both sides
and the model in it), one long prompt computed once, then reloaded from corekv's tiers after
``reset_prefix_cache()`` each time, beside vLLM's own device hits and fresh recomputes.

Run it in the vLLM venv under py-spy, then summarize the samples taken inside the reloads::

    VV=.venv-vllm
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VV/lib/libiomp5.so \\
      $VV/bin/py-spy record -r 100 --format raw -o reload.raw -- \\
      $VV/bin/python benchmarks/peers/reload_profile.py --config examples/configs/vllm.yaml
    python benchmarks/peers/reload_profile.py --summarize reload.raw

The timings print as medians (TTFT of a one-token generation); the summary lists the frames by
their share of the samples inside :func:`reloads` (a frame counted once per sample).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (see peers/__init__.py)
from peers import spy  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def summarize(raw_path: str, top: int) -> None:
    """py-spy's raw output: the frames under ``reloads``."""
    totals, num_samples = Counter(), 0
    for frames, count in spy.samples(raw_path):
        if "reloads" not in {f.split(" (", 1)[0] for f in frames}:
            continue
        num_samples += count
        for frame in set(frames):
            totals[frame] += count
    print(f"{num_samples} samples inside reloads()")
    for frame, count in totals.most_common(top):
        print(f"{count:6d} {100 * count / max(num_samples, 1):5.1f}%  {frame[:140]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="corekv's cache config for the connector (a YAML file)")
    ap.add_argument("--model", default=os.path.join(REPO, ".vllm-model", "smollm2_hf"))
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens")
    ap.add_argument("--reloads", type=int, default=5)
    ap.add_argument("--summarize", metavar="RAW", help="summarize a py-spy raw file and exit")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize, a.top)
        return
    if not a.config:
        ap.error("--config is required (corekv's cache config, e.g. examples/configs/vllm.yaml)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process to sample
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from corekv.integrations.vllm import transfer_config

    llm = LLM(model=a.model, dtype="float32", block_size=128, enable_prefix_caching=True,
              max_model_len=a.tokens + 256, max_num_batched_tokens=2048, num_gpu_blocks_override=64, seed=0,
              gpu_memory_utilization=0.2, enforce_eager=True, disable_hybrid_kv_cache_manager=True,
              kv_transfer_config=transfer_config(a.config))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def ttft(ids: list[int]) -> float:
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - started

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def reloads(ids: list[int]) -> list[float]:
        out = []
        for _ in range(a.reloads):
            llm.reset_prefix_cache()  # vLLM's device blocks go: the prefix comes from corekv's tiers
            out.append(ttft(ids))
        return out

    ttft(prompt(300))  # warm-up
    ids = prompt(a.tokens)
    result = {"cold": [ttft(ids)], "device_hit": [ttft(ids) for _ in range(3)]}
    time.sleep(1)  # the cold prompt's writes end
    result["reload"] = reloads(ids)
    result["recompute"] = [ttft(prompt(a.tokens)) for _ in range(3)]
    print(json.dumps({name: [round(x, 3) for x in xs] for name, xs in result.items()}))
    print("medians (s):", {name: round(statistics.median(xs), 3) for name, xs in result.items()})


if __name__ == "__main__":
    main()
