"""A soak: the engine serves some 1,700 short requests with host and LMDB tiers under a pool small
enough that blocks are evicted, offloaded and reloaded all the time; its memory stays flat and
every queue and counter returns to idle at the end. It runs twice: with ``offload_min_hits`` 0
(every evicted block is offloaded) and 1 (hit counts are kept).

What "flat" means here, and why these bounds:

* RSS is read as ``RssAnon`` (anonymous memory). The LMDB tier's pages are file-backed (its
  memory map), bounded by its ``size`` and reclaimable, so they are left out; the host tier's
  arena and glibc's heap are anonymous, so warm-up runs until both are at their working size
  (the arena is touched slot by slot as it fills; the heap keeps freed buffers for reuse).
* After warm-up, anonymous RSS may grow by at most ``RSS_BOUND`` over the measured requests. A
  leak that keeps KV bytes per request (a staging buffer, a snapshot, a payload: 8 KiB per block
  of the tiny model, several blocks per request) exceeds it once the heap's free memory is used
  up; allocator noise stays well under it.
* Small Python objects kept per block or per request (a hash counted and never dropped, a
  per-request dict entry: around 100 bytes each) are too small for RSS to show, so tracemalloc
  measures them: the Python memory allocated under corekv's own code (a frame of the
  repository's packages among the last ``TRACED_FRAMES``) may grow by at most ``TRACED_BOUND``
  over the traced batches. Those reload over two hundred distinct blocks, so 100 bytes kept per
  reloaded block is several times the bound. The model's forward is left out (the runner, its
  paged attention and the CPU kernels' wrappers): torch keeps state of its own behind those calls,
  such as the Python objects of tensors its C++ side still holds.

The request count is what turns every bounded structure over once before it is measured, kept
low because traced requests run several times slower.
"""
from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path

import pytest

import corekv
from corekv.engine.sampling import SamplingParams
from tier_helpers import make_config, tier_config
from corekv.engine.llm_engine import Engine

#: before the RSS baseline: the host tier fills, LMDB repeats begin (``batch_prompts``)
NUM_WARMUP_BATCHES = 60
NUM_RSS_BATCHES = 60
#: traced before the first snapshot (the host tier's entries and the radix tree turn over) ...
NUM_TRACE_TURNOVER_BATCHES = 30
#: ... and between the two snapshots
NUM_TRACED_BATCHES = 40
RSS_BOUND = 4 << 20
TRACED_BOUND = 6 << 10
#: frames kept per traced allocation: enough to see corekv's caller behind a stdlib container
TRACED_FRAMES = 4
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
REPO = Path(corekv.__file__).resolve().parent.parent
#: the repository's packages (corekv, corekv.engine, .plugins, .tiers), less the model's forward
OWN_CODE = [tracemalloc.Filter(True, str(REPO / folder / "*"), all_frames=True)
            for folder in ("corekv", "engine", "plugins", "tiers")]
#: the model's forward: the runner, and the code that runs only inside the forward (its attention
#: and the CPU kernels' wrappers, whose last frames need not show the runner)
FORWARD = [tracemalloc.Filter(False, str(REPO / "engine" / path), all_frames=True)
           for path in ("model_runner.py", "attention.py", "cpu/*")]
#: pinned at start; the first request of every tenth batch starts with it
SYSTEM = "a pinned system prompt that some requests start with, "


def document(index: int) -> str:
    """A 48-byte document: three full blocks of the byte tokenizer, distinct per index."""
    return f"document {index:07d} about caches, tiers and blocks."


def batch_prompts(batch: int) -> list[tuple[str, bool]]:
    """``(prompt, offload)`` of one batch: new documents and repeats at three distances, so
    hits come from the device (the previous batch), the host tier (3 batches ago: evicted from
    the 48-block pool, still among the host tier's ~120 entries) and LMDB (50 batches ago: gone
    from the host tier, still within LMDB's 32 MiB).

    NOTE: with ``offload_min_hits: 1`` only the documents hit on the device are offloaded, so
    the host tier's entries reach back further (tens of batches); 50 is past that and still
    within LMDB's reach with either setting.
    """
    new = [document(3 * batch + i) for i in range(3)]
    repeats = [document(3 * (batch - 1) + i) for i in range(2) if batch >= 1]
    repeats += [document(3 * (batch - 3) + i) for i in range(2) if batch >= 3]
    repeats += [document(3 * (batch - 50) + i) for i in range(2) if batch >= 50]
    prompts = [(f"{doc} question {batch}.{i}", True) for i, doc in enumerate(new + repeats)]
    if batch % 10 == 0:
        prompts[0] = (SYSTEM + prompts[0][0], True)
    if batch % 7 == 0:
        prompts[-1] = (prompts[-1][0], False)  # a request that keeps its blocks off the tiers
    return prompts


