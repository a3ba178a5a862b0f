"""The engine's logprobs and penalties end to end on the tiny Llama (and once on SmolLM2): a
generated token's logprob is torch.log_softmax of transformers' own logits there, whatever
penalties or temperature picked it; greedy with penalties equals transformers' generate with
them; min_tokens holds back EOS, stop tokens and stop strings."""
from __future__ import annotations

import pytest
import torch

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.requests import RequestRejectedError
from corekv.engine.sampling import SamplingParams

PROMPTS = ["hello world, this is a longer prompt about blocks and caches", "abc",
           [5, 6, 7, 8] * 9, [{"role": "user", "content": "What is a KV cache?"}]]
#: float32 on both paths; the paged attention sums in another order than SDPA
ATOL = 1e-4


def make_engine(loaded, *, num_blocks=64, block_size=16, budget=32, **kwargs):
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=num_blocks, block_size=block_size,
                                                   max_num_batched_tokens=budget, **kwargs),
                 cache=CacheConfig(backend="radix"))
    return Engine(cfg, model=loaded)


def hf_log_softmax(loaded, hf_attention, token_ids):
    """``[len(token_ids), vocab]``: row ``i`` is the model's log-distribution of token ``i + 1``."""
    with hf_attention(loaded) as model, torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_logprobs_are_the_models(loaded, hf_attention, output, num_top):
    for completion in output.outputs:
        ids = list(output.prompt_token_ids) + completion.token_ids
        expected = hf_log_softmax(loaded, hf_attention, ids)[len(output.prompt_token_ids) - 1:-1]
        assert len(completion.logprobs) == len(completion.token_ids)
        for position, (token_id, got) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert got.token_id == token_id
            assert got.logprob == pytest.approx(expected[position, token_id].item(), abs=ATOL)
            values, top_ids = expected[position].topk(num_top)
            assert [lp for _, lp in got.top] == pytest.approx(values.tolist(), abs=ATOL)
            assert {t for t, _ in got.top} <= set(expected[position].topk(num_top + 2)[1].tolist())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=5, ignore_eos=True, logprobs=5, n=2),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2, repetition_penalty=1.6,
                   frequency_penalty=0.5, logit_bias={100: 3.0}),
], ids=["greedy", "sampled_n2", "greedy_with_penalties"])
def test_logprobs_are_log_softmax_of_transformers_logits_at_the_chosen_tokens(tiny_llama, hf_attention,
                                                                              params):
    with make_engine(tiny_llama) as engine:
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=1))  # a cached prefix for the rest
        outputs = engine.generate(PROMPTS, params)  # batched, chunked (budget 32), prefix hit
    for output in outputs:
        assert len(output.outputs) == params.n
        assert_logprobs_are_the_models(tiny_llama, hf_attention, output, params.logprobs)


def test_penalised_logprobs_are_the_raw_models_not_the_sampled_distributions(tiny_llama):
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    with make_engine(tiny_llama) as engine:
        free = engine.generate(PROMPTS[0], plain)[0].outputs[0]
        biased = engine.generate(PROMPTS[0], SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1, logit_bias={77: 100}))[0].outputs[0]
    assert biased.token_ids == [77] * 6  # the bias picks the token ...
    assert biased.logprobs[0].logprob < free.logprobs[0].logprob  # ... the model still rates it low
    assert biased.logprobs[0].top == free.logprobs[0].top


