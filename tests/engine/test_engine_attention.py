"""Paged attention through the ModelRunner equals the HF model's own forward.

The reference is the very same HF model run with transformers' SDPA attention and no cache, on the
whole sequence at once; the runner computes the same positions chunk by chunk, from shuffled,
non-contiguous blocks, mixed with other sequences' decode tokens.
"""
from __future__ import annotations

import random

import pytest
import torch

from corekv.errors import CoreKVError
from corekv.engine.kv_pool import KVPool
from corekv.engine.model_runner import CASCADE_MIN_SAVED_TOKENS, ModelRunner, ScheduledChunk, cascade_groups


def make_runner(loaded, num_blocks=64, block_size=16, cascade_min_saved_tokens=0, native=False):
    """A runner whose decodes take the cascade path for any shared block (these tests' groups are
    far smaller than the engine's default threshold)."""
    pool = KVPool(loaded.num_layers, num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim,
                  loaded.dtype, loaded.device)
    return ModelRunner(loaded, pool, cascade_min_saved_tokens=cascade_min_saved_tokens, native=native)


#: attention through the torch path (gather + SDPA) and through the native kernels (engine.compile's)
ATTENTION_PATHS = pytest.mark.parametrize("native", [False, True], ids=["torch_attention", "native_attention"])


def reference_logits(loaded, hf_attention, token_ids):
    with hf_attention(loaded) as model, torch.no_grad():
        return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


