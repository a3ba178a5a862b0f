"""Engine fixtures shared by every tests/engine/ file.

``smollm2`` loads the real SmolLM2-135M-Instruct (float32, CPU) once per test session (~20 s);
``tiny_llama`` is a seeded random 2-layer Llama with a byte tokenizer (milliseconds).
"""
from __future__ import annotations


import pytest


@pytest.fixture(scope="session")
def smollm2():
    from corekv.engine.models import load_model

    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_llama():
    from corekv.engine.tiny_model import make_tiny_llama

    return make_tiny_llama()


@pytest.fixture(scope="session")
def hf_attention():
    """``with hf_attention(loaded): ...`` runs ``loaded.model`` with transformers' SDPA attention."""
    from corekv.engine.models import reference_attention

    return reference_attention