def test_no_logprobs_unless_asked(tiny_llama):
    with make_engine(tiny_llama) as engine:
        out = engine.generate("abc", SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.outputs[0].logprobs is None


def hf_generate(loaded, hf_attention, token_ids, max_new_tokens, **kwargs):
    with hf_attention(loaded) as model, torch.no_grad():
        x = torch.tensor([token_ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(token_ids):].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_repetition_penalty_equals_transformers_generate(tiny_llama, hf_attention, penalty):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
    with make_engine(tiny_llama) as engine:
        outputs = engine.generate(PROMPTS, params)
    for output in outputs:
        expected = hf_generate(tiny_llama, hf_attention, output.prompt_token_ids, 16,
                               repetition_penalty=penalty, min_new_tokens=16)
        assert output.token_ids == expected


def test_greedy_with_logit_bias_equals_transformers_sequence_bias(tiny_llama, hf_attention):
    bias = {40: 4.0, 41: 3.5, 200: -100.0}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=bias)
    with make_engine(tiny_llama) as engine:
        output = engine.generate(PROMPTS[0], params)[0]
    expected = hf_generate(tiny_llama, hf_attention, output.prompt_token_ids, 12, min_new_tokens=12,
                           sequence_bias={(t,): b for t, b in bias.items()})
    assert output.token_ids == expected
    assert set(output.token_ids) & {40, 41}, "the bias must be strong enough to matter here"


def test_greedy_with_frequency_and_presence_penalties_equals_a_reference_loop(tiny_llama, hf_attention):
    """transformers has no OpenAI penalties: the reference applies them to its logits by hand."""
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=0.6,
                            presence_penalty=0.4)
    with make_engine(tiny_llama) as engine:
        output = engine.generate(PROMPTS[2], params)[0]
    ids = list(output.prompt_token_ids)
    for _ in range(14):
        with hf_attention(tiny_llama) as model, torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        generated = ids[len(output.prompt_token_ids):]
        for token_id in set(generated):
            logits[token_id] -= 0.6 * generated.count(token_id) + 0.4
        ids.append(int(logits.argmax()))
    assert output.token_ids == ids[len(output.prompt_token_ids):]
    plain = hf_generate(tiny_llama, hf_attention, output.prompt_token_ids, 14, min_new_tokens=14)
    assert output.token_ids != plain, "the penalties must change this output"


def test_min_tokens_holds_back_eos_and_stop_tokens(tiny_llama):
    eos = next(iter(tiny_llama.eos_token_ids))
    with make_engine(tiny_llama) as engine:
        # NOTE: a +100 bias makes the token the argmax at every step: only min_tokens holds it back
        forced_eos = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100}, min_tokens=5)
        out = engine.generate("abc", forced_eos)[0]
        assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
        assert out.finish_reason == "stop"
        forced_stop = SamplingParams(max_tokens=20, temperature=0.8, seed=3, logit_bias={90: 100},
                                     stop_token_ids=[90], min_tokens=7)
        out = engine.generate("abc", forced_stop)[0]
        assert len(out.token_ids) == 8 and out.token_ids[-1] == 90 and out.finish_reason == "stop"
        ignored = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={eos: 100}, min_tokens=2,
                                 ignore_eos=True)
        assert engine.generate("abc", ignored)[0].token_ids == [eos] * 4  # EOS stops nothing then


def test_min_tokens_holds_back_a_stop_string(tiny_llama):
    with make_engine(tiny_llama) as engine:
        free = engine.generate("abc", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
        stop = free.text[:1]  # the first character: a stop string at once
        early = engine.generate("abc", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                      stop=[stop]))[0]
        late = engine.generate("abc", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                     stop=[stop], min_tokens=10))[0]
    assert early.text == "" and early.finish_reason == "stop"
    assert len(late.token_ids) >= 10
    assert late.token_ids == free.token_ids[:len(late.token_ids)]
    assert free.text.startswith(late.text) and late.text.startswith(stop)


def test_a_logit_bias_outside_the_vocabulary_is_rejected_at_admission(tiny_llama):
    with make_engine(tiny_llama) as engine:
        with pytest.raises(RequestRejectedError, match=r"logit_bias names token ids \[320\] outside the "
                                                       r"model's vocabulary \[0, 320\)"):
            engine.add_request("abc", SamplingParams(logit_bias={320: 1}))
        assert not engine.has_unfinished_requests


def test_smollm2_greedy_chat_logprobs_are_transformers(smollm2, hf_attention):
    """Golden: the real model, float32, top-5 of a 49,152-token vocabulary."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    with make_engine(smollm2, num_blocks=32, budget=64) as engine:
        output = engine.generate([messages], SamplingParams(max_tokens=12, temperature=0.0, logprobs=5))[0]
    assert_logprobs_are_the_models(smollm2, hf_attention, output, 5)
    assert output.outputs[0].logprobs[0].top[0][0] == output.token_ids[0]  # greedy is the top-1
