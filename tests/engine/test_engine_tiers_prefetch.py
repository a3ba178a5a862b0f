"""Prefetch in the engine: a request's tier hits start loading into host staging when it arrives;
admission copies the staged rows into the pool. The output and the logits must equal a device
hit's; an abort before admission releases the staging; the counters say what happened."""
from __future__ import annotations

from concurrent.futures import wait

import torch

from corekv.engine.sampling import SamplingParams
from corekv.engine.llm_engine import Engine
from tier_helpers import BLOCK, GREEDY, PROMPT, LogitsProbe, evict, make_config, make_engine, tier_config


def device_hit(tiny_llama):
    with make_engine(tiny_llama, num_blocks=64) as engine:
        probe = LogitsProbe(engine)
        engine.generate(PROMPT, GREEDY)
        return probe.first_token_logits(engine, PROMPT)


def prefetch_delta(engine, before: dict) -> dict:
    """Prefetch counters since ``before`` (the fillers of ``evict`` prefetch too)."""
    after = engine.offload.prefetch_stats()
    return {k: after[k] - before.get(k, 0) if k != "num_staged_blocks" else after[k] for k in after}


def run_to_end(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests:
        outputs += engine.step()
    return outputs


def test_a_prefetched_reload_gives_bit_identical_logits_to_a_device_hit(tiny_llama, tmp_path):
    reference, reference_logits = device_hit(tiny_llama)
    with make_engine(tiny_llama, [tier_config("lmdb", tmp_path)]) as engine:
        probe = LogitsProbe(engine)
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        before = engine.offload.prefetch_stats()
        request_id = engine.add_request(PROMPT, GREEDY)
        [prefetch] = engine.offload.prefetches.values()
        prefetch.future.result()  # staged before the first step: admission only copies
        assert prefetch.num_staged == 4
        probe.calls = []
        [output] = run_to_end(engine)
        stats = prefetch_delta(engine, before)
        tier_stats = engine.stats()["tiers"]["lmdb"]
    assert output.request_id == request_id
    assert output.cached_tokens_by_tier == {"device": 0, "lmdb": 4 * BLOCK}
    assert output.token_ids == reference.token_ids
    assert torch.equal(probe.calls[0][0], reference_logits)
    assert stats["ready"] == 1 and stats["used_blocks"] == 4 and stats["num_staged_blocks"] == 0
    assert tier_stats["prefetched_blocks"] == tier_stats["reloads"] == 4


def test_generate_waits_for_a_running_prefetch_and_counts_it(tiny_llama, tmp_path):
    """generate() enqueues and steps at once, so admission finds the job queued (cancelled),
    running (stopped after its current tier call: it may have staged none, some or all blocks)
    or, rarely, done. Whatever the job staged reaches the pool and admission loads the rest:
    each block is read from the tier once and the logits equal a device hit's."""
    reference, reference_logits = device_hit(tiny_llama)
    with make_engine(tiny_llama, [tier_config("host", tmp_path)]) as engine:
        probe = LogitsProbe(engine)
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        hits_before = engine.stats()["tiers"]["host"]["hits"]
        before = engine.offload.prefetch_stats()
        output, logits = probe.first_token_logits(engine, PROMPT)
        stats = prefetch_delta(engine, before)
        host = engine.stats()["tiers"]["host"]
    assert output.cached_tokens_by_tier == {"device": 0, "host": 4 * BLOCK}
    assert torch.equal(logits, reference_logits)
    assert stats["stopped"] + stats["ready"] + stats["fallbacks"] == 1
    assert stats["used_blocks"] == stats["staged_blocks"] and stats["dropped_blocks"] == 0
    if stats["ready"]:
        assert stats["used_blocks"] == 4
    assert host["hits"] - hits_before == 4, "each block was read from the tier once"


def test_an_abort_before_admission_releases_the_prefetch(tiny_llama, tmp_path):
    with make_engine(tiny_llama, [tier_config("host", tmp_path)]) as engine:
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        before = engine.offload.prefetch_stats()
        request_id = engine.add_request(PROMPT, GREEDY)
        [prefetch] = engine.offload.prefetches.values()
        engine.abort(request_id)
        [output] = run_to_end(engine)
        wait([prefetch.future], timeout=30)  # done or cancelled: its staging is released
        stats = prefetch_delta(engine, before)
        assert output.finish_reason == "abort"
        assert engine.offload.prefetches == {}
        assert stats["dropped"] == 1 and stats["num_staged_blocks"] == 0 and stats["used_blocks"] == 0
        assert engine.stats()["tiers"]["host"]["reloads"] == 0
        again = engine.generate(PROMPT, GREEDY)[0]  # the tier still serves the prefix
        assert again.cached_tokens_by_tier == {"device": 0, "host": 4 * BLOCK}


def test_a_waiting_request_prefetches_while_another_runs(tiny_llama, tmp_path):
    """max_num_seqs=1: B waits while A decodes; B's prefetch was started at its arrival and is
    ready at its admission, and B's output equals a run without prefetch."""
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with make_engine(tiny_llama, [tier_config("host", tmp_path)], num_blocks=16, max_num_seqs=1) as engine:
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        engine.add_request("another prompt that runs first", long)
        engine.step()  # A is admitted and running
        before = engine.offload.prefetch_stats()
        engine.add_request(PROMPT, GREEDY, request_id="B")
        prefetch = engine.offload.prefetches[next(iter(engine.offload.prefetches))]
        engine.step()  # B still waits: A holds the only sequence slot
        assert engine.offload.prefetches, "B is still waiting"
        prefetch.future.result()
        outputs = {o.request_id: o for o in run_to_end(engine)}
        stats = prefetch_delta(engine, before)
    assert outputs["B"].cached_tokens_by_tier == {"device": 0, "host": 4 * BLOCK}
    assert stats["ready"] == 1 and stats["used_blocks"] == 4
    with make_engine(tiny_llama, num_blocks=16) as plain:
        assert plain.generate(PROMPT, GREEDY)[0].token_ids == outputs["B"].token_ids


def test_prefetch_blocks_zero_turns_prefetch_off_and_stats_report_it(tiny_llama, tmp_path):
    """cache.prefetch_blocks: 0 -> admission loads synchronously; engine.stats()["prefetch"]."""
    import dataclasses

    reference, _ = device_hit(tiny_llama)
    config = make_config([tier_config("lmdb", tmp_path)])
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, prefetch_blocks=0))
    with Engine(config, model=tiny_llama) as engine:
        engine.generate(PROMPT, GREEDY)
        evict(engine)
        engine.add_request(PROMPT, GREEDY)
        assert engine.offload.prefetches == {}  # nothing read ahead
        [output] = run_to_end(engine)
        stats = engine.stats()
    assert output.cached_tokens_by_tier == {"device": 0, "lmdb": 4 * BLOCK}
    assert output.token_ids == reference.token_ids
    assert stats["prefetch"] == {}  # no prefetcher at all
    assert stats["tiers"]["lmdb"]["reloads"] == 4 and stats["tiers"]["lmdb"]["prefetched_blocks"] == 0
