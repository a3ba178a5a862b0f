"""What a request's logit_bias, min_tokens and penalties do to the logits before the sampler draws.

The order is vLLM's: ``logit_bias`` is added, ``min_tokens`` masks the tokens that would stop the
sequence, then the penalties apply:

* ``repetition_penalty`` (vLLM's and transformers' rule): for every token id in the prompt or the
  output, a positive logit is divided by the penalty and a negative one multiplied by it;
* ``frequency_penalty`` and ``presence_penalty`` (OpenAI's rule), over the output tokens only:
  ``logit - frequency_penalty * count - presence_penalty * (count > 0)``.

Temperature and the top-k / top-p / min-p filters come after, in the :class:`~corekv.engine.sampling.Sampler`;
greedy rows take the argmax of the processed logits. Rows without any of these are left untouched
(and a batch without any returns its logits as they are), so the common path costs one flag per row.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from corekv.engine.sampling import SamplingParams

__all__ = ["apply_logits_processors"]


def apply_logits_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                            token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int],
                            eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The logits to sample from: each row's ``params`` applied to its ``logits`` row.

    :param logits: ``[rows, vocab]`` floating logits; never modified (their raw values are what
        log-probabilities are reported of).
    :param params: one :class:`SamplingParams` per row.
    :param token_ids: per row, the sequence's tokens so far, prompt then output (the token to be
        sampled not yet among them).
    :param num_prompt_tokens: per row, how many of ``token_ids`` are the prompt.
    :param eos_token_ids: the model's EOS ids, masked with ``stop_token_ids`` while a row has
        fewer than ``min_tokens`` output tokens (unless ``ignore_eos``: EOS does not stop it then).
    :returns: ``logits`` itself when no row has a processor, else a new tensor in which only the
        processed rows differ (a masked token is ``-inf``).
    """
    if not (len(params) == len(token_ids) == len(num_prompt_tokens) == logits.shape[0]):
        raise ValueError(f"apply_logits_processors: need one params, token list and prompt length per "
                         f"logits row; got {logits.shape[0]} rows, {len(params)} params, "
                         f"{len(token_ids)} token lists, {len(num_prompt_tokens)} prompt lengths")
    rows = [i for i, p in enumerate(params) if p.has_logits_processors]
    if not rows:
        return logits
    processed = logits.clone()
    device, vocab_size = logits.device, logits.shape[1]
    for row in rows:
        p, ids, num_prompt = params[row], token_ids[row], num_prompt_tokens[row]
        values = processed[row]
        if p.logit_bias:
            bias_ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
            values.index_add_(0, bias_ids, torch.tensor([b for _, b in p.logit_bias],
                                                        dtype=values.dtype, device=device))
        if len(ids) - num_prompt < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stops = [t for t in stops if t < vocab_size]
            if stops:
                values[torch.tensor(stops, dtype=torch.long, device=device)] = float("-inf")
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)
            picked = values[seen]
            values[seen] = torch.where(picked > 0, picked / p.repetition_penalty,
                                       picked * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(ids) > num_prompt:
            output = torch.tensor(ids[num_prompt:], dtype=torch.long, device=device)
            counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].to(values.dtype)
            values -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(values.dtype)
    return processed
