"""The tiny random test model: a seeded 2-layer Llama with a byte-level tokenizer, built in
milliseconds with nothing downloaded (tests, examples and benchmarks use it in place of a real
checkpoint).
"""
from __future__ import annotations

from typing import Any

from corekv.engine.models import LoadedModel, prepare_model, resolve_device, resolve_dtype
from corekv.errors import CoreKVError

__all__ = ["make_byte_tokenizer", "make_tiny_llama"]


_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_byte_tokenizer() -> Any:
    """A byte-level tokenizer (3 special tokens + 256 bytes, no merges) with a ChatML template:
    every string round-trips, and nothing is downloaded or parsed from a model file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(
    *, num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
    vocab_size: int = 320, seed: int = 0, dtype: str = "float32", device: str = "cpu",
) -> LoadedModel:
    """A tiny randomly initialised Llama (seeded, so reproducible) with the byte tokenizer, for fast tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_byte_tokenizer()
    if vocab_size < len(tokenizer):
        raise CoreKVError(f"make_tiny_llama: vocab_size must be >= {len(tokenizer)} (the byte tokenizer), got {vocab_size}")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        hf_model = LlamaForCausalLM(config).to(resolve_dtype(dtype))
    finally:
        torch.random.set_rng_state(generator_state)
    return prepare_model(hf_model, tokenizer, device=resolve_device(device))