def random_ids(seed, n, vocab=259):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def shuffled_tables(num_blocks, sizes, seed=0):
    """Disjoint, shuffled block tables (so no sequence's blocks are contiguous or in order)."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for size in sizes:
        tables.append(ids[at:at + size])
        at += size
    return tables


@ATTENTION_PATHS
def test_one_chunk_prefill_matches_hf(tiny_llama, hf_attention, native):
    ids = random_ids(0, 70)
    runner = make_runner(tiny_llama, native=native)
    (table,) = shuffled_tables(64, [5])
    logits = runner.execute([ScheduledChunk(ids, 0, table)])
    assert logits.shape == (1, tiny_llama.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], reference_logits(tiny_llama, hf_attention, ids)[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@ATTENTION_PATHS
def test_chunked_prefill_then_decode_matches_hf(tiny_llama, hf_attention, block_size, native):
    ids = random_ids(1, 120)
    reference = reference_logits(tiny_llama, hf_attention, ids)
    runner = make_runner(tiny_llama, num_blocks=32, block_size=block_size, native=native)
    (table,) = shuffled_tables(32, [120 // block_size + 1], seed=block_size)
    bounds = [0, 7, 40, 41, 90, 100]  # chunk ends fall inside blocks and on block edges
    for start, end in zip(bounds, bounds[1:]):
        logits = runner.execute([ScheduledChunk(ids[start:end], start, table)])
        torch.testing.assert_close(logits[0], reference[end - 1], rtol=1e-5, atol=1e-5)
    for pos in range(100, 120):
        logits = runner.execute([ScheduledChunk([ids[pos]], pos, table)])
        torch.testing.assert_close(logits[0], reference[pos], rtol=1e-5, atol=1e-5)


@ATTENTION_PATHS
def test_mixed_batch_of_prefill_chunks_and_decodes(tiny_llama, hf_attention, native):
    seqs = [random_ids(10 + i, n) for i, n in enumerate([50, 33, 17, 64])]
    references = [reference_logits(tiny_llama, hf_attention, s) for s in seqs]
    runner = make_runner(tiny_llama, num_blocks=64, block_size=16, native=native)
    tables = shuffled_tables(64, [4, 3, 2, 4], seed=3)
    # Step 1: seqs 0-2 prefill all but their last token; seq 3 prefills its first 30.
    runner.execute([ScheduledChunk(s[:-1], 0, t) for s, t in zip(seqs[:3], tables)]
                   + [ScheduledChunk(seqs[3][:30], 0, tables[3])])
    # Step 2: seq 3 continues its prefill while seqs 0-2 decode, listed in a mixed order.
    chunks = [ScheduledChunk([seqs[1][-1]], 32, tables[1]),
              ScheduledChunk(seqs[3][30:64], 30, tables[3]),
              ScheduledChunk([seqs[0][-1]], 49, tables[0]),
              ScheduledChunk([seqs[2][-1]], 16, tables[2])]
    logits = runner.execute(chunks)
    expected = torch.stack([references[1][-1], references[3][-1], references[0][-1], references[2][-1]])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@ATTENTION_PATHS
def test_two_prefill_chunks_with_cached_context_in_one_step(tiny_llama, hf_attention, native):
    a, b = random_ids(20, 60), random_ids(21, 45)
    ref_a, ref_b = reference_logits(tiny_llama, hf_attention, a), reference_logits(tiny_llama, hf_attention, b)
    runner = make_runner(tiny_llama, num_blocks=16, block_size=16, native=native)
    ta, tb = shuffled_tables(16, [4, 3], seed=5)
    runner.execute([ScheduledChunk(a[:20], 0, ta), ScheduledChunk(b[:5], 0, tb)])
    logits = runner.execute([ScheduledChunk(a[20:60], 20, ta), ScheduledChunk(b[5:45], 5, tb)])
    torch.testing.assert_close(logits, torch.stack([ref_a[-1], ref_b[-1]]), rtol=1e-5, atol=1e-5)


@ATTENTION_PATHS
def test_verification_chunks_return_a_logits_row_per_token_and_match_hf(tiny_llama, hf_attention, native):
    """A speculative step: decodes with 1 + k tokens each (two of 4 tokens, one of 3: two short-chunk
    groups on the torch path) beside a plain decode and a prefill chunk; ``num_logits`` rows per
    chunk, in chunk order, each equal to the HF forward's at its position."""
    seqs = [random_ids(60 + i, n) for i, n in enumerate([40, 23, 37, 50, 30])]
    references = [reference_logits(tiny_llama, hf_attention, s) for s in seqs]
    runner = make_runner(tiny_llama, num_blocks=64, block_size=16, native=native)
    tables = shuffled_tables(64, [3, 2, 3, 4, 2], seed=7)
    cut = [36, 20, 33, 49, 10]  # tokens already computed
    runner.execute([ScheduledChunk(s[:c], 0, t) for s, c, t in zip(seqs, cut, tables)])
    chunks = [ScheduledChunk(seqs[0][36:40], 36, tables[0], num_logits=4),
              ScheduledChunk(seqs[1][20:23], 20, tables[1], num_logits=3),
              ScheduledChunk(seqs[4][10:30], 10, tables[4]),
              ScheduledChunk(seqs[2][33:37], 33, tables[2], num_logits=4),
              ScheduledChunk(seqs[3][49:50], 49, tables[3])]
    logits = runner.execute(chunks)
    expected = torch.cat([references[0][36:40], references[1][20:23], references[4][-1:], references[2][33:37],
                          references[3][-1:]])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(CoreKVError, match="num_logits"):
        runner.execute([ScheduledChunk(seqs[0][36:38], 36, tables[0], num_logits=3)])


def test_step_writes_only_its_own_slots(tiny_llama):
    runner = make_runner(tiny_llama, num_blocks=8, block_size=16)
    pool = runner.kv_pool
    runner.execute([ScheduledChunk(random_ids(30, 20), 0, [6, 2])])
    touched = {b for b in range(8) if torch.count_nonzero(pool.storage[b])}
    assert touched == {6, 2}
    # positions 20..31 of block 2 were not written
    assert torch.count_nonzero(pool.storage[2][:, :, 4:]) == 0


