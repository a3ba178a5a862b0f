"""logit_bias, min_tokens and the penalties on known logits: apply_logits_processors equals a plain
per-token reference (vLLM's and transformers' rules), leaves rows without them alone, and never
touches its input; raw log-probabilities are log_softmax of the logits."""
import math

import pytest
import torch

from corekv.engine.logits_processors import apply_logits_processors
from corekv.engine.logprobs import token_logprobs
from corekv.engine.sampling import Sampler, SamplingParams

VOCAB = 12
EOS = 11


def reference(logits_row, params, token_ids, num_prompt, eos_ids=(EOS,)):
    """The rules one token at a time, in vLLM's order: bias, min_tokens, repetition, frequency and
    presence."""
    out = [float(x) for x in logits_row]
    for token_id, bias in dict(params.logit_bias).items():
        out[token_id] += bias
    output_ids = token_ids[num_prompt:]
    if len(output_ids) < params.min_tokens:
        for token_id in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)):
            out[token_id] = -math.inf
    for token_id in set(token_ids):
        penalty, value = params.repetition_penalty, out[token_id]
        out[token_id] = value / penalty if value > 0 else value * penalty
    for token_id in set(output_ids):
        count = output_ids.count(token_id)
        out[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return torch.tensor(out)


KNOWN = torch.tensor([2.0, -1.0, 0.5, -0.25, 3.0, 0.0, -2.0, 1.0, 1.5, -0.5, 0.25, 0.75])
PROMPT = [0, 1, 1, 4]
OUTPUT = [4, 4, 6, 1, 9]


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(repetition_penalty=0.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-1.2),
    SamplingParams(frequency_penalty=0.3, presence_penalty=0.4, repetition_penalty=1.3),
    SamplingParams(logit_bias={2: 5.0, 3: -100}),
    SamplingParams(min_tokens=8, stop_token_ids=[7]),
    SamplingParams(min_tokens=8, ignore_eos=True, stop_token_ids=[7]),
    SamplingParams(min_tokens=5, stop_token_ids=[7]),  # reached: nothing masked
    SamplingParams(logit_bias={4: 2.0}, min_tokens=9, repetition_penalty=2.0, frequency_penalty=0.5,
                   presence_penalty=0.5),
], ids=["rep>1", "rep<1", "frequency", "presence", "all_penalties", "bias", "min_tokens",
        "min_tokens_ignore_eos", "min_tokens_reached", "everything"])
def test_each_rule_equals_the_reference_on_known_logits(params):
    logits = KNOWN.unsqueeze(0)
    before = logits.clone()
    got = apply_logits_processors(logits, [params], [PROMPT + OUTPUT], [len(PROMPT)], [EOS])
    expected = reference(KNOWN, params, PROMPT + OUTPUT, len(PROMPT))
    assert torch.equal(torch.isinf(got[0]), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(got[0][finite], expected[finite], atol=1e-6), (got[0], expected)
    assert torch.equal(logits, before), "the raw logits must stay as they were"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    got = apply_logits_processors(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1]], [1])
    assert got.tolist() == [[1.0, -4.0, 2.0, -2.0]]  # tokens 2 and 3 were never seen


def test_frequency_and_presence_count_only_output_tokens():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    got = apply_logits_processors(logits, [params], [[3, 3, 3, 0, 0, 1]], [3])  # prompt: 3 3 3
    assert got.tolist() == [[-2.5, -1.5, 0.0, 0.0]]


def test_rows_without_processors_are_untouched_and_a_plain_batch_is_returned_as_is():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = [SamplingParams()] * 3
    assert apply_logits_processors(logits, plain, [[1]] * 3, [1] * 3) is logits
    mixed = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams(temperature=0)]
    got = apply_logits_processors(logits, mixed, [[1, 2]] * 3, [1] * 3)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 2] == logits[1, 2] - 1.0


def test_greedy_picks_the_argmax_of_the_processed_logits():
    logits = KNOWN.unsqueeze(0)
    params = SamplingParams(temperature=0, logit_bias={5: 10.0})
    processed = apply_logits_processors(logits, [params], [[0]], [1])
    assert Sampler()(processed, [params], [None]) == [5]
    masked = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])  # 4 is the argmax
    processed = apply_logits_processors(logits, [masked], [[0]], [1])
    assert Sampler()(processed, [masked], [None]) == [0]  # the next best


def test_misaligned_arguments_are_a_value_error():
    with pytest.raises(ValueError, match="got 2 rows, 1 params, 1 token lists, 1 prompt lengths"):
        apply_logits_processors(torch.zeros(2, 4), [SamplingParams()], [[1]], [1])


def test_token_logprobs_are_log_softmax_of_the_logits_with_the_top_k_best_first():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits, dim=-1)
    got = token_logprobs(logits, [7, 8, 9], [3, None, 0])
    assert got[1] is None
    assert got[0].token_id == 7 and got[0].logprob == pytest.approx(expected[0, 7].item(), abs=1e-6)
    values, ids = expected[0].topk(3)
    assert [t for t, _ in got[0].top] == ids.tolist()
    assert [lp for _, lp in got[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert got[2].top == () and got[2].logprob == pytest.approx(expected[2, 9].item(), abs=1e-6)
    assert math.isclose(sum(math.exp(lp) for lp in expected[0].tolist()), 1.0, rel_tol=1e-5)
