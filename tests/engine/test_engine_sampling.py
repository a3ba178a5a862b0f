"""SamplingParams validation and the batched Sampler: greedy is argmax, filters do what they say,
seeded rows reproduce whatever shares the batch, and sampling follows softmax(logits / T)."""
import dataclasses
import math

import pytest
import torch

import corekv
from corekv.engine.sampling import Sampler, SamplingParams, SamplingParamsError, make_generator
from corekv.errors import CoreKVError

# A small distribution with known probabilities: [0.5, 0.3, 0.15, 0.05].
KNOWN_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
KNOWN_LOGITS = KNOWN_PROBS.log()


def sample_many(logits_row, params, num_samples, seed=0):
    """Draw num_samples tokens from one logits row, all from one seeded generator (one batch)."""
    generator = torch.Generator().manual_seed(seed)
    logits = logits_row.unsqueeze(0).expand(num_samples, -1).contiguous()
    return Sampler()(logits, [params] * num_samples, [generator] * num_samples)


def counts(token_ids, vocab_size):
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size)


# ---------------------------------------------------------------- SamplingParams validation

@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "SamplingParams.max_tokens must be an integer >= 1, got 0; pass the number "
                        "of new tokens to generate, e.g. max_tokens=32"),
    ({"max_tokens": True}, "SamplingParams.max_tokens must be an integer >= 1, got True; pass the "
                           "number of new tokens to generate, e.g. max_tokens=32"),
    ({"temperature": -0.5}, "SamplingParams.temperature must be 0 or a number in [1e-30, 100], got "
                            "-0.5; use 0 for greedy decoding or e.g. 0.7 for sampling"),
    ({"temperature": math.nan}, "SamplingParams.temperature must be 0 or a number in [1e-30, 100], "
                                "got nan; use 0 for greedy decoding or e.g. 0.7 for sampling"),
    # an attacker's values that once passed and failed inside engine.step() (issue 37)
    ({"temperature": 10**20}, "SamplingParams.temperature must be 0 or a number in [1e-30, 100], "
                              "got 100000000000000000000; use 0 for greedy decoding or e.g. 0.7 for "
                              "sampling"),
    ({"temperature": 1e-300}, "SamplingParams.temperature must be 0 or a number in [1e-30, 100], "
                              "got 1e-300; use 0 for greedy decoding or e.g. 0.7 for sampling"),
    ({"temperature": 10**400}, "SamplingParams.temperature must be 0 or a number in [1e-30, 100], "
                               "got " + "1" + "0" * 76 + "...; use 0 for greedy decoding or e.g. 0.7 for sampling"),
    ({"top_k": -1}, "SamplingParams.top_k must be an integer >= 0, got -1; use 0 to disable top-k "
                    "or e.g. top_k=50"),
    ({"top_p": 1.5}, "SamplingParams.top_p must be in (0, 1], got 1.5; use 1.0 to disable nucleus "
                     "sampling or e.g. top_p=0.9"),
    ({"top_p": 0}, "SamplingParams.top_p must be in (0, 1], got 0; use 1.0 to disable nucleus "
                   "sampling or e.g. top_p=0.9"),
    ({"min_p": 1.01}, "SamplingParams.min_p must be in [0, 1], got 1.01; use 0.0 to disable min-p "
                      "or e.g. min_p=0.05"),
    ({"seed": -1}, "SamplingParams.seed must be None or an integer in [0, 9223372036854775807], "
                   "got -1; pass e.g. seed=1234 for reproducible sampling, or None"),
    ({"seed": "42"}, "SamplingParams.seed must be None or an integer in [0, 9223372036854775807], "
                     "got '42'; pass e.g. seed=1234 for reproducible sampling, or None"),
    ({"stop": ["ok", ""]}, "SamplingParams.stop must be a non-empty string or a list of non-empty "
                           "strings, got ['ok', '']; pass e.g. stop=['\\n\\n', 'User:'], or () for none"),
    ({"stop": 7}, "SamplingParams.stop must be a non-empty string or a list of non-empty strings, "
                  "got 7; pass e.g. stop=['\\n\\n', 'User:'], or () for none"),
    ({"stop_token_ids": [2, -3]}, "SamplingParams.stop_token_ids must be a list of token ids "
                                  "(integers >= 0), got [2, -3]; pass e.g. stop_token_ids=[2], "
                                  "or () for none"),
    ({"ignore_eos": 1}, "SamplingParams.ignore_eos must be a bool, got 1; pass ignore_eos=True or "
                        "ignore_eos=False"),
    ({"n": 0}, "SamplingParams.n must be an integer >= 1, got 0; pass the number of completions "
               "wanted per prompt, e.g. n=1"),
    ({"presence_penalty": 2.5}, "SamplingParams.presence_penalty must be a number in [-2, 2], got 2.5; "
                                "use 0 to disable it or e.g. presence_penalty=0.5 (negative values "
                                "encourage repeats)"),
    ({"frequency_penalty": math.inf}, "SamplingParams.frequency_penalty must be a number in [-2, 2], "
                                      "got inf; use 0 to disable it or e.g. frequency_penalty=0.5 "
                                      "(negative values encourage repeats)"),
    ({"repetition_penalty": 0.0}, "SamplingParams.repetition_penalty must be a number in [0.01, 100], "
                                  "got 0.0; use 1.0 to disable it or e.g. repetition_penalty=1.2 (< 1 "
                                  "encourages repeats)"),
    ({"repetition_penalty": 10**20}, "SamplingParams.repetition_penalty must be a number in [0.01, 100], "
                                     "got 100000000000000000000; use 1.0 to disable it or e.g. "
                                     "repetition_penalty=1.2 (< 1 encourages repeats)"),
    ({"repetition_penalty": 1e-300}, "SamplingParams.repetition_penalty must be a number in [0.01, 100], "
                                     "got 1e-300; use 1.0 to disable it or e.g. "
                                     "repetition_penalty=1.2 (< 1 encourages repeats)"),
    ({"logit_bias": {3: 101}}, "SamplingParams.logit_bias must be a mapping of token ids to biases in "
                               "[-100, 100], got {3: 101}; pass e.g. logit_bias={50256: -100} (token "
                               "id to a bias in [-100, 100]), or {} for none"),
    ({"logit_bias": {"3": 1}}, "SamplingParams.logit_bias must be a mapping of token ids (integers >= "
                               "0) to biases, got {'3': 1}; pass e.g. logit_bias={50256: -100} (token "
                               "id to a bias in [-100, 100]), or {} for none"),
    ({"logit_bias": [(3, 1), (3, 2)]}, "SamplingParams.logit_bias must be a mapping with each token id "
                                       "once, got [(3, 1), (3, 2)]; pass e.g. logit_bias={50256: -100} "
                                       "(token id to a bias in [-100, 100]), or {} for none"),
    ({"min_tokens": 17}, "SamplingParams.min_tokens must be an integer in [0, max_tokens=16], got 17; "
                         "use 0 to let the model stop at once, or raise max_tokens"),
    ({"logprobs": 21}, "SamplingParams.logprobs must be None or an integer in [0, 20], got 21; use "
                       "None for none, 0 for the sampled token's only, or e.g. logprobs=5"),
    ({"logprobs": True}, "SamplingParams.logprobs must be None or an integer in [0, 20], got True; use "
                         "None for none, 0 for the sampled token's only, or e.g. logprobs=5"),
])
def test_invalid_sampling_params_raise_a_message_naming_field_value_and_fix(kwargs, message):
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message
    assert isinstance(excinfo.value, CoreKVError) and isinstance(excinfo.value, ValueError)


