"""Measure how well real KV blocks compress in the ``compressed_host`` tier, and how fast.

Runs corekv's engine on a few prompts, copies every cached block out of the KV pool, and pushes
the blocks through :class:`CompressedHostTier` (put then get, bit-exact check included) for each
zstd level and shuffle setting. Prints one Markdown table row per setting.

    python examples/third_party_plugin/measure_compression.py                  # SmolLM2, float32
    python examples/third_party_plugin/measure_compression.py --dtype bfloat16
    python examples/third_party_plugin/measure_compression.py --model tiny     # random tiny Llama
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import corekv
from corekv.engine.models import load_model
from corekv.engine.tiny_model import make_tiny_llama
from corekv_example_plugins.compressed_host import CompressedHostTier

TOPICS = ["how a hash table handles collisions", "the causes of the French Revolution",
          "the differences between TCP and UDP", "how vaccines train the immune system",
          "why the sky is blue at noon and red at sunset", "how a compiler turns source into code",
          "the rules of chess for a beginner", "how photosynthesis stores energy"]
# NOTE: long, distinct prompts, so most cached blocks hold different text (the chat template's
# system prompt is shared by all of them and is cached once).
PROMPTS = [f"Explain {topic} in detail. " + " ".join(
    f"Step {i}: describe part {i} of {topic}, with an example and a common mistake." for i in range(12))
    for topic in TOPICS]


def cached_blocks(model: str, dtype: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
    loaded = make_tiny_llama(dtype=dtype) if model == "tiny" else load_model(model, dtype=dtype, device="cpu")
    config = {"model": model, "dtype": dtype, "device": "cpu",
              "engine": {"block_size": 16, "num_blocks": 512}, "cache": {"backend": "hash_blocks"}}
    with corekv.Engine.from_config(config, model=loaded) as engine:
        engine.generate(PROMPTS, corekv.SamplingParams(max_tokens=1, temperature=0.0))
        ids = [i for i in range(engine.backend.num_blocks) if engine.backend.block_hash(i) is not None]
        blocks = engine.kv_pool.read_blocks(ids)
        shape = tuple(blocks.shape[1:])
        name = str(blocks.dtype).removeprefix("torch.")
        # NOTE: numpy has no bfloat16: the tier only needs the raw bytes, viewed as uint8.
        return blocks.contiguous().view(-1).view(torch.uint8).numpy().reshape(len(ids), -1), name, shape


def measure(rows: np.ndarray, dtype: str, shape: tuple[int, ...], level: int, shuffle: bool) -> str:
    block_bytes = rows.shape[1]
    keys = [i.to_bytes(16, "little") for i in range(1, len(rows) + 1)]
    with CompressedHostTier(size=1 << 34, level=level, shuffle=shuffle, block_bytes=block_bytes,
                            fingerprint=b"measure", dtype=dtype, shape=shape) as tier:
        start = time.perf_counter()
        tier.put(list(zip(keys, rows)))
        put_s = time.perf_counter() - start
        out = np.empty_like(rows)
        start = time.perf_counter()
        assert all(tier.get_into(keys, list(out)))
        get_s = time.perf_counter() - start
        assert np.array_equal(out, rows), "compressed_host returned different bytes"
        total_mb = rows.nbytes / 1e6
        return (f"| {dtype} | zstd-{level} | {'yes' if shuffle else 'no'} | {tier.compression_ratio:.2f} | "
                f"{total_mb / put_s:.0f} | {total_mb / get_s:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias, folder, .gguf, or 'tiny'")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    rows, dtype, shape = cached_blocks(args.model, args.dtype)
    print(f"{len(rows)} blocks of {rows.shape[1]} bytes ({dtype}{list(shape)}) from {args.model}\n")
    print("| KV dtype | codec | shuffle | ratio | put MB/s | get MB/s |")
    print("|---|---|---|---|---|---|")
    for level in (1, 3, 9):
        for shuffle in (False, True):
            print(measure(rows, dtype, shape, level, shuffle))


if __name__ == "__main__":
    main()
