"""LMCache's own workloads, scaled down (``peers/vllm_lmcache_peer.py``): long-document QA and
multi-round QA, as token ids built once around SmolLM2's ChatML template.

Each message is tokenized on its own (:class:`ChatIds`), so a conversation's prompt is an exact
prefix of its next one whatever the tokenizer would merge across messages. A workload is a dict
of ``sessions`` (lists of prompts a session sends one after another), their request ``names`` and
the ``concurrency`` of sessions in flight; the harness turns them into per-process plans.
"""
from __future__ import annotations

import random


class ChatIds:
    """SmolLM2's ChatML pieces as token ids, each tokenized on its own (so prefixes stay prefixes),
    and the seed documents' token ids to cut text from."""

    def __init__(self, model: str, seed_text: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)
        self.corpus = self.tok.encode(seed_text, add_special_tokens=False)
        self.gen = self.enc("<|im_start|>assistant\n")

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, rng: random.Random, n: int) -> list[int]:
        """``n`` consecutive token ids of the seed documents from a random place (wrapping)."""
        start = rng.randrange(len(self.corpus))
        return [self.corpus[(start + i) % len(self.corpus)] for i in range(n)]

    def message(self, role: str, body: list[int]) -> list[int]:
        return self.enc(f"<|im_start|>{role}\n") + body + self.enc("<|im_end|>\n")


def build_workloads(ids: ChatIds, a) -> dict:
    """The workloads of ``peers/vllm_lmcache_peer.py`` (see its docstring) from ``a``'s sizes: ``seed``,
    ``docs``, ``doc_tokens``, ``doc_concurrency``, ``system_tokens``, ``users``, ``rounds``, ``user_tokens``,
    ``answer_tokens``."""
    rng = random.Random(a.seed)
    questions = ["What is the main point of this document?", "Which components does the text describe?",
                 "Summarise the last section in one sentence."]
    docs = [ids.text(rng, a.doc_tokens) for _ in range(a.docs)]

    def doc_prompt(doc: list[int], q: int) -> list[int]:
        return (ids.enc("<|im_start|>user\n") + doc + ids.enc(f"\n\nQuestion: {questions[q]}<|im_end|>\n")
                + ids.gen)

    # as LMCache's long-doc-qa: a warm-up round over the documents, then the query round over
    # them again in random order (here with another question)
    second = list(range(a.docs))
    rng.shuffle(second)
    pairs = [(d, 0) for d in range(a.docs)] + [(d, 1) for d in second]
    repeats = [f"doc{d}/q1" for d in second]
    third = list(range(a.docs))
    rng.shuffle(third)
    single_doc = ids.text(rng, a.doc_tokens)
    system = ids.message("system", ids.corpus[:a.system_tokens])
    users, user_names = [], []
    for u in range(a.users):
        history, rounds = list(system), []
        for r in range(a.rounds):
            history = history + ids.message("user", ids.text(rng, a.user_tokens))
            rounds.append(history + ids.gen)
            history = history + ids.gen + ids.text(rng, a.answer_tokens) + ids.enc("<|im_end|>\n")
        users.append(rounds)
        user_names.append([f"user{u}/round{r}" for r in range(a.rounds)])

    def one(name: str, prompt: list[int]) -> dict:
        return {"sessions": [[prompt]], "names": [[name]], "concurrency": 1}

    return {
        "warmup": one("warmup", ids.text(rng, 64)),  # under one block: nothing to look up or store
        "flush": one("flush", ids.text(rng, 64)),
        "long_doc_qa": {"sessions": [[doc_prompt(docs[d], q)] for d, q in pairs],
                        "names": [[f"doc{d}/q{q}"] for d, q in pairs], "concurrency": a.doc_concurrency,
                        "repeats": repeats},
        "multi_round_qa": {"sessions": users, "names": user_names, "concurrency": a.users},
        "fresh_process": {"sessions": [[doc_prompt(docs[d], 2)] for d in third],
                          "names": [[f"doc{d}/q2"] for d in third], "concurrency": a.doc_concurrency},
        "single_cold": one("single", doc_prompt(single_doc, 0)),
        "single_warm": one("single", doc_prompt(single_doc, 0)),
        "single_restart": one("single", doc_prompt(single_doc, 0)),
    }