def test_sampling_params_is_the_public_name_and_normalises_sequences():
    params = corekv.SamplingParams(stop="###", stop_token_ids=[2, 7])
    assert params.stop == ("###",) and params.stop_token_ids == (2, 7)
    assert corekv.SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert corekv.SamplingParams is SamplingParams
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0


def test_logit_bias_is_kept_as_sorted_pairs_and_processors_are_flagged():
    params = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert params.logit_bias == ((2, 0.5), (9, -1.0)) and dict(params.logit_bias) == {2: 0.5, 9: -1.0}
    assert params.has_logits_processors
    assert hash(params) == hash(SamplingParams(logit_bias=[(2, 0.5), (9, -1)]))
    assert not SamplingParams(logprobs=5, temperature=0).has_logits_processors
    for kwargs in ({"min_tokens": 1}, {"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
                   {"repetition_penalty": 1.1}):
        assert SamplingParams(**kwargs).has_logits_processors, kwargs


def test_is_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams().is_greedy


def test_unknown_keyword_is_a_type_error_and_from_dict_suggests_the_closest_field():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)
    with pytest.raises(SamplingParamsError, match=r"no field 'temprature'; did you mean 'temperature'\?"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(SamplingParamsError, match=r"no field 'zzz'; valid keys: max_tokens, "):
        SamplingParams.from_dict({"zzz": 1})
    with pytest.raises(SamplingParamsError, match="expects a mapping"):
        SamplingParams.from_dict([("top_p", 0.5)])
    assert SamplingParams.from_dict({"top_p": 0.5, "stop": "x"}) == SamplingParams(top_p=0.5, stop=("x",))


# ---------------------------------------------------------------- generators

def test_make_generator_seeds_completion_i_with_seed_plus_i():
    params = SamplingParams(seed=1234, n=3)
    for index in range(3):
        expected = torch.rand(8, generator=torch.Generator().manual_seed(1234 + index))
        assert torch.equal(torch.rand(8, generator=make_generator(params, index)), expected)
    assert make_generator(SamplingParams(seed=None)) is None
    with pytest.raises(ValueError, match=r"index must be an integer in \[0, 3\) \(params.n=3\), got 3"):
        make_generator(params, 3)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        make_generator({"seed": 1})


# ---------------------------------------------------------------- greedy

def test_greedy_rows_are_exact_argmax_even_next_to_sampled_rows():
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1).tolist()
    assert Sampler()(logits, [SamplingParams(temperature=0)] * 6, [None] * 6) == argmax
    mixed = [SamplingParams(temperature=0) if i % 2 == 0 else SamplingParams(seed=i) for i in range(6)]
    picked = Sampler()(logits, mixed, [make_generator(p) for p in mixed])
    assert picked[0::2] == argmax[0::2]


