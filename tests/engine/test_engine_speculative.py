"""Speculative decoding (``engine.speculative``) on the tiny random Llama: greedy outputs equal the
engine without it, token for token, under every scheduling situation (batched and one at a time,
prefix caching and a tier, chunked prefill on a small budget, preemption, n > 1 with copy-on-write,
stop strings, max_tokens, streaming); sampled tokens keep the target's distribution (a chi-square
test against the exact distribution); rejected drafts leave nothing behind (pool, backend, tiers).

The tiny model drafts for itself in the ``draft`` tests (its name is the config's ``model``), so its
greedy drafts are all accepted; the n-gram proposer's are accepted and rejected.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from corekv.config import CacheConfig, Config, EngineConfig, SpeculativeConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams
from corekv.engine.spec_decode import NgramProposer
from corekv.plugin import hookimpl
from tier_helpers import LogitsProbe, tier_config

# NOTE: adaptive: false, so what is proposed does not depend on how fast this machine runs a step
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                          adaptive=False)
DRAFT = SpeculativeConfig(method="draft", model="tiny", num_speculative_tokens=3, adaptive=False)
METHODS = {"ngram": NGRAM, "draft": DRAFT}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
PROMPTS = [
    "Hi",
    "abcabcabcabcabcabcabc",
    "the cat sat on the mat. the cat sat on the",
    CODE,
    [{"role": "user", "content": "Repeat after me: corekv caches blocks."}],
    "One long line of notes about blocks and caches, " * 24,  # > 1,000 byte tokens
    [7, 8, 9] * 30,
    "x",
]
LONG = 5


def make_engine(tiny, speculative=None, *, num_blocks=256, budget=256, tiers=(), write_policy="write_back",
                **engine) -> Engine:
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=budget,
                                                   speculative=speculative or SpeculativeConfig(), **engine),
                 cache=CacheConfig(backend="radix", tiers=tuple(tiers), write_policy=write_policy))
    return Engine(cfg, model=tiny)


def token_ids(engine, prompts, params=GREEDY, one_at_a_time=False):
    if one_at_a_time:
        return [engine.generate(p, params)[0].token_ids for p in prompts]
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama):
    """The outputs without speculation (the reference of every greedy test here)."""
    with make_engine(tiny_llama) as engine:
        return token_ids(engine, PROMPTS)


# -- the n-gram proposer -----------------------------------------------------------------------
@pytest.mark.parametrize("tokens, num_tokens, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the longest n-gram "1 2 3"
    ([5, 3, 9, 7, 2, 3, 8, 1, 2, 3], 3, [8, 1, 2]),  # "2 3" is the longest that occurs earlier
    ([1, 2, 7, 1, 2, 8, 1, 2], 3, [8, 1, 2]),  # the latest occurrence with room for 3 tokens
    ([1, 2, 7, 1, 2, 8, 1, 2], 4, [7, 1, 2, 8]),  # the latest has room for 3 only: the earliest
    ([9, 4, 4, 4, 4, 4], 3, [4, 4]),  # a repeating run: the earliest occurrence, what follows it
    ([1, 2, 3], 2, []),  # no n-gram occurs earlier
    ([1, 2, 3, 1], 2, []),  # only a 1-gram occurs earlier; prompt_lookup_min is 2
])
def test_the_ngram_proposer_follows_the_longest_earlier_ngram(tokens, num_tokens, expected):
    assert NgramProposer(2, 3).propose(tokens, num_tokens) == expected


# -- greedy: exactly the tokens without speculation --------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["batched", "one_at_a_time"])
def test_greedy_outputs_equal_the_engine_without_speculation(tiny_llama, plain_outputs, tmp_path, method,
                                                             one_at_a_time):
    """With prefix caching and a host tier; batched twice, so the second pass hits cached prefixes."""
    with make_engine(tiny_llama, METHODS[method], tiers=[tier_config("host", tmp_path)]) as engine:
        assert token_ids(engine, PROMPTS, one_at_a_time=one_at_a_time) == plain_outputs
        if not one_at_a_time:
            assert token_ids(engine, PROMPTS) == plain_outputs
            assert engine.stats()["prompt_tokens_reused"] > 0
        stats = engine.stats()["speculative"]
    assert stats["method"] == method and stats["num_accepted_tokens"] > 0
    assert stats["mean_acceptance_length"] == 1 + stats["num_accepted_tokens"] / stats["num_speculations"]
    if method == "ngram":
        assert stats["num_accepted_tokens"] < stats["num_proposed_tokens"], "some drafts should be rejected"


@pytest.mark.parametrize("method", METHODS)
def test_a_small_budget_and_pool_chunk_prefills_and_preempt_with_the_same_outputs(tiny_llama, plain_outputs,
                                                                                  method):
    """32 tokens a step: prompts prefill over several steps between verifications; 16 blocks
    cannot hold every request at once, so sequences are preempted and recomputed."""
    short = [i for i, p in enumerate(PROMPTS) if i != LONG]
    with make_engine(tiny_llama, METHODS[method], num_blocks=16, budget=32) as engine:
        assert token_ids(engine, [PROMPTS[i] for i in short]) == [plain_outputs[i] for i in short]
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["speculative"]["num_accepted_tokens"] > 0
    assert stats["kv_num_free_blocks"] == 16


@pytest.mark.parametrize("method", METHODS)
def test_n_completions_fork_and_copy_on_write_under_speculation(tiny_llama, plain_outputs, method):
    params = dataclasses.replace(GREEDY, n=3)
    with make_engine(tiny_llama, METHODS[method]) as engine:
        outputs = engine.generate(PROMPTS[1:4], params)
        stats = engine.stats()
    for output, expected in zip(outputs, plain_outputs[1:4]):
        assert [c.token_ids for c in output.outputs] == [expected] * 3
    assert stats["num_cow_copies"] > 0 and stats["speculative"]["num_accepted_tokens"] > 0


def test_stop_strings_stop_tokens_and_max_tokens_cut_where_they_would_without(tiny_llama):
    with make_engine(tiny_llama) as engine:
        free = engine.generate(PROMPTS, GREEDY)
    cases = []
    for prompt, output in zip(PROMPTS, free):
        stop_token = output.token_ids[len(output.token_ids) // 2]
        cases.append((prompt, dataclasses.replace(GREEDY, stop_token_ids=(stop_token,))))
        cases.append((prompt, dataclasses.replace(GREEDY, max_tokens=7)))
        text = output.text
        printable = next((text[i:i + 2] for i in range(4, len(text) - 1) if text[i:i + 2].isalnum()), None)
        if printable:
            cases.append((prompt, dataclasses.replace(GREEDY, stop=[printable])))
    prompts, params = [p for p, _ in cases], [sp for _, sp in cases]
    with make_engine(tiny_llama) as engine:
        expected = engine.generate(prompts, params)
    with make_engine(tiny_llama, NGRAM) as engine:
        got = engine.generate(prompts, params)
        assert engine.stats()["speculative"]["num_accepted_tokens"] > 0
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
           [(o.token_ids, o.text, o.finish_reason) for o in expected]
    assert {o.finish_reason for o in got} == {"stop", "length"}


def test_streaming_yields_the_text_of_the_engine_without_speculation(tiny_llama, plain_outputs):
    with make_engine(tiny_llama) as engine:
        expected = [engine.generate(p, GREEDY)[0].text for p in PROMPTS[1:4]]
    with make_engine(tiny_llama, NGRAM) as engine:
        streamed = ["".join(engine.stream(p, GREEDY)) for p in PROMPTS[1:4]]
        assert engine.stats()["speculative"]["num_accepted_tokens"] > 0
    assert streamed == expected


# -- rollback: rejected drafts leave nothing behind ---------------------------------------------
def cached_hashes(engine) -> set:
    backend = engine.backend
    return {h for h in map(backend.block_hash, range(backend.num_blocks)) if h is not None}


class OffloadRecorder:
    def __init__(self):
        self.block_hashes = set()

    @hookimpl
    def corekv_on_blocks_offloaded(self, tier, block_hashes):
        self.block_hashes.update(block_hashes)


def test_rejections_leave_the_pool_and_the_cache_as_a_run_without_speculation(tiny_llama):
    """One request at a time through a 12-block pool, so cached blocks are evicted: never for
    draft slots, so the same blocks are evicted and stay cached as without speculation.

    NOTE: batched under pool pressure the two runs would differ for another reason: sequences that
    finish in fewer steps change when the next ones are admitted, and so what is evicted.
    """
    runs = {}
    for name, speculative in (("plain", None), ("ngram", NGRAM)):
        with make_engine(tiny_llama, speculative, num_blocks=12) as engine:
            outputs = token_ids(engine, [p for i, p in enumerate(PROMPTS) if i != LONG], one_at_a_time=True)
            stats = engine.stats()
            runs[name] = (outputs, stats["kv_num_free_blocks"], cached_hashes(engine), stats["tokens_computed"],
                          stats["backend"]["num_evicted_blocks"])
    spec = stats["speculative"]
    assert spec["num_proposed_tokens"] - spec["num_accepted_tokens"] > 20, "this test needs rejections"
    assert runs["ngram"] == runs["plain"] and runs["plain"][-1] > 0


def test_no_block_holding_a_rejected_draft_reaches_a_tier(tiny_llama, tmp_path):
    """Write-through offloads each block as it is cached: the blocks offloaded are those of a run
    without speculation, and their KV, reloaded from the tier alone, gives the logits of
    computing it."""
    offloaded = {}
    prompts = PROMPTS[1:4]
    for name, speculative in (("plain", None), ("ngram", NGRAM)):
        recorder = OffloadRecorder()
        cfg = Config(model="tiny", engine=EngineConfig(num_blocks=128, block_size=16,
                                                       speculative=speculative or SpeculativeConfig()),
                     cache=CacheConfig(backend="radix", write_policy="write_through",
                                       tiers=(tier_config("host", tmp_path),)))
        with Engine(cfg, model=tiny_llama, plugins=(recorder,)) as engine:
            outputs = engine.generate(prompts, GREEDY)
            engine.offload.flush()
            offloaded[name] = set(recorder.block_hashes)
            if speculative is None:
                continue
            spec = engine.stats()["speculative"]
            assert 0 < spec["num_accepted_tokens"] < spec["num_proposed_tokens"]
            engine.backend.reset()  # the device forgets every block: the tier alone holds them
            probe = LogitsProbe(engine)
            reloaded = [probe.first_token_logits(engine, o.prompt_token_ids + o.token_ids, GREEDY)
                        for o in outputs]
    assert offloaded["ngram"] == offloaded["plain"] and len(offloaded["plain"]) > 10
    with make_engine(tiny_llama, enable_prefix_caching=False) as engine:
        probe = LogitsProbe(engine)
        for output, (again, logits) in zip(outputs, reloaded):
            assert again.cached_tokens_by_tier["host"] == len(output.prompt_token_ids + output.token_ids) // 16 * 16
            _, computed = probe.first_token_logits(engine, output.prompt_token_ids + output.token_ids, GREEDY)
            torch.testing.assert_close(logits, computed, atol=1e-4, rtol=1e-4)


# -- sampling: the target's distribution --------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(tiny_llama, method):
    """The target's token at each verified position is drawn as it would be without drafts (one
    uniform per token from the request's generator), so a seeded request repeats its tokens
    whatever was proposed, accepted or rejected; n > 1 completions too (seed + index)."""
    params = [SamplingParams(max_tokens=24, temperature=t, top_k=k, top_p=tp, seed=seed, n=n, ignore_eos=True)
              for seed, (t, k, tp, n) in enumerate([(0.5, 0, 1.0, 1), (0.8, 5, 1.0, 2), (1.0, 0, 0.7, 1),
                                                    (0.3, 3, 1.0, 1), (0.6, 0, 1.0, 1), (1.2, 8, 0.9, 1),
                                                    (0.5, 0, 1.0, 1), (0.4, 0, 1.0, 3)])]
    with make_engine(tiny_llama) as engine:
        expected = [[c.token_ids for c in o.outputs] for o in engine.generate(PROMPTS, params)]
    with make_engine(tiny_llama, METHODS[method]) as engine:
        got = [[c.token_ids for c in o.outputs] for o in engine.generate(PROMPTS, params)]
        stats = engine.stats()["speculative"]
    assert got == expected
    assert 0 < stats["num_accepted_tokens"] < stats["num_proposed_tokens"]


@pytest.mark.parametrize("method", METHODS)
def test_sampled_tokens_under_speculation_follow_the_models_distribution(tiny_llama, hf_attention, method):
    """Three tokens sampled with temperature 1 and top_k 2 after a prompt the tiny model continues
    in a loop: the second and third come from a verification (its draft accepted about half the
    time). Over 500 seeded requests the 8 possible (t1, t2, t3) follow the exact probabilities
    computed from transformers' forward: chi-square below 24.32, the 0.1% critical value for 7
    degrees of freedom (the seeds are fixed, so the test cannot flake)."""
    with make_engine(tiny_llama) as engine:
        loop = engine.generate("ab", dataclasses.replace(GREEDY, max_tokens=40))[0].token_ids
    prompt = tiny_llama.encode_prompt("ab") + loop
    speculative = dataclasses.replace(METHODS[method], num_speculative_tokens=2)
    if method == "ngram":
        speculative = dataclasses.replace(speculative, prompt_lookup_min=1, prompt_lookup_max=1)
    draws = 500
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=i, ignore_eos=True) for i in range(draws)]
    with make_engine(tiny_llama, speculative, num_blocks=1024, max_num_seqs=64) as engine:
        counts = Counter(tuple(o.token_ids) for o in engine.generate([prompt] * draws, params))
        stats = engine.stats()["speculative"]
    assert 0.2 < stats["acceptance_rate"] < 0.8 and stats["num_speculations"] == draws

    def top2(tokens):
        with hf_attention(tiny_llama) as model, torch.no_grad():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1].double()
        values, ids = torch.topk(logits, 2)
        return dict(zip(ids.tolist(), torch.softmax(values, 0).tolist()))

    exact = {}
    for t1, p1 in top2(prompt).items():
        for t2, p2 in top2(prompt + [t1]).items():
            for t3, p3 in top2(prompt + [t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    assert set(counts) <= set(exact)
    statistic = sum((counts[cell] - draws * p) ** 2 / (draws * p) for cell, p in exact.items())
    assert statistic < 24.32, (statistic, counts, exact)


# -- how many drafts: the ones that pay --------------------------------------------------------
def test_the_step_cost_fit_recovers_a_linear_cost():
    from corekv.engine.spec_decode import StepCost

    cost = StepCost()
    for n in [1, 4, 32, 7, 128, 2, 64] * 20:
        cost.observe(n, 0.02 + 0.002 * n)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.02, rel=0.05) and per_token == pytest.approx(0.002, rel=0.05)


@pytest.mark.parametrize("rate, threshold, expected", [(0.9, 0.5, 6), (0.5, 0.09, 3), (0.3, 0.5, 0), (1.0, 0.9, 8),
                                                       (0.5, 0.5, 0)])
def test_a_draft_pays_while_its_acceptance_chance_beats_its_cost(rate, threshold, expected):
    from corekv.engine.spec_decode import _num_paying_drafts

    assert _num_paying_drafts(rate, threshold, 8) == expected


def decoding_sequences(num, params=GREEDY):
    from corekv.engine.sequence import Sequence, SequenceStatus
    from corekv.hashing import PrefixKey, chain_seed

    seqs = []
    for i in range(num):
        tokens = [5, 6, 7, 8, i]
        seq = Sequence(str(i), tokens, params, PrefixKey(tokens, 16, chain_seed("m", 16)))
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, len(tokens) - 1
        seqs.append(seq)
    return seqs


def test_adaptive_speculation_proposes_on_a_small_batch_and_stops_on_a_large_one():
    """A step costing 30 ms plus 3 ms a token: at the starting acceptance rate (0.5) three drafts
    pay for one decoding sequence (0.5 ** 3 > 3 / 33), none for 32 (0.5 < 96 / 126). The n-gram
    proposer's lookups are cheap, so the 32 still propose one token each, unverified, and a
    sequence whose proposals keep coming true speculates again."""
    from corekv.engine.spec_decode import SpeculativeDecoder

    proposed = []

    def propose(seqs, limits):
        proposed.append(list(limits))
        return [[9] * n for n in limits]

    decoder = SpeculativeDecoder(dataclasses.replace(NGRAM, adaptive=True), propose, is_cheap=True)
    for _ in range(200):
        decoder.observe_step(1, 0.033)
        decoder.observe_step(32, 0.126)
    one = decoding_sequences(1)
    decoder.propose(one)
    assert one[0].draft_token_ids == [9, 9, 9]
    many = decoding_sequences(32)
    decoder.propose(many)
    assert all(s.draft_token_ids == [] for s in many) and proposed[-1] == [1] * 32
    for _ in range(6):  # each proposal came true: the rate climbs until drafts pay for all 32
        for seq in many:
            seq.append_token(9)
            seq.num_computed_tokens += 1
        decoder.propose(many)
    assert all(s.draft_token_ids for s in many)
    fixed = SpeculativeDecoder(NGRAM, propose, is_cheap=True)
    fixed.propose(decoding_sequences(32))
    assert proposed[-1] == [4] * 32, "adaptive: false proposes num_speculative_tokens"
