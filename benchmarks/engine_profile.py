"""Where a corekv decode step spends its time: engine phases, operators, Python functions.

Run through ``python benchmarks/engine_w1_w2.py --profile [--threads 1] [--dtypes float32]``; it
builds an engine, prefills W1's or W2's prompts (``workloads/w1_w2.py``), then profiles pure decode
steps three ways: wall-time wrappers around the engine's phases (schedule, the runner's
``_prepare`` and model forward, sampling, postprocess), ``torch.profiler`` by operator with corekv's
paged attention function wrapped in a ``record_function`` (re-registered under its
``AttentionInterface`` name for the profiled steps only), and cProfile's top functions.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.models import load_model
from corekv.engine.sampling import SamplingParams
from workloads.w1_w2 import w1_prompts, w2_prompts


class _Timed:
    """Wraps a callable and accumulates its wall time (seconds) in ``total``."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t0


def _decoding_engine(loaded, prompts, max_tokens):
    cfg = Config(engine=EngineConfig(num_blocks=sum(len(p) + max_tokens for p in prompts) // 16 + 64),
                 cache=CacheConfig(backend="radix"))
    engine = Engine(cfg, model=loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):  # past the first decode steps (buffers grown)
        engine.step()
    return engine


def profile_decode(dtype, log, seed_text, num_steps=20):
    """Where a corekv decode step spends its time, for batches of 1, 5 and 32 decoding sequences
    (W1's and W2's shapes; W2's prompts cut from ``seed_text``): engine phases timed by wrappers, then
    torch.profiler by operator with the paged attention function wrapped in a ``record_function``,
    then cProfile's top Python functions."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AttentionInterface
    import corekv.engine.attention as attention

    loaded = load_model("smollm2-135m-instruct", dtype=dtype, device="cpu")
    original = attention.paged_attention_forward

    def traced(*a, **kw):
        with record_function("corekv_paged_attention"):
            return original(*a, **kw)

    report = {}
    for label, prompts in (("W1 batch 1", w1_prompts(loaded)[:1]), ("W1 batch 5", w1_prompts(loaded)[1:]),
                           ("W2 batch 32", w2_prompts(loaded, seed_text))):
        engine = _decoding_engine(loaded, prompts, 2 + 3 * num_steps + 8)
        sched, runner = engine.scheduler, engine.runner
        timers = dict(schedule=_Timed(sched.schedule), execute=_Timed(runner.execute), prepare=_Timed(runner._prepare),
                      forward=_Timed(runner._forward), sample=_Timed(engine._sample), postprocess=_Timed(sched.postprocess))
        sched.schedule, runner.execute, runner._prepare = timers["schedule"], timers["execute"], timers["prepare"]
        runner._forward, engine._sample, sched.postprocess = timers["forward"], timers["sample"], timers["postprocess"]
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        step = (time.perf_counter() - t0) / num_steps
        phases = {k: v.total / num_steps * 1e3 for k, v in timers.items()}
        log(f"\n== {dtype} {label}: {len(sched.running)} decoding, context ~{sched.running[0].num_tokens} tokens; "
            f"step {step * 1e3:.1f} ms = " + ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items())
            + " (execute includes prepare and forward)")
        AttentionInterface.register(attention.ATTENTION_NAME, traced)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as tp:
                for _ in range(num_steps):
                    engine.step()
        finally:
            AttentionInterface.register(attention.ATTENTION_NAME, original)
        averages = tp.key_averages()
        log(averages.table(sort_by="self_cpu_time_total", row_limit=18))
        attn = next((e for e in averages if e.key == "corekv_paged_attention"), None)
        matmul = sum(e.self_cpu_time_total for e in averages if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")) / num_steps / 1e3
        attn_ms = attn.cpu_time_total / num_steps / 1e3 if attn else float("nan")
        ops = sum(e.self_cpu_time_total for e in averages if e.key.startswith("aten::")) / num_steps / 1e3
        log(f"{label}: per step linear/matmul kernels (self) {matmul:.1f} ms, paged attention (inclusive) "
            f"{attn_ms:.1f} ms, all aten ops (self) {ops:.1f} ms, of a profiled step "
            f"{sum(e.self_cpu_time_total for e in averages) / num_steps / 1e3:.1f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(num_steps):
            engine.step()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        log(text.getvalue())
        report[label] = dict(step_ms=step * 1e3, phases_ms=phases, matmul_ms=matmul, attention_ms=attn_ms, aten_ms=ops)
        engine.close()
    return report
