"""``engine.speculative``: off by default, each method's fields checked once by the reader, with
messages that name the field and the fix; a dumped config reads back."""
from __future__ import annotations

import pytest
import yaml

import corekv
from corekv.config import SpeculativeConfig, config_reference, dump_config, load_config


def load(speculative) -> SpeculativeConfig:
    return load_config({"engine": {"speculative": speculative}}, env={}).engine.speculative


def error_of(speculative) -> corekv.ConfigError:
    with pytest.raises(corekv.ConfigError) as info:
        load(speculative)
    return info.value


def test_off_by_default():
    assert load_config({}, env={}).engine.speculative == SpeculativeConfig()
    assert SpeculativeConfig().method is None


def test_each_method_reads_its_own_fields():
    ngram = load({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 3, "prompt_lookup_max": 3})
    assert ngram == SpeculativeConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=3,
                                      prompt_lookup_max=3)
    draft = load({"method": "draft", "model": "/models/SmolLM2-135M-Instruct"})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft", "/models/SmolLM2-135M-Instruct", 4)
    env = load_config({}, env={"COREKV_ENGINE__SPECULATIVE__METHOD": "ngram"}).engine.speculative
    assert env.method == "ngram"


MESSAGES = [
    ({"method": "ngrams"}, "engine.speculative.method: got 'ngrams'; expected one of ngram, draft; did you mean 'ngram'?"),
    ({"num_speculative_tokens": 3},
     "engine.speculative.method: missing, and num_speculative_tokens given; expected method: ngram or method: draft "
     "(leave engine.speculative out to keep it off)"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "engine.speculative.num_speculative_tokens: got 0; expected an integer between 1 and 16"),
    ({"method": "draft"},
     "engine.speculative.model: missing; expected the draft model for method: draft (an alias, a Hugging Face model "
     "folder or a .gguf file with the target's tokenizer)"),
    ({"method": "ngram", "model": "small"},
     "engine.speculative.model: got 'small' with method: ngram; expected model only with method: draft: remove it"),
    ({"method": "draft", "model": "small", "prompt_lookup_max": 3},
     "engine.speculative.prompt_lookup_max: got 3 with method: draft; expected prompt_lookup_max only with "
     "method: ngram: remove it"),
    ({"method": "ngram", "prompt_lookup_min": 6},
     "engine.speculative.prompt_lookup_min: got 6, more than prompt_lookup_max 5; expected prompt_lookup_min <= "
     "prompt_lookup_max"),
    ({"method": "ngram", "promt_lookup_max": 4},
     "engine.speculative.promt_lookup_max: unknown key (value 4); did you mean 'prompt_lookup_max'? Valid keys: "
     "method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, adaptive"),
]


@pytest.mark.parametrize("speculative, message", MESSAGES, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(MESSAGES)])
def test_error_messages_name_the_field_and_the_fix(speculative, message):
    error = error_of(speculative)
    assert (str(error), error.path) == (message, message.split(":")[0])


@pytest.mark.parametrize("speculative", [{}, {"method": "ngram", "prompt_lookup_min": 1},
                                         {"method": "draft", "model": "m", "num_speculative_tokens": 2}])
def test_a_dumped_config_reads_back(speculative):
    cfg = load_config({"engine": {"speculative": speculative}}, env={})
    assert load_config(yaml.safe_load(yaml.safe_dump(dump_config(cfg))), env={}) == cfg


def test_the_reference_documents_every_field():
    text = config_reference()
    assert "| `engine.speculative.method` | one of ngram, draft | none |" in text
    assert "| `engine.speculative.num_speculative_tokens` | an integer between 1 and 16 | 4 |" in text
