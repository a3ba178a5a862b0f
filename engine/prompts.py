"""Prompts as token ids: the one rule the engine and ``corekv route`` share.

A prompt is a string, token ids as they are, or chat messages rendered with the tokenizer's chat
template. The engine encodes through :meth:`corekv.engine.models.LoadedModel.encode_prompt`, the
router through :func:`encode_prompt` with the tokenizer alone
(:func:`corekv.engine.models.load_tokenizer`), so a router's token ids, and so its block hashes,
are the engine's. Nothing here imports torch or transformers.
"""
from __future__ import annotations

from typing import Any

from corekv.errors import CoreKVError

__all__ = ["encode_prompt"]


def encode_prompt(tokenizer: Any, prompt: str | list[int] | list[dict], *,
                  vocab_size: int | None = None, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a prompt: a string, token ids as is, or chat messages (``[{"role", "content"}]``,
    rendered with the tokenizer's chat template and, unless ``add_generation_prompt`` is false
    (a prefix such as a system prompt to warm), the assistant generation prompt).

    :param vocab_size: token ids must lie in ``[0, vocab_size)``; ``None`` skips that check.
    """
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
        if not ids:
            raise CoreKVError(f"prompt {prompt!r} encodes to no tokens; pass a non-empty prompt")
        return ids
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if any(not {"role", "content"} <= set(m) for m in prompt):
            raise CoreKVError(f"chat messages need 'role' and 'content' keys, got {list(prompt)!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise CoreKVError("this model's tokenizer has no chat template; pass a string prompt instead")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            limit = "" if vocab_size is None else f" [0, {vocab_size})"
            raise CoreKVError(f"prompt token ids {bad[:5]} are outside the vocabulary{limit}")
        return list(prompt)
    raise CoreKVError(
        f"prompt must be a non-empty str, list of token ids, or list of chat messages "
        f"({{'role', 'content'}} dicts), got {type(prompt).__name__}: {str(prompt)[:80]!r}"
    )