@ATTENTION_PATHS
def test_prefix_blocks_from_another_sequence_are_reused(tiny_llama, hf_attention, native):
    """A sequence whose first blocks were computed by another one (a prefix-cache hit) only
    computes its own suffix, and gets the same logits."""
    shared = random_ids(40, 32)
    a, b = shared + random_ids(41, 10), shared + random_ids(42, 13)
    runner = make_runner(tiny_llama, num_blocks=16, block_size=16, native=native)
    runner.execute([ScheduledChunk(a, 0, [9, 4, 11])])
    logits = runner.execute([ScheduledChunk(b[32:], 32, [9, 4, 7])])
    torch.testing.assert_close(logits[0], reference_logits(tiny_llama, hf_attention, b)[-1], rtol=1e-5, atol=1e-5)


def test_model_without_metadata_is_plain_hf(tiny_llama, hf_attention):
    """Outside the runner the loaded model still works as an ordinary HF model (generate, forward)."""
    ids = torch.tensor([random_ids(50, 12)])
    ours = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with hf_attention(tiny_llama) as model:
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs)


def test_bad_chunks_are_refused(tiny_llama):
    runner = make_runner(tiny_llama, num_blocks=4, block_size=16)
    with pytest.raises(CoreKVError, match="chunks is empty"):
        runner.execute([])
    with pytest.raises(CoreKVError, match="needs 2 blocks"):
        runner.execute([ScheduledChunk(list(range(3, 20)), 0, [0])])
    with pytest.raises(CoreKVError, match=r"outside \[0, 4\)"):
        runner.execute([ScheduledChunk([5], 0, [4])])
    with pytest.raises(CoreKVError, match="start_pos"):
        runner.execute([ScheduledChunk([], 0, [0])])


def test_pool_must_match_the_model(tiny_llama):
    pool = KVPool(tiny_llama.num_layers + 1, 4, 16, tiny_llama.num_kv_heads, tiny_llama.head_dim)
    with pytest.raises(CoreKVError, match="does not match"):
        ModelRunner(tiny_llama, pool)


# ---- SmolLM2 (the real model, float32) ------------------------------------------------------

