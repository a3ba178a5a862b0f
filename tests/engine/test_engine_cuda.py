"""The engine on a CUDA device: greedy output equals transformers' generate on the same device, and
KV offloaded from the device pool to host (pinned), LMDB and fsspec and loaded back — directly or
through prefetch's pinned staging — gives bit-identical logits to a device hit, in float32 and
bfloat16.

Skipped without CUDA (CI has no GPU). ``COREKV_TEST_DEVICE=cpu`` runs the same checks on the CPU,
which is how they are checked where there is no GPU. A seeded random Llama larger than the tiny
one stands in for SmolLM2, whose GGUF (98 MB) is more than a GPU check can carry.
"""
from __future__ import annotations

import os

import pytest
import torch

from corekv.engine.sampling import SamplingParams
from corekv.engine.tiny_model import make_tiny_llama
from tier_helpers import BLOCK, GREEDY, PROMPT, LogitsProbe, evict, make_engine, tier_config

DEVICE = os.environ.get("COREKV_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="needs a CUDA device (COREKV_TEST_DEVICE=cpu runs these on the CPU)")

PROMPTS = ["hello world, this is a longer prompt about blocks and caches", "abc",
           [5, 6, 7, 8] * 9, [{"role": "user", "content": "What is a KV cache?"}]]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request):
    return make_tiny_llama(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2,
                           dtype=request.param, device=DEVICE)


def hf_greedy(loaded, hf_attention, token_ids, max_new_tokens):
    with hf_attention(loaded) as model, torch.no_grad():
        x = torch.tensor([token_ids], device=DEVICE)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def test_the_model_and_the_pool_live_on_the_device(loaded):
    with make_engine(loaded, num_blocks=64) as engine:
        assert engine.kv_pool.storage.device.type == torch.device(DEVICE).type
        assert next(loaded.model.parameters()).device.type == torch.device(DEVICE).type


def test_greedy_equals_transformers_generate_on_the_same_device(loaded, hf_attention):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    references = [hf_greedy(loaded, hf_attention, loaded.encode_prompt(p), params.max_tokens) for p in PROMPTS]
    with make_engine(loaded, num_blocks=64, budget=64) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == references
        again = engine.generate(PROMPTS, params)  # now from cached prefixes
    assert [o.token_ids for o in again] == references
    assert again[0].cached_tokens_by_tier["device"] > 0


@pytest.mark.parametrize("kind", ["host", "lmdb", "fsspec-file"])
def test_kv_back_from_a_tier_gives_the_device_hits_logits(loaded, kind, tmp_path):
    """Offload copies device blocks to the host; a reload copies host rows (pinned staging on
    CUDA) into the device pool. Both ways, once synchronously at admission and once through a
    prefetch staged before the first step."""
    with make_engine(loaded, num_blocks=64) as engine:
        probe = LogitsProbe(engine)
        engine.generate(PROMPT, GREEDY)
        reference, reference_logits = probe.first_token_logits(engine, PROMPT)
    assert reference.cached_tokens_by_tier == {"device": 4 * BLOCK}
    tier = tier_config(kind, tmp_path)
    with make_engine(loaded, [tier]) as engine:
        probe = LogitsProbe(engine)
        engine.generate(PROMPT, GREEDY)
        if kind == "host":
            assert engine.offload.tiers[0].is_pinned == torch.cuda.is_available()
        evict(engine)
        output, logits = probe.first_token_logits(engine, PROMPT)
        evict(engine)
        engine.add_request(PROMPT, GREEDY)
        [prefetch] = engine.offload.prefetches.values()
        prefetch.future.result()  # staged before the first step: admission only copies
        assert prefetch.num_staged == 4
        probe.calls = []
        prefetched = []
        while engine.has_unfinished_requests:
            prefetched += engine.step()
        stats = engine.stats()["tiers"][tier.name]
    assert output.cached_tokens_by_tier == prefetched[0].cached_tokens_by_tier == {"device": 0, tier.name: 4 * BLOCK}
    assert output.token_ids == prefetched[0].token_ids == reference.token_ids
    assert torch.equal(logits, reference_logits)
    assert torch.equal(probe.calls[0][0], reference_logits)
    assert stats["reloads"] >= 8 and stats["faults"] == 0  # the fillers come back from the tier too
