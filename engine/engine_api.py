"""The calls most users make — ``generate``, ``stream``, ``text_stream``, ``warm``, ``unpin`` — built
on the engine's own loop (``_make_request`` / ``_enqueue`` / ``_step`` / ``abort``).

:class:`EngineAPI` is mixed into :class:`corekv.Engine`; it holds no state of its own. Outputs of
other requests that finish while one of these calls drives the loop go to ``Engine._unclaimed``,
so ``Engine.step()`` still returns every request exactly once.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from corekv.errors import CoreKVError
from corekv.engine.outputs import RequestOutput
from corekv.engine.requests import as_prompt_list, per_prompt
from corekv.engine.sampling import SamplingParams
from corekv.engine.streaming import TextStream

__all__ = ["EngineAPI"]


class EngineAPI:
    """Blocking and streaming generation, and prefix warming, for :class:`corekv.Engine`."""

    def generate(self, prompts: Any, sampling_params: SamplingParams | list | None = None,
                 cache_salt: str | list | None = None, *, use_tqdm: bool | None = None,
                 offload: bool | list = True) -> list[RequestOutput]:
        """Run prompts to completion, batched; returns one :class:`RequestOutput` per prompt, in order.

        :param prompts: a str, token ids (``list[int]``), chat messages (``[{"role", "content"}]``,
            rendered with the chat template and the assistant prompt), or a list of those.
        :param sampling_params: one :class:`SamplingParams` for all prompts, or one per prompt;
            ``None`` is ``SamplingParams()``. With ``n > 1`` a prompt's completions are in
            ``output.outputs`` (``output.text`` is completion 0's).
        :param cache_salt: the tenant's salt (prefixes are shared only within one salt), one for
            all prompts or one per prompt.
        :param use_tqdm: show a progress bar; default: only when stderr is a terminal.
        :param offload: False keeps the prompts' blocks off the storage tiers (per-request
            opt-out; they still reload what the tiers hold); one bool for all or one per prompt.
        """
        prompt_list = as_prompt_list(prompts)
        params_list = per_prompt("sampling_params", sampling_params, len(prompt_list), SamplingParams)
        salts = per_prompt("cache_salt", cache_salt, len(prompt_list), str)
        offloads = per_prompt("offload", offload, len(prompt_list), bool)
        # NOTE: every prompt is checked before any is queued, so a bad one leaves the engine idle.
        requests = [self._make_request(p, sp, salt, None, offload=o)
                    for p, sp, salt, o in zip(prompt_list, params_list, salts, offloads)]
        for request, salt in zip(requests, salts):
            self._enqueue(request, salt)
        outputs: dict[str, RequestOutput] = {}
        wanted = {r.request_id for r in requests}
        bar = _progress_bar(len(requests), use_tqdm)
        try:
            while len(outputs) < len(requests):
                for output in self._step():
                    if output.request_id in wanted:
                        outputs[output.request_id] = output
                        bar.update(1)
                    else:
                        self._unclaimed.append(output)
        finally:
            bar.close()
            for request in requests:
                if request.request_id not in outputs and request.request_id in self._requests:
                    self.abort(request.request_id)
        return [outputs[r.request_id] for r in requests]

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None,
               cache_salt: str | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as they are produced (``n`` must be 1).

        With stop strings, up to ``len(longest stop) - 1`` characters are held back until they
        cannot start a stop string, so no text past a stop is ever yielded.
        """
        request = self._make_request(prompt, sampling_params, cache_salt, None)
        if request.params.n != 1:
            raise ValueError(f"stream() yields one completion; got SamplingParams.n={request.params.n}; "
                             "use generate() for n > 1")
        self._enqueue(request, cache_salt)
        text = TextStream(request)
        try:
            while not text.is_finished:
                self._unclaimed.extend(o for o in self._step() if o.request_id != request.request_id)
                for _index, delta in text.deltas():
                    yield delta
        finally:
            if not text.is_finished:
                self.abort(request.request_id)

    def text_stream(self, request_id: str) -> TextStream:
        """A :class:`TextStream` of an in-flight request (from ``add_request``): call its
        ``deltas()`` after each ``step()`` to stream the request's text, stop strings held back."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"text_stream: no request {request_id!r} is in flight; pass the id "
                           "add_request returned, before step() returns its output")
        return TextStream(request)

    def warm(self, prompt: Any, pin: bool = True, cache_salt: str | None = None) -> int:
        """Compute ``prompt``'s KV and keep its full blocks cached (and pinned when ``pin``).

        Chat messages are rendered without the assistant prompt, as the prefix of a later
        conversation. Returns the number of prompt tokens now cached (pinned, when ``pin``).
        :raises PinLimitError: if pinning would exceed ``cache.max_pinned_fraction`` of the pool.
        """
        if not self.config.engine.enable_prefix_caching:
            raise CoreKVError("warm() needs engine.enable_prefix_caching: true (nothing is kept otherwise)")
        if not isinstance(pin, bool):
            raise TypeError(f"warm(pin=...) must be True or False, got {pin!r}")
        token_ids = self.encode(prompt, add_generation_prompt=False)
        request = self._make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt,
                                     None, prompt_token_ids=token_ids)
        request.is_internal = True
        self._enqueue(request, cache_salt)
        while not request.seqs[0].is_finished:
            self._unclaimed.extend(self._step())
        key = self.prefix_key(token_ids, cache_salt)
        num_blocks = self.backend.pin(key) if pin else len(self.backend.match(key))
        self._after_step([])  # publish the pin's events, if any
        return num_blocks * self.block_size

    def unpin(self, prompt: Any, cache_salt: str | None = None) -> int:
        """Undo one ``warm(prompt, pin=True, cache_salt)``; returns the number of tokens unpinned."""
        token_ids = self.encode(prompt, add_generation_prompt=False)
        return self.backend.unpin(self.prefix_key(token_ids, cache_salt)) * self.block_size



class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, use_tqdm: bool | None):
    if use_tqdm is None:
        use_tqdm = sys.stderr.isatty()
    if not use_tqdm:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
