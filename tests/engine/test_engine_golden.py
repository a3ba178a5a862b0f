"""Golden tests on the real SmolLM2-135M-Instruct (float32): the engine's greedy outputs equal
transformers' own ``model.generate`` token for token, whatever the engine configuration.

Each reference is computed once (the HF model with its SDPA attention, one prompt at a time) and
reused by every engine configuration. Configurations cover prefix caching on/off, chunked prefill
on/off, block sizes 16/32, all prompts at once and one at a time, and both builtin backends; the
full 20 prompts run under two of them (one of them twice), a mixed subset under the others (CI time);
with speculative decoding (ngram, and SmolLM2 drafting for itself) all 20 at once and the subset one
at a time.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from corekv.config import CacheConfig, Config, EngineConfig, SpeculativeConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)


@dataclasses.dataclass(frozen=True)
class EngineConfigNoChunking(EngineConfig):
    """EngineConfig with chunked prefill switched off (a prompt is prefilled in one step)."""

    enable_chunked_prefill: bool = False


def _long_text(seed: int, num_sentences: int) -> str:
    subjects = ["The engineer", "A small robot", "The old library", "My neighbour", "The river",
                "A careful student", "The city council", "An orange cat"]
    verbs = ["measured", "painted", "forgot", "repaired", "counted", "described", "borrowed"]
    objects = ["the bridge", "seven lanterns", "a broken clock", "the northern wall", "two maps",
               "a quiet garden", "forty letters", "the spare key"]
    return " ".join(
        f"{subjects[(i * 3 + seed) % 8]} {verbs[(i * 5 + seed) % 7]} {objects[(i * 7 + seed) % 8]} "
        f"on day {i + seed}." for i in range(num_sentences))


def chat(user: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


GOLDEN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village,",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Hi",
    chat("What is a KV cache?"),
    chat("Write a haiku about the sea."),
    chat("Explain continuous batching in one sentence."),
    chat("How are you today?", system="You are a pirate. Always answer like a pirate."),
    chat("List three prime numbers."),
    chat("What is 12 times 12?", system="You are a concise math tutor."),
    _long_text(0, 12),  # ~130 tokens
    "Summarise the following notes.\n" + _long_text(3, 15),
    chat("What happened on day 12?", system=_long_text(5, 10)),
    _long_text(1, 90),  # > 1,000 tokens
    "Continue the log:\n" + _long_text(2, 20),
    chat("Which object was counted most often?", system=_long_text(4, 90)),  # > 1,000 tokens
    "The three primary colours are",
]
#: the prompts run under every configuration, chosen to mix short, chat and > 1,000-token ones
SUBSET = [0, 6, 7, 10, 15, 16]


def hf_greedy(loaded, hf_attention, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate with its SDPA attention (the reference)."""
    eos = sorted(loaded.eos_token_ids)
    with hf_attention(loaded) as model, torch.no_grad():
        x = torch.tensor([token_ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(token_ids):].tolist()


@pytest.fixture(scope="module")
def golden(smollm2, hf_attention):
    """``(token ids, reference output ids)`` per golden prompt, computed once."""
    token_ids = [smollm2.encode_prompt(p) for p in GOLDEN_PROMPTS]
    assert sum(len(t) > 1000 for t in token_ids) >= 2, [len(t) for t in token_ids]
    return [(ids, hf_greedy(smollm2, hf_attention, ids, MAX_NEW_TOKENS)) for ids in token_ids]


def make_engine(loaded, *, backend="radix", block_size=16, prefix_caching=True, chunked=True,
                max_num_batched_tokens=256, num_blocks=512, **engine_kwargs) -> Engine:
    engine_cls = EngineConfig if chunked else EngineConfigNoChunking
    if not chunked:
        max_num_batched_tokens = 2048
    cfg = Config(engine=engine_cls(block_size=block_size, num_blocks=num_blocks,
                                   enable_prefix_caching=prefix_caching,
                                   max_num_batched_tokens=max_num_batched_tokens, **engine_kwargs),
                 cache=CacheConfig(backend=backend))
    return Engine(cfg, model=loaded)


def run(engine: Engine, prompts: list, one_at_a_time: bool) -> list[list[int]]:
    if one_at_a_time:
        return [engine.generate(p, GREEDY)[0].token_ids for p in prompts]
    return [out.token_ids for out in engine.generate(prompts, GREEDY)]


def test_all_prompts_at_once_radix_bs16_cached_chunked(smollm2, golden):
    """Twice on one engine: the second pass reuses cached prefixes and still matches."""
    with make_engine(smollm2, backend="radix", block_size=16, max_num_batched_tokens=128) as engine:
        prompts = [ids for ids, _ in golden]
        assert run(engine, prompts, one_at_a_time=False) == [ref for _, ref in golden]
        first = engine.stats()
        again = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == [ref for _, ref in golden]
        assert all(o.num_cached_tokens == (len(ids) - 1) // 16 * 16 for o, (ids, _) in zip(again, golden))
        second = engine.stats()
        assert second["prompt_tokens_reused"] - first["prompt_tokens_reused"] > 0.9 * sum(
            len(ids) for ids, _ in golden)


def test_all_prompts_at_once_hash_blocks_bs32_uncached_unchunked(smollm2, golden):
    with make_engine(smollm2, backend="hash_blocks", block_size=32, prefix_caching=False,
                     chunked=False) as engine:
        assert run(engine, [ids for ids, _ in golden], one_at_a_time=False) == [ref for _, ref in golden]
        assert engine.stats()["prompt_tokens_reused"] == 0


def test_subset_at_once_hash_blocks_bs16_cached_small_budget(smollm2, golden):
    """A 64-token budget and 4 sequences at most: long prompts are prefilled over many steps
    between decodes, and the others wait in the queue."""
    subset = [golden[i] for i in SUBSET]
    with make_engine(smollm2, backend="hash_blocks", block_size=16, max_num_batched_tokens=64,
                     max_num_seqs=4) as engine:
        assert run(engine, [ids for ids, _ in subset], one_at_a_time=False) == [ref for _, ref in subset]


@pytest.mark.parametrize("backend, block_size, prefix_caching, chunked", [
    ("radix", 32, True, False),
    ("hash_blocks", 16, False, True),
])
def test_subset_one_at_a_time(smollm2, golden, backend, block_size, prefix_caching, chunked):
    subset = [golden[i] for i in SUBSET]
    with make_engine(smollm2, backend=backend, block_size=block_size, prefix_caching=prefix_caching,
                     chunked=chunked) as engine:
        assert run(engine, [ids for ids, _ in subset], one_at_a_time=True) == [ref for _, ref in subset]


def test_pool_too_small_for_the_batch_preempts_and_matches(smollm2, golden):
    """18 blocks of 16 tokens cannot hold these six requests at once: the engine preempts
    (recompute) and every request still finishes with the reference output."""
    subset = [golden[i] for i in (0, 3, 5, 7, 10, 11)]
    with make_engine(smollm2, backend="radix", block_size=16, num_blocks=18) as engine:
        outputs = engine.generate([ids for ids, _ in subset], GREEDY)
        assert [o.token_ids for o in outputs] == [ref for _, ref in subset]
        assert engine.stats()["num_preemptions"] > 0
        assert sum(o.num_preemptions for o in outputs) == engine.stats()["num_preemptions"]


# -- the seed's shared-system-prompt experiment -----------------------------------------------
SYSTEM = "You are an inference optimization expert. Answer concisely and accurately, give numbers when needed. " * 6
QUESTIONS = ["What is a KV cache?", "Explain continuous batching in one sentence.", "What is Python's GIL?",
             "Write a metaphor about the moon.", "Explain tensor parallelism in one sentence.",
             "What is 1+1? Answer directly."]


def test_shared_system_prompt_second_wave_computes_far_fewer_tokens(smollm2, hf_attention, record_property):
    """Six questions after one long system prompt: the first alone, then the other five together.
    With prefix caching the second wave reuses the system prompt's blocks: it computes far fewer
    tokens, and the outputs are identical to transformers' and to the uncached run."""
    prompts = [smollm2.encode_prompt(chat(q, SYSTEM)) for q in QUESTIONS]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    references = [hf_greedy(smollm2, hf_attention, ids, 32) for ids in prompts]
    computed = {}
    for caching in (False, True):
        with make_engine(smollm2, backend="radix", prefix_caching=caching) as engine:
            first = engine.generate(prompts[:1], params)
            before = engine.stats()
            rest = engine.generate(prompts[1:], params)
            after = engine.stats()
            assert [o.token_ids for o in first + rest] == references
            computed[caching] = after["tokens_computed"] - before["tokens_computed"]
            if caching:
                shared = len(os.path.commonprefix(prompts)) // 16 * 16  # the system prompt's full blocks
                assert shared >= 96 and all(o.num_cached_tokens >= shared for o in rest)
                assert after["prompt_tokens_reused"] - before["prompt_tokens_reused"] >= 5 * shared
    record_property("second_wave_tokens_computed", computed)
    print(f"second wave computed {computed[True]} tokens with prefix caching, {computed[False]} without "
          f"(prompt lengths {[len(p) for p in prompts]})")
    assert computed[True] < 0.5 * computed[False]


# -- speculative decoding ------------------------------------------------------------------------
SPECULATIVE = {
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
    # NOTE: the engine's own model's name: SmolLM2 drafts for itself (nearly every draft accepted)
    "draft": SpeculativeConfig(method="draft", model=Config().model, num_speculative_tokens=3),
}


@pytest.mark.parametrize("method", SPECULATIVE)
def test_speculative_decoding_gives_transformers_tokens(smollm2, golden, tmp_path, method):
    """Speculation (ngram; a draft model) with prefix caching and a host tier: the 20 prompts at
    once, then the subset one at a time (hitting what the first pass cached)."""
    from tier_helpers import tier_config

    cfg = Config(engine=EngineConfig(num_blocks=512, max_num_batched_tokens=256, speculative=SPECULATIVE[method]),
                 cache=CacheConfig(backend="radix", tiers=(tier_config("host", tmp_path),)))
    with Engine(cfg, model=smollm2) as engine:
        assert run(engine, [ids for ids, _ in golden], one_at_a_time=False) == [ref for _, ref in golden]
        subset = [golden[i] for i in SUBSET]
        assert run(engine, [ids for ids, _ in subset], one_at_a_time=True) == [ref for _, ref in subset]
        stats = engine.stats()
    assert stats["prompt_tokens_reused"] > 0 and stats["speculative"]["mean_acceptance_length"] > 1.2