def serve(engine: Engine, first_batch: int, num_batches: int) -> None:
    """Serve batches ``first_batch ..``; in every fifth an extra request is aborted while it
    waits (its prefetch is dropped)."""
    for batch in range(first_batch, first_batch + num_batches):
        for prompt, offload in batch_prompts(batch):
            engine.add_request(prompt, PARAMS, offload=offload)
        if batch % 5 == 0:
            engine.abort(engine.add_request(document(3 * (batch - 3) + 2) + " aborted", PARAMS))
        while engine.has_unfinished_requests:
            engine.step()


def anonymous_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("/proc/self/status has no RssAnon (Linux 4.5+ only)")


def traced_own_bytes(engine: Engine) -> int:
    """Python memory held by corekv's code now, with the offload queue drained (a snapshot in
    flight there is not growth)."""
    engine.offload.flush()
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([*OWN_CODE, *FORWARD])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.fixture(scope="module")
def mkl_llama():
    """The tiny Llama with each Linear's GEMM planned as MKL's (the first candidate), not timed.

    NOTE: for the tiny model's shapes MKL and oneDNN take microseconds either way, so a timed plan
    picks either by chance; oneDNN keeps a primitive per new row count, megabytes of anonymous
    memory that are not corekv's and would make RSS_BOUND a coin toss."""
    from corekv.engine.cpu import gemm_plan
    from corekv.engine.tiny_model import make_tiny_llama

    timed = gemm_plan.gemm_plan
    gemm_plan.gemm_plan = lambda dtype, shape, candidates: dict.fromkeys(("few", "many"), next(iter(candidates)))
    try:
        return make_tiny_llama()
    finally:
        gemm_plan.gemm_plan = timed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc/self/status")
@pytest.mark.parametrize("offload_min_hits", [0, 1])
def test_memory_stays_flat_and_everything_returns_to_idle(mkl_llama, tmp_path, offload_min_hits):
    tiers = [tier_config("host", tmp_path, size=1 << 20), tier_config("lmdb", tmp_path, size=32 << 20)]
    config = make_config(tiers, num_blocks=48)
    config = type(config)(**{**config.__dict__, "cache": type(config.cache)(
        **{**config.cache.__dict__, "offload_min_hits": offload_min_hits})})
    with Engine(config, model=mkl_llama) as engine:
        offload, backend = engine.offload, engine.backend
        engine.warm(SYSTEM)
        serve(engine, 0, NUM_WARMUP_BATCHES)
        gc.collect()
        rss_before = anonymous_rss()
        serve(engine, NUM_WARMUP_BATCHES, NUM_RSS_BATCHES)
        gc.collect()
        rss_growth = anonymous_rss() - rss_before

        tracemalloc.start(TRACED_FRAMES)
        try:
            first = NUM_WARMUP_BATCHES + NUM_RSS_BATCHES
            serve(engine, first, NUM_TRACE_TURNOVER_BATCHES)
            traced_before = traced_own_bytes(engine)
            serve(engine, first + NUM_TRACE_TURNOVER_BATCHES, NUM_TRACED_BATCHES)
            traced_growth = traced_own_bytes(engine) - traced_before
        finally:
            tracemalloc.stop()

        stats = engine.stats()
        offload.flush()
        resident = {h for b in range(backend.num_blocks) if (h := backend.block_hash(b)) is not None}
        host, lmdb = stats["tiers"]["host"], stats["tiers"]["lmdb"]
        prefetch = offload.prefetch_stats()
        # the run did what a soak is for: evictions, offloads and reloads from both tiers
        assert stats["backend"]["num_evicted_blocks"] > 0 and host["offloads"] > 0 and lmdb["offloads"] > 0
        assert host["reloads"] > 0 and lmdb["reloads"] > 0 and host["evictions"] > 0
        assert prefetch["dropped"] > 0 and host["faults"] == lmdb["faults"] == 0

        assert rss_growth < RSS_BOUND, f"anonymous RSS grew {rss_growth / 2**20:.1f} MiB after warm-up"
        assert traced_growth < TRACED_BOUND, f"corekv's Python memory grew {traced_growth} bytes"

        # idle: nothing waits or runs, every block is free or evictable but the pinned ones
        assert stats["num_waiting"] == stats["num_running"] == 0 and not engine.has_unfinished_requests
        assert backend.num_pinned_blocks > 0
        assert backend.num_free_blocks == backend.num_blocks - backend.num_pinned_blocks
        assert offload.num_queued_blocks == 0
        assert not engine.offload.prefetches and prefetch["num_staged_blocks"] == 0
        assert prefetch["staged_blocks"] == prefetch["used_blocks"] + prefetch["dropped_blocks"]
        # hit_counts: none kept without offload_min_hits; otherwise only resident blocks
        if offload_min_hits == 0:
            assert offload.hit_counts == {}
        else:
            assert offload.hit_counts and set(offload.hit_counts) <= resident
        assert offload.opted_out <= resident