def greedy_with_runner(runner, prompts, max_new_tokens, chunk_size, eos_token_ids):
    """Greedy-decode every prompt together: prompts are prefilled ``chunk_size`` tokens per step,
    alongside the other prompts' decode tokens (continuous batching by hand); a sequence stops
    after ``max_new_tokens`` or an end-of-sequence token, as ``generate`` does."""
    bs = runner.block_size
    tables = shuffled_tables(runner.kv_pool.num_blocks,
                             [-(-(len(p) + max_new_tokens) // bs) for p in prompts], seed=7)
    done = [0] * len(prompts)  # prompt tokens already in the pool
    outputs = [[] for _ in prompts]
    def finished(out):
        return len(out) >= max_new_tokens or (out and out[-1] in eos_token_ids)

    while not all(finished(o) for o in outputs):
        chunks, owners = [], []
        for i, prompt in enumerate(prompts):
            if finished(outputs[i]):
                continue
            if done[i] < len(prompt):
                end = min(len(prompt), done[i] + chunk_size)
                chunks.append(ScheduledChunk(prompt[done[i]:end], done[i], tables[i]))
            else:
                pos = len(prompt) + len(outputs[i]) - 1
                chunks.append(ScheduledChunk([outputs[i][-1]], pos, tables[i]))
            owners.append(i)
        logits = runner.execute(chunks)
        for row, i in enumerate(owners):
            if done[i] < len(prompts[i]):
                done[i] += len(chunks[row].token_ids)
                if done[i] < len(prompts[i]):
                    continue
            outputs[i].append(int(logits[row].argmax()))
    return outputs


def test_smollm2_greedy_equals_hf_generate(smollm2, hf_attention):
    prompts = [
        smollm2.encode_prompt([{"role": "user", "content": "What is the capital of France?"}]),
        smollm2.encode_prompt("The three laws of thermodynamics are"),
        smollm2.encode_prompt([{"role": "system", "content": "You are a concise assistant. " * 10},
                               {"role": "user", "content": "Name two prime numbers."}]),
        smollm2.encode_prompt("Summarise: " + "Blocks of keys and values are paged in and out of memory. " * 30),
    ]
    max_new_tokens = 24
    expected = []
    # NOTE: one intra-op thread for the reference: on a busy 2-core machine, generate's many tiny
    # ops under two spinning OpenMP threads were measured 30x slower than on one.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with hf_attention(smollm2) as model:
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False)
                expected.append(out[0, len(prompt):].tolist())
    finally:
        torch.set_num_threads(num_threads)
    for native in (False, True):  # the torch path and engine.compile's native kernels
        runner = make_runner(smollm2, num_blocks=64, block_size=16, native=native)
        outputs = greedy_with_runner(runner, prompts, max_new_tokens, 48, smollm2.eos_token_ids)
        assert outputs == expected, f"native={native}"


def test_smollm2_logits_match_hf_with_block_size_32(smollm2, hf_attention):
    prompt = smollm2.encode_prompt("Paged attention stores keys and values in fixed-size blocks, so " * 4)
    reference = reference_logits(smollm2, hf_attention, prompt)
    runner = make_runner(smollm2, num_blocks=16, block_size=32)
    (table,) = shuffled_tables(16, [-(-len(prompt) // 32)], seed=1)
    split = len(prompt) // 2
    first = runner.execute([ScheduledChunk(prompt[:split], 0, table)])
    second = runner.execute([ScheduledChunk(prompt[split:], split, table)])
    torch.testing.assert_close(first[0], reference[split - 1], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(second[0], reference[-1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("suffix_lengths", [(3, 20, 40), (1, 1, 1)])
@ATTENTION_PATHS
def test_decodes_sharing_leading_blocks_match_hf(tiny_llama, hf_attention, suffix_lengths, native):
    """Decodes whose block tables start with the same blocks (a shared system prompt) take the
    cascade path: the shared blocks are attended once for all of them."""
    shared = random_ids(60, 48)  # three full blocks of 16
    seqs = [shared + random_ids(61 + i, n) for i, n in enumerate(suffix_lengths)]
    runner = make_runner(tiny_llama, num_blocks=24, block_size=16, native=native)
    prefix_table = [17, 3, 11]
    runner.execute([ScheduledChunk(shared, 0, prefix_table)])
    free = [b for b in range(24) if b not in prefix_table]
    random.Random(9).shuffle(free)
    tables = [prefix_table + free[3 * i:3 * i + 3] for i in range(3)]
    rest = [ScheduledChunk(s[48:-1], 48, t) for s, t in zip(seqs, tables) if len(s) > 49]
    if rest:
        runner.execute(rest)
    logits = runner.execute([ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)])
    expected = torch.stack([reference_logits(tiny_llama, hf_attention, s)[-1] for s in seqs])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_cascade_groups_share_the_common_leading_blocks_of_rows_with_the_same_first_block():
    tables = [[1, 2, 3, 9], [7, 8], [1, 2, 4], [5], [1, 2, 3, 6], [7, 8, 10], [11, 12]]
    assert cascade_groups(tables) == [([0, 2, 4], 2), ([1, 5], 1), ([3, 6], 0)]
    # each row keeps at least its own last block; a lone row or a one-block row shares nothing
    assert cascade_groups([[4, 5], [4, 5]]) == [([0, 1], 1)]
    assert cascade_groups([[4], [4]]) == [([0, 1], 0)]
    assert cascade_groups([[4, 5, 6]]) == [([0], 0)]
    # a group whose cascade would save gathering fewer than min_saved_blocks blocks stays plain
    assert cascade_groups(tables, min_saved_blocks=2) == [([0, 2, 4], 2), ([1, 3, 5, 6], 0)]
    assert cascade_groups(tables, min_saved_blocks=5) == [([0, 1, 2, 3, 4, 5, 6], 0)]


def test_small_decode_groups_take_the_plain_path_by_default_and_match_the_cascade(tiny_llama):
    """With the default threshold three decodes sharing three blocks are not worth a cascade; the
    plain path gives the same logits as the cascade path."""
    shared = random_ids(60, 48)
    seqs = [shared + random_ids(61 + i, n) for i, n in enumerate((3, 20, 40))]
    tables = [[17, 3, 11] + [20 + 3 * i, 21 + 3 * i, 22 + 3 * i] for i in range(3)]
    results = []
    for threshold in (CASCADE_MIN_SAVED_TOKENS, 0):
        runner = make_runner(tiny_llama, num_blocks=32, block_size=16, cascade_min_saved_tokens=threshold)
        runner.execute([ScheduledChunk(s[:-1], 0, t) for s, t in zip(seqs, tables)])
        groups = []
        original = runner._decode_group
        runner._decode_group = lambda *a: groups.append(a[-1]) or original(*a)
        results.append(runner.execute([ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)]))
        assert groups == ([0] if threshold else [3])  # shared blocks per decode group
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(CoreKVError, match="cascade_min_saved_tokens"):
        make_runner(tiny_llama, cascade_min_saved_tokens=-1)



def test_native_decodes_take_no_cascade_by_default_and_match_the_cascade(tiny_llama):
    """By default (``cascade_min_saved_tokens=None``) a native runner's decodes read a shared
    prefix in place, in one group with no shared blocks, even where the cascade would save every
    shared block; asked for (threshold 0) it takes the cascade, with the same logits. The torch
    path's default stays CASCADE_MIN_SAVED_TOKENS."""
    assert make_runner(tiny_llama, cascade_min_saved_tokens=None)._cascade_min_saved_blocks == \
        CASCADE_MIN_SAVED_TOKENS // 16
    shared = random_ids(62, 64)
    seqs = [shared + random_ids(63 + i, n) for i, n in enumerate((3, 20, 40, 7))]
    tables = [[17, 3, 11, 5] + [20 + 3 * i, 21 + 3 * i, 22 + 3 * i] for i in range(4)]
    results = []
    for threshold in (None, 0):
        runner = make_runner(tiny_llama, num_blocks=40, block_size=16, cascade_min_saved_tokens=threshold, native=True)
        runner.execute([ScheduledChunk(s[:-1], 0, t) for s, t in zip(seqs, tables)])
        groups = []
        original = runner._decode_group
        runner._decode_group = lambda *a: groups.append(a[-1]) or original(*a)
        results.append(runner.execute([ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)]))
        assert groups == ([0] if threshold is None else [4])  # shared blocks per decode group
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)

def test_equal_prefill_chunks_after_the_same_cached_blocks_take_the_group_path_and_match_hf(tiny_llama, hf_attention):
    """W2's shape in small: prompts sharing a cached prefix, their equal-length remainders in one
    step. Those form a PrefillGroup (shared blocks attended once, one batched causal call); a
    chunk of another length and one starting mid-block keep their own masked call. Every chunk's
    logits match HF's, and the group's match the masked path's and the native kernel's (which
    takes all five chunks in one call)."""
    shared = random_ids(70, 48)  # three blocks of 16, computed once
    tails = [random_ids(71 + i, n) for i, n in enumerate((20, 20, 20, 9))]
    offcut = random_ids(79, 60)  # its second chunk starts at position 40: mid-block
    results = []
    for threshold, native in ((0, False), (10**6, False), (0, True)):
        runner = make_runner(tiny_llama, num_blocks=40, block_size=16, cascade_min_saved_tokens=threshold,
                             native=native)
        prefix_table = [30, 5, 12]
        runner.execute([ScheduledChunk(shared, 0, prefix_table), ScheduledChunk(offcut[:40], 0, [1, 2, 3, 4])])
        tables = [prefix_table + [14 + 2 * i, 15 + 2 * i] for i in range(len(tails))]
        chunks = [ScheduledChunk(t, 48, table) for t, table in zip(tails, tables)]
        chunks.insert(2, ScheduledChunk(offcut[40:], 40, [1, 2, 3, 4]))
        groups, plain = runner._prefill_groups(chunks)
        grouped = threshold == 0 and not native
        assert (groups, plain) == (([([0, 1, 3], 3)], [2, 4]) if grouped else ([], [0, 1, 2, 3, 4]))
        results.append(runner.execute(chunks))
    expected = [reference_logits(tiny_llama, hf_attention, shared + t)[-1] for t in tails]
    expected.insert(2, reference_logits(tiny_llama, hf_attention, offcut)[-1])
    torch.testing.assert_close(results[0], torch.stack(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[2], results[1], rtol=1e-5, atol=1e-5)


@ATTENTION_PATHS
def test_decodes_in_two_prefix_groups_and_a_loner_match_hf(tiny_llama, hf_attention, native):
    """Two groups of decodes, each sharing its own prefix blocks, and one sequence sharing nothing,
    submitted interleaved: each group attends its prefix once, the loner takes the plain path, and
    every row's logits come back in the caller's order."""
    prefixes = [random_ids(80, 32), random_ids(81, 48)]
    prefix_tables = [[4, 9], [13, 2, 20]]
    runner = make_runner(tiny_llama, num_blocks=40, block_size=16, native=native)
    runner.execute([ScheduledChunk(p, 0, t) for p, t in zip(prefixes, prefix_tables)])
    free = iter([b for b in range(40) if b not in (4, 9, 13, 2, 20)])
    seqs, tables = [], []
    for i, which in enumerate([0, 1, None, 0, 1, 1]):
        tail = random_ids(90 + i, 5 + 7 * i)
        seqs.append((prefixes[which] if which is not None else random_ids(99, 20)) + tail)
        own = [next(free) for _ in range(-(-len(seqs[-1]) // 16) - (0 if which is None else len(prefix_tables[which])))]
        tables.append((prefix_tables[which] if which is not None else []) + own)
    runner.execute([ScheduledChunk(s[len(prefixes[w]) if w is not None else 0:-1],
                                   len(prefixes[w]) if w is not None else 0, t)
                    for s, t, w in zip(seqs, tables, [0, 1, None, 0, 1, 1])])
    logits = runner.execute([ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)])
    expected = torch.stack([reference_logits(tiny_llama, hf_attention, s)[-1] for s in seqs])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@ATTENTION_PATHS
def test_bfloat16_runner_tracks_hf_bfloat16(hf_attention, native):
    """bfloat16 end to end (pool, masks, cascade merge): same greedy argmax as HF's own bf16 forward
    and logits within bf16 rounding."""
    from corekv.engine.tiny_model import make_tiny_llama

    loaded = make_tiny_llama(dtype="bfloat16")
    shared = random_ids(70, 32)
    seqs = [shared + random_ids(71 + i, 9 + i) for i in range(3)]
    runner = make_runner(loaded, num_blocks=16, block_size=16, native=native)
    tables = [[5, 9, 1], [5, 9, 2], [5, 9, 3]]
    runner.execute([ScheduledChunk(shared, 0, tables[0])])
    runner.execute([ScheduledChunk(s[32:-1], 32, t) for s, t in zip(seqs, tables)])
    logits = runner.execute([ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)])
    expected = torch.stack([reference_logits(loaded, hf_attention, s)[-1] for s in seqs])
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.01)  # logits span ~[-0.6, 0.6]
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_sliding_window_layers_are_refused_at_run_time_too():
    """check_architecture refuses such configs at load; if one slips through (config edited after
    loading), the attention function refuses to run rather than attend over the whole context."""
    from transformers import MistralConfig, MistralForCausalLM

    from corekv.engine.models import prepare_model
    from corekv.engine.tiny_model import make_byte_tokenizer

    config = MistralConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=None)
    loaded = prepare_model(MistralForCausalLM(config), make_byte_tokenizer(), device="cpu")
    loaded.model.config.sliding_window = 8
    with pytest.raises(CoreKVError, match="sliding-window"):
        make_runner(loaded, num_blocks=4).execute([ScheduledChunk([5, 6, 7], 0, [0])])