def test_greedy_decoding_matches_transformers_generate_on_a_tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:].tolist()
        ids = prompt
        for _ in range(12):
            logits = model(ids).logits[:, -1, :].float()
            token_id = Sampler()(logits, [SamplingParams(temperature=0)], [None])[0]
            ids = torch.cat([ids, torch.tensor([[token_id]])], dim=1)
    assert ids[0, prompt.shape[1]:].tolist() == expected


def test_top_k_one_and_tiny_top_p_and_min_p_one_and_tiny_temperature_are_greedy():
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(top_k=1, seed=3), SamplingParams(top_p=1e-6, seed=3),
                   SamplingParams(min_p=1.0, seed=3), SamplingParams(temperature=1e-30, seed=3),
                   SamplingParams(temperature=5.0, top_k=1, top_p=0.5, seed=3)):
        for attempt in range(3):
            generators = [torch.Generator().manual_seed(attempt * 10 + i) for i in range(8)]
            assert Sampler()(logits, [params] * 8, generators) == argmax, params


# ---------------------------------------------------------------- filters

def test_top_k_keeps_only_the_k_most_likely_tokens():
    seen = counts(sample_many(KNOWN_LOGITS, SamplingParams(top_k=2), 4000), 4)
    assert seen[2] == 0 and seen[3] == 0
    assert seen[0] > 0 and seen[1] > 0


def test_top_p_keeps_the_smallest_set_reaching_the_mass_and_renormalises():
    # Mass before each token: 0, 0.5, 0.8, 0.95 -> top_p=0.7 keeps tokens 0 and 1 (0.5 / 0.8 = 0.625).
    seen = counts(sample_many(KNOWN_LOGITS, SamplingParams(top_p=0.7), 8000), 4)
    assert seen[2] == 0 and seen[3] == 0
    assert abs(seen[0].item() / 8000 - 0.625) < 5 * math.sqrt(0.625 * 0.375 / 8000)


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    # min_p=0.2 -> threshold 0.2 * 0.5 = 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    seen = counts(sample_many(KNOWN_LOGITS, SamplingParams(min_p=0.2), 8000), 4)
    assert seen[3] == 0
    assert (seen[:3] > 0).all()
    assert abs(seen[2].item() / 8000 - 0.15 / 0.95) < 5 * math.sqrt(0.158 * 0.842 / 8000)


def test_masked_logits_are_never_sampled():
    logits = torch.tensor([1.0, -math.inf, 0.5, -math.inf, 0.0])
    seen = counts(sample_many(logits, SamplingParams(temperature=3.0), 3000), 5)
    assert seen[1] == 0 and seen[3] == 0 and (seen[[0, 2, 4]] > 0).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    num_samples = 20000
    expected = torch.softmax(logits / temperature, dim=-1)
    freqs = counts(sample_many(logits, SamplingParams(temperature=temperature), num_samples, seed=7),
                   6).double() / num_samples
    # NOTE: 5 standard deviations per bin, seeded: loose enough never to flake, tight enough to catch
    # a missing temperature (T=0.5 vs T=1 moves token 0 by ~0.2).
    sigma = (expected * (1 - expected) / num_samples).sqrt().double()
    assert ((freqs - expected.double()).abs() <= 5 * sigma + 1e-4).all(), (freqs, expected)


