"""Log-probabilities of sampled tokens: what ``SamplingParams.logprobs`` reports per generated token.

They are of the model's raw distribution, ``log_softmax(logits)`` of the logits the model returned,
before logit_bias, min_tokens, penalties, temperature and the top-k / top-p / min-p filters. This is
vLLM's default (its ``raw_logprobs`` mode); OpenAI reports those of the processed distribution. Raw
log-probabilities say what the model thinks of a token whatever picked it, and equal
``torch.log_softmax`` of transformers' own logits for the same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from corekv.engine.outputs import TokenLogprobs

__all__ = ["token_logprobs"]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Per row of ``logits``, the :class:`TokenLogprobs` of ``token_ids[row]`` with the
    ``num_top[row]`` most likely tokens, or ``None`` for a row whose ``num_top`` is ``None``.

    :param logits: ``[rows, vocab]`` raw logits (the model's output, unprocessed).
    :param token_ids: the token each row picked.
    :param num_top: per row, ``SamplingParams.logprobs``.
    """
    if not (len(token_ids) == len(num_top) == logits.shape[0]):
        raise ValueError(f"token_logprobs: need one token id and one num_top per logits row; got "
                         f"{logits.shape[0]} rows, {len(token_ids)} token ids, {len(num_top)} num_top")
    rows = [i for i, k in enumerate(num_top) if k is not None]
    result: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return result
    # NOTE: only the rows that asked: log_softmax reads the whole vocabulary of each row.
    picked_logits = logits if len(rows) == logits.shape[0] else logits[rows]
    logprobs = torch.log_softmax(picked_logits.float(), dim=-1)
    chosen = torch.tensor([token_ids[i] for i in rows], dtype=torch.long, device=logits.device)
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    max_top = min(max(num_top[i] for i in rows), logits.shape[1])
    top_values, top_ids = (logprobs.topk(max_top, dim=-1) if max_top
                           else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        k = num_top[row]
        result[row] = TokenLogprobs(token_ids[row], chosen_logprobs[j],
                                    tuple(zip(top_ids[j][:k], top_values[j][:k])))
    return result
