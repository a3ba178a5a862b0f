"""W1 and W2, the engine benchmarks' workloads (``engine_w1_w2.py``, ``engine_profile.py``,
``speculative_w3.py``, and vLLM on the same ids through ``peers/vllm_w1_w2.py``).

* W1: six questions after one long system prompt (chat template), :data:`W1_NEW` new tokens; the
  first request alone, then the other five together.
* W2: :data:`W2_PROMPTS` prompts of exactly :data:`W2_LEN` token ids sharing an exact
  :data:`W2_PREFIX`-token prefix (real text: the seed documents), :data:`W2_NEW` new tokens with
  EOS ignored, all submitted together.
"""
from __future__ import annotations

SYSTEM = "You are an inference optimization expert. Answer concisely and accurately, give numbers when needed. " * 6
# NOTE: the six questions of the seed's shared-system-prompt experiment (as in the golden test).
QUESTIONS = ["What is a KV cache?", "Explain continuous batching in one sentence.", "What is Python's GIL?",
             "Write a metaphor about the moon.", "Explain tensor parallelism in one sentence.",
             "What is 1+1? Answer directly."]
W2_PROMPTS, W2_LEN, W2_PREFIX, W2_NEW = 32, 512, 384, 16
W1_NEW = 32


def w1_prompts(loaded) -> list[list[int]]:
    """W1's prompts through ``loaded``'s chat template (a :class:`corekv.engine.models.LoadedModel`)."""
    return [loaded.encode_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def w2_prompts(loaded, seed_text: str) -> list[list[int]]:
    """W2's prompts, cut from ``seed_text`` (:func:`seed_documents.read_seeds`).

    :raises SystemExit: if the seed documents are too short for W2.
    """
    ids = loaded.tokenizer(seed_text, add_special_tokens=False)["input_ids"]
    suffix = W2_LEN - W2_PREFIX
    need = W2_PREFIX + W2_PROMPTS * suffix
    if len(ids) < need:
        raise SystemExit(f"the seed documents give {len(ids)} tokens; W2 needs {need}")
    prefix = ids[:W2_PREFIX]
    prompts = [prefix + ids[W2_PREFIX + i * suffix:W2_PREFIX + (i + 1) * suffix] for i in range(W2_PROMPTS)]
    assert all(len(p) == W2_LEN for p in prompts) and len({tuple(p[W2_PREFIX:]) for p in prompts}) == W2_PROMPTS, \
        "this indicates a bug in w2_prompts: the prompts are not W2_LEN long or not distinct after the prefix"
    return prompts


def as_waves(name: str, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Workload ``name``'s prompts as waves (lists of prompts submitted together): W1's first
    request alone, then the other five; W2's all at once."""
    return [prompts[:1], prompts[1:]] if name == "W1" else [prompts]


def max_new_tokens(name: str) -> tuple[int, bool]:
    """``(new tokens per request, whether EOS is ignored)`` of workload ``name``."""
    return (W1_NEW, False) if name == "W1" else (W2_NEW, True)