def reference_probs(logits, params):
    """A plain full-sort reference of temperature, top-k, top-p, min-p (in that order)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    sorted_probs = probs[order]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k:
        keep[params.top_k:] = False
    kept = sorted_probs * keep
    kept = kept / kept.sum()
    if params.top_p < 1:
        keep &= (kept.cumsum(0) - kept) < params.top_p
        kept = sorted_probs * keep
        kept = kept / kept.sum()
    keep &= kept >= params.min_p * kept[0]
    result = torch.zeros_like(probs)
    result[order[keep]] = sorted_probs[keep]
    return result / result.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=2.0, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.9),  # nucleus of hundreds of tokens: wider candidates
    SamplingParams(temperature=0.8, top_k=300, top_p=0.8, min_p=0.05),
], ids=["temperature", "min_p", "top_k", "wide_top_p", "all_filters"])
def test_sampling_matches_a_full_sort_reference_over_a_thousand_tokens(params):
    # 1000 tokens: not a multiple of any block size, mass spread over the whole vocabulary.
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = reference_probs(logits, params)
    generator = torch.Generator().manual_seed(11)
    num_samples, batch = 20000, 4000
    seen = torch.zeros(1000, dtype=torch.long)
    for _ in range(num_samples // batch):
        picked = Sampler()(logits.expand(batch, -1).contiguous(), [params] * batch, [generator] * batch)
        seen += counts(picked, 1000)
    assert (seen[expected == 0] == 0).all(), "sampled a token the filters remove"
    freqs = seen.double() / num_samples
    sigma = (expected * (1 - expected) / num_samples).sqrt()
    assert ((freqs - expected).abs() <= 5 * sigma + 2e-4).all()
    if params.top_p < 1 and params.top_k == 0:
        assert int((expected > 0).sum()) > 200, "the nucleus must be wider than the first candidates"


def test_rows_with_different_min_p_in_one_batch_each_get_their_own_filter():
    logits = KNOWN_LOGITS.expand(4000, -1).contiguous()
    params = [SamplingParams(min_p=0.2), SamplingParams(min_p=0.5)] * 2000
    picked = torch.tensor(Sampler()(logits, params, [torch.Generator().manual_seed(0)] * 4000))
    loose, strict = counts(picked[0::2].tolist(), 4), counts(picked[1::2].tolist(), 4)
    assert loose[3] == 0 and (loose[:3] > 0).all()  # threshold 0.1 keeps 0.5, 0.3, 0.15
    assert (strict[2:] == 0).all() and (strict[:2] > 0).all()  # threshold 0.25 keeps 0.5, 0.3


# ---------------------------------------------------------------- reproducibility

def test_same_seed_same_tokens_and_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: any dependence on the seed shows
    def run(seed):
        params = SamplingParams(seed=seed)
        generator = make_generator(params)
        return [Sampler()(logits, [params], [generator])[0] for _ in range(20)]
    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.9, top_k=200, top_p=0.95, min_p=0.01, seed=99),
    SamplingParams(temperature=0.7, seed=99),
    SamplingParams(temperature=1.2, min_p=0.05, seed=99),
    SamplingParams(temperature=1.0, top_p=0.9, seed=99),  # nucleus wider than the first candidates
], ids=["all_filters", "temperature", "min_p", "wide_top_p"])
def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch(target):
    torch.manual_seed(0)
    vocab_size = 2000
    steps = [torch.randn(vocab_size) * 2 for _ in range(10)]

    alone_generator = make_generator(target)
    alone = [Sampler()(row.unsqueeze(0), [target], [alone_generator])[0] for row in steps]

    neighbours = [SamplingParams(temperature=0), SamplingParams(seed=5, top_p=0.5),
                  SamplingParams(temperature=1.5, min_p=0.3), SamplingParams(seed=6, top_k=1000),
                  SamplingParams(temperature=0.5)]
    for position in (0, 2, 5):
        batch = neighbours[:position] + [target] + neighbours[position:]
        generators = [make_generator(p) for p in batch]
        together = []
        for row in steps:
            logits = torch.stack([torch.randn(vocab_size) for _ in neighbours])
            logits = torch.cat([logits[:position], row.unsqueeze(0), logits[position:]])
            together.append(Sampler()(logits, batch, generators)[position])
        assert together == alone, position


def test_unseeded_rows_draw_from_the_global_rng_in_row_order():
    logits = torch.zeros(3, 500)
    params = [SamplingParams()] * 3
    torch.manual_seed(21)
    first = Sampler()(logits, params, [None] * 3)
    torch.manual_seed(21)
    assert Sampler()(logits, params, [None] * 3) == first
    assert Sampler()(logits, params, [None] * 3) != first  # the RNG moved on


# ---------------------------------------------------------------- argument checks

def test_sampler_rejects_misaligned_arguments_and_bad_logits():
    with pytest.raises(ValueError, match="got 2 rows, 1 params, 2 generators"):
        Sampler()(torch.zeros(2, 10), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"floating \[batch, vocab\] tensor, got a torch.float32 "
                                         r"tensor of shape \(10,\)"):
        Sampler()(torch.zeros(10), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="got a torch.int64 tensor"):
        Sampler()(torch.zeros(1, 10, dtype=torch.long), [SamplingParams()], [None])
