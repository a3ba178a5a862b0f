"""Multi-turn conversations: every turn sends the whole history so far as its prompt, and the
answer appended after a turn is fixed seed text, not the generated one, so every system gets the
same token ids on every turn whatever it generates. Both builders return ``turns[t][c]``:
conversation ``c``'s prompt at turn ``t``, so a benchmark can submit turn 1 of every conversation
together, then turn 2, and so on, as concurrent chat sessions arrive.

* :func:`seed_chats`: the seed's memory-pressure workload (``memory_pressure.py``): raw token
  ids, no chat template, lengths scaled by one factor.
* :func:`templated_chats`: chats through the model's chat template with a shared system prompt
  (``peers/multi_turn_vs_vllm.py``, where vLLM gets the same ids).
"""
from __future__ import annotations

import random


def seed_chats(tokenizer, scale: float, seed_text: str, num_conversations: int = 20, num_turns: int = 8,
               seed: int = 0) -> list[list[list[int]]]:
    """The seed's workload: each conversation starts from a 300-token history, each turn appends a
    user message (10-60 tokens), then a fixed answer (50-300 tokens); every length times ``scale``.
    Token ids are slices of ``seed_text`` tokenized by ``tokenizer``, at offsets from ``seed``."""
    corpus = [int(t) for t in tokenizer.encode(seed_text, add_special_tokens=False)]
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        n = max(1, round(rng.randint(low, high) * scale))
        start = rng.randrange(0, len(corpus) - n)
        return corpus[start:start + n]

    turns = [[] for _ in range(num_turns)]
    for _ in range(num_conversations):
        history = tokens(300, 300)
        for t in range(num_turns):
            history = history + tokens(10, 60)  # the user's new message
            turns[t].append(list(history))
            history = history + tokens(50, 300)  # the model's answer (fixed tokens, as in the seed)
    return turns


def templated_chats(tokenizer, encode, seed_text: str, *, conversations: int, turns: int, system_tokens: int,
                    user_tokens: tuple[int, int], answer_tokens: tuple[int, int], document_tokens: int = 0,
                    seed: int = 0) -> list[list[list[int]]]:
    """``conversations`` chats of ``turns`` turns sharing one system prompt (the first
    ``system_tokens`` tokens of ``seed_text``); each user message is ``user_tokens`` lo-hi tokens of
    seed text (with ``document_tokens``, the first one starts with a document of that many tokens),
    each fixed answer ``answer_tokens`` lo-hi. A prompt is the messages so far through ``encode``
    (the chat template with the generation prompt).

    :raises SystemExit: if a turn's prompt is not a prefix of the next turn's (the template would
        then break prefix caching for every engine alike, and the workload would not be a chat).
    """
    corpus = tokenizer.encode(seed_text, add_special_tokens=False)
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        n = rng.randint(low, high)
        start = rng.randrange(0, len(corpus) - n)
        return tokenizer.decode(corpus[start:start + n]).strip()

    system = {"role": "system", "content": tokenizer.decode(corpus[:system_tokens]).strip()}
    user_lo, user_hi = user_tokens
    answer_lo, answer_hi = answer_tokens
    prompts: list[list[list[int]]] = [[] for _ in range(turns)]
    for c in range(conversations):
        messages, previous = [system], []
        for t in range(turns):
            question = text(user_lo, user_hi)
            if t == 0 and document_tokens:
                question = text(document_tokens, document_tokens) + "\n\n" + question
            messages.append({"role": "user", "content": question})
            ids = encode(messages)
            if ids[:len(previous)] != previous:
                raise SystemExit(f"conversation {c}: turn {t + 1}'s prompt does not start with turn {t}'s "
                                 "(the chat template re-tokenized the history); this workload needs a "
                                 "template that appends")
            prompts[t].append(ids)
            previous = ids
            messages.append({"role": "assistant", "content": text(answer_lo, answer_hi)})
    return prompts
