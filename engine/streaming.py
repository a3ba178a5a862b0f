"""Text deltas of a running request, for streaming: what ``Engine.stream`` yields and what the HTTP
server sends, from one piece of code.

A completion's text grows as the engine detokenizes its tokens. A stop string is cut off the text
once it appears, so text that may be the start of a stop string must not be handed out yet: while
a completion runs, its last ``len(longest stop) - 1`` characters are held back.
"""
from __future__ import annotations

from corekv.engine.outputs import TokenLogprobs
from corekv.engine.requests import Request

__all__ = ["TextStream"]


class TextStream:
    """Hands out one request's completions as text deltas, each completion separately.

    Invariants: the text handed out for completion ``i`` is always a prefix of its final text (no
    character past a stop string is ever handed out); once the request has finished and
    :meth:`deltas` has been called, the deltas of each completion add up to its final text.
    Only the thread that drives the engine may call :meth:`deltas` (it reads the sequences).
    """

    def __init__(self, request: Request):
        self.request = request
        # NOTE: a stop string of k characters can only be cut from the last k - 1 characters
        # seen so far plus text still to come, so holding back k - 1 is enough and no more.
        self.holdback = max((len(s) for s in request.params.stop), default=1) - 1
        self._num_emitted: dict[int, int] = {}
        self._num_logprobs_emitted: dict[int, int] = {}

    @property
    def is_finished(self) -> bool:
        """True once all ``n`` completions have finished."""
        seqs = self.request.seqs
        return len(seqs) == self.request.params.n and all(s.is_finished for s in seqs)

    def deltas(self) -> list[tuple[int, str]]:
        """``(completion index, new text)`` for every completion with text not yet handed out."""
        deltas = []
        for seq in self.request.seqs:
            seq.update_text()
            emitted = self._num_emitted.get(seq.index, 0)
            end = len(seq.text) if seq.is_finished else max(emitted, len(seq.text) - self.holdback)
            if end > emitted:
                deltas.append((seq.index, seq.text[emitted:end]))
                self._num_emitted[seq.index] = end
        return deltas

    def logprob_deltas(self) -> list[tuple[int, list[TokenLogprobs]]]:
        """``(completion index, new TokenLogprobs)`` for every completion with log-probabilities
        not yet handed out (``SamplingParams.logprobs``), one per token as soon as it is sampled:
        unlike the text, nothing is held back, so they may run ahead of :meth:`deltas`."""
        if self.request.params.logprobs is None:
            return []
        deltas = []
        for seq in self.request.seqs:
            emitted = self._num_logprobs_emitted.get(seq.index, 0)
            if len(seq.output_logprobs) > emitted:
                deltas.append((seq.index, seq.output_logprobs[emitted:]))
                self._num_logprobs_emitted[seq.index] = len(seq.output_logprobs)
        return deltas
