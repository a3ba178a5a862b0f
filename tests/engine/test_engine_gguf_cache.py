"""A .gguf model is converted once into a safetensors folder that later starts read instead:
the same model (fingerprint, weights, tokenizer) as the file, and the file still serves where the
cache cannot be written."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from corekv.engine import gguf_cache, models
from corekv.engine.models import load_model, load_tokenizer

PROMPTS = ["Hello world", " leading space and   runs", "naïve café 😀\n\ttabs, 你好",
           [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def f(x): return x**2"}]]


def gguf_path() -> Path:
    return Path(models.corekv_resolve_model(models.DEFAULT_MODEL))


def test_the_default_model_loads_from_its_converted_folder(smollm2):
    """The session's SmolLM2 came through the cache: its folder is there, finished, keyed by the
    file's digest, and holds the weights once (the tied lm_head is not written twice)."""
    from safetensors import safe_open

    folder = gguf_cache.existing_folder(gguf_path())
    assert folder is not None and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        (tied,) = {"model.embed_tokens.weight", "lm_head.weight"} & set(f.keys())
        assert f.get_tensor(tied).dtype == torch.float32
    assert smollm2.model.lm_head.weight is smollm2.model.get_input_embeddings().weight


def test_the_fingerprint_kept_beside_the_converted_folder_is_the_weights_fingerprint(smollm2):
    """A start reads the fingerprint the folder keeps instead of hashing every weight again: it
    is the one the loaded weights hash to (a change to model_fingerprint must rename what is kept)."""
    folder = gguf_cache.existing_folder(gguf_path())
    kept = [gguf_cache.remembered(folder, path.name.removeprefix("corekv-"))
            for path in folder.glob(f"corekv-{models._FINGERPRINT_NAME}-float32-*")]
    assert kept == [smollm2.fingerprint]
    assert models.model_fingerprint(smollm2.model) == smollm2.fingerprint


def test_the_converted_folder_builds_the_model_from_pretrained_builds():
    """load_model_from (the class built from the config, the stored tensors as its parameters) gives
    what transformers' from_pretrained gives for the folder: parameters, buffers, ties, config and
    generation config; another dtype is left to from_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = gguf_cache.existing_folder(gguf_path())
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    built = gguf_cache.load_model_from(folder, config, torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    assert type(built) is type(loaded) and not built.training
    built_state, loaded_state = built.state_dict(), loaded.state_dict()
    assert built_state.keys() == loaded_state.keys()
    for name, tensor in loaded_state.items():
        assert built_state[name].dtype == tensor.dtype and torch.equal(built_state[name], tensor), name
    for (name, buffer), (_, expected) in zip(built.named_buffers(), loaded.named_buffers(), strict=True):
        assert buffer.dtype == expected.dtype and torch.equal(buffer, expected), name
    assert built.lm_head.weight is built.get_input_embeddings().weight
    assert built.config.to_dict() == loaded.config.to_dict()
    assert built.generation_config.to_dict() == loaded.generation_config.to_dict()
    assert gguf_cache.load_model_from(folder, config, torch.bfloat16) is None


def test_load_tokenizer_reads_the_converted_folder_and_encodes_as_the_engine_does(smollm2):
    tokenizer = load_tokenizer(models.DEFAULT_MODEL)
    assert Path(tokenizer.name_or_path) == gguf_cache.existing_folder(gguf_path())
    for prompt in PROMPTS:
        assert smollm2.encode_prompt(prompt) == models.prompts.encode_prompt(tokenizer, prompt)


@pytest.mark.slow
def test_without_a_writable_cache_the_file_serves_as_the_same_model(smollm2, tmp_path, monkeypatch, caplog):
    """COREKV_CACHE_DIR under a regular file cannot be created: the GGUF file is read directly (and
    the reason logged), giving the model the converted folder gives: same fingerprint (so the same
    block hashes), weights, end-of-sequence ids and token ids."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("COREKV_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="corekv.engine.gguf_cache"):
        direct = load_model(models.DEFAULT_MODEL, dtype="float32", device="cpu")
    assert "could not cache the converted model" in caplog.text
    assert direct.fingerprint == smollm2.fingerprint
    assert direct.eos_token_ids == smollm2.eos_token_ids
    assert torch.equal(direct.model.model.layers[7].mlp.down_proj.weight,
                       smollm2.model.model.layers[7].mlp.down_proj.weight)
    for prompt in PROMPTS:
        assert direct.encode_prompt(prompt) == smollm2.encode_prompt(prompt)
