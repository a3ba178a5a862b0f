"""One timed pass of a workload given as waves (lists of prompts submitted together), on
corekv's :class:`~corekv.engine.llm_engine.Engine` and on vLLM's ``LLM``, measured the same way so
their rows compare: each wave submitted whole to ``generate``, the total and per-wave seconds,
each request's TTFT from its wave's submission, and its tokens.

Both return ``dict(total, waves, ttfts, tokens, ...)``; corekv's adds ``prompt_tokens_computed``
per wave (from ``engine.stats()``), vLLM's ``prompt_tokens_cached`` per wave (from its outputs).
vLLM is imported only inside :func:`on_vllm`, so this module loads in either venv.
"""
from __future__ import annotations

import time


def on_corekv(engine, wave_list, params) -> dict:
    """One run on a corekv ``engine`` with corekv ``params``."""
    tokens, ttfts, wave_times, computed = [], [], [], []
    t0 = time.perf_counter()
    for wave in wave_list:
        w0 = time.perf_counter()
        outs = engine.generate(wave, params, use_tqdm=False)
        wave_times.append(time.perf_counter() - w0)
        tokens += [list(o.token_ids) for o in outs]
        computed.append(engine.stats()["prompt_tokens_computed"] - sum(computed))
        ttfts += [o.ttft_s for o in outs]
    total = time.perf_counter() - t0
    return dict(total=total, waves=wave_times, ttfts=ttfts, tokens=tokens, prompt_tokens_computed=computed)


def on_vllm(llm, wave_list, params) -> dict:
    """One run on a ``vllm.LLM`` with vLLM ``params`` (the LLM needs ``disable_log_stats=False``:
    vLLM fills the request metrics TTFT comes from only with stats logging on; NaN without)."""
    from vllm.inputs import TokensPrompt

    tokens, ttfts, wave_times, cached = [], [], [], []
    t0 = time.perf_counter()
    for wave in wave_list:
        wall0, w0 = time.time(), time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in wave], params, use_tqdm=False)
        wave_times.append(time.perf_counter() - w0)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
        cached.append(sum(o.num_cached_tokens or 0 for o in outs))
        for o in outs:
            m = o.metrics
            # NOTE: arrival_time is wall-clock (time.time) when generate() added the request;
            # first_token_latency is measured from it, so this is "wave submitted -> first token".
            ok = m is not None and getattr(m, "first_token_latency", 0) > 0
            ttfts.append(m.arrival_time + m.first_token_latency - wall0 if ok else float("nan"))
    total = time.perf_counter() - t0
    return dict(total=total, waves=wave_times, ttfts=ttfts, tokens=tokens, prompt_tokens_cached=cached)
