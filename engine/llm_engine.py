"""The engine: requests in, text out, one :meth:`Engine.step` at a time.

``step()`` is the whole loop: the scheduler picks this step's tokens, the model runner runs them in
one forward, the sampler picks next tokens, the scheduler appends them and retires finished
sequences. Around it: building the parts from a config, ``add_request`` / ``abort``, the calls most
users make (``generate`` / ``stream`` / ``text_stream`` / ``warm`` / ``unpin``, built on the same
loop), plugin hooks and ``stats``. Below the device pool the engine knows only the offload facade
(:mod:`corekv.offload`), through its ``BlockManager``.

NOTE: this module is longer than the others on purpose: :class:`Engine` is the public class, and
its whole surface reads in one place; the parts it ties together each live in their own module.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from corekv.config import Config
from corekv.errors import ConfigError, CoreKVError, describe_exception
from corekv.eviction import resolve_policy_options
from corekv.engine.cpu.native import NativeBuildError, wants_native_kernels
from corekv.hashing import PrefixKey, chain_seed, check_cache_salt
from corekv.offload import make_offload
from corekv.plugin import make_plugin_manager
from corekv.engine.block_manager import BlockManager
from corekv.engine.cpu.malloc import tune_glibc_malloc
from corekv.engine.cpu.threads import apply_threads
from corekv.engine.detokenizer import IncrementalDetokenizer
from corekv.engine.kv_pool import KVPool, available_memory
from corekv.engine.model_runner import ModelRunner, ScheduledChunk
from corekv.engine.models import LoadedModel, load_model
from corekv.engine.outputs import RequestOutput
from corekv.engine.streaming import TextStream
from corekv.engine.spec_decode import STATS_OFF as SPECULATIVE_OFF, make_speculative_decoder
from corekv.engine.sampling import Sampler, SamplingParams, make_generator
from corekv.engine.scheduler import ScheduledSeq, Scheduler
from corekv.engine.sequence import Sequence
from corekv.engine.logits_processors import apply_logits_processors
from corekv.engine.logprobs import token_logprobs
from corekv.engine.requests import (Request, RequestRejectedError, as_prompt_list, check_logit_bias,
                                    check_prompt_chars, check_request_fits, make_output,
                                    max_prompt_chars, per_prompt)

__all__ = ["Engine", "RequestRejectedError"]

logger = logging.getLogger(__name__)


class Engine:
    """A paged-KV, continuously batching engine over one Hugging Face model.

    Invariants: the KV pool, the backend and the block tables agree (a block is in at most one
    running table unless shared by forks of one request, see :class:`BlockManager`); every
    request added is eventually returned by ``step`` exactly once (finished or aborted).
    """

    def __init__(self, config: Config, *, model: LoadedModel | None = None, plugins: tuple = (),
                 plugin_manager: Any = None):
        """:param plugin_manager: the manager ``config`` was checked against (as
            :meth:`from_config` passes it); default: one made from ``config.plugins`` and ``plugins``.
        """
        if not isinstance(config, Config):
            raise TypeError(f"Engine(config=...) got {type(config).__name__}; expected a corekv.Config "
                            "(use Engine.from_config for a mapping or a YAML path)")
        if model is not None and not isinstance(model, LoadedModel):
            raise TypeError(f"Engine(model=...) got {type(model).__name__}; expected a LoadedModel "
                            "from corekv.engine.models.load_model, or None to load config.model")
        self.config = config
        ecfg = config.engine
        self.plugin_manager = plugin_manager or make_plugin_manager([*config.plugins, *plugins])
        self.num_threads = apply_threads(ecfg.threads)
        self.model = model or load_model(config.model, dtype=config.dtype, device=config.device,
                                         plugin_manager=self.plugin_manager)
        m = self.model
        if ecfg.tune_cpu_malloc and m.device.type == "cpu":
            tune_glibc_malloc()
        self.block_size = ecfg.block_size
        num_blocks = ecfg.num_blocks or KVPool.num_blocks_for_memory(
            ecfg.kv_cache_memory, num_layers=m.num_layers, block_size=ecfg.block_size,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=m.dtype)
        self.kv_pool = _allocate_pool(ecfg, num_blocks, m)
        self.backend = self._make_backend(num_blocks)
        self.offload, self.tiers_not_started = make_offload(
            config.cache, self.plugin_manager, fingerprint=m.fingerprint,
            dtype=str(m.dtype).removeprefix("torch."), kv_pool=self.kv_pool, backend=self.backend,
            swap=ecfg.preemption == "swap")
        try:
            native = wants_native_kernels(ecfg.cpu_kernels, m.device, m.dtype)
            self.runner = ModelRunner(m, self.kv_pool, compile=ecfg.compile, native=native)
        except NativeBuildError as exc:
            raise ConfigError(f"engine.cpu_kernels: {exc}, or set engine.cpu_kernels: auto or torch") from exc
        if ecfg.compile:
            try:
                self.runner.warm_up()  # NOTE: before any KV is cached: it writes into the first blocks
            except Exception as exc:  # torch.compile's failures come as many exception types
                raise ConfigError(
                    f"engine.compile: torch.compile could not compile {config.model} ({describe_exception(exc)}); "
                    "inductor needs a working C++ compiler (g++) on CPU, or set engine.compile: false"
                ) from exc
        self.sampler = Sampler()
        self.enable_chunked_prefill = ecfg.enable_chunked_prefill
        self.blocks = BlockManager(self.backend, self.kv_pool,
                                   enable_prefix_caching=ecfg.enable_prefix_caching, offload=self.offload)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=ecfg.max_num_seqs,
                                   max_num_batched_tokens=ecfg.max_num_batched_tokens,
                                   scheduling=ecfg.scheduling, enable_chunked_prefill=self.enable_chunked_prefill,
                                   prefill_first=ecfg.prefill_first,
                                   eos_token_ids=m.eos_token_ids, make_fork=self._fork)
        self.max_model_len = getattr(m.hf_config, "max_position_embeddings", None)
        #: the speculative decoder (engine.speculative), or None while it is off
        self.speculative = make_speculative_decoder(ecfg.speculative, m, target_name=config.model, num_blocks=num_blocks,
                                                    block_size=self.block_size, max_num_seqs=ecfg.max_num_seqs,
                                                    plugin_manager=self.plugin_manager)
        #: prompts with more characters can never fit (see requests.max_prompt_chars); None: no bound
        self.max_prompt_chars = max_prompt_chars(
            min(num_blocks * self.block_size, self.max_model_len or num_blocks * self.block_size), m.tokenizer)
        self.num_steps = 0
        self._requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        # NOTE: a chain seed is cheap to derive but asked for on every request; a bounded cache
        # keeps per-user salts from growing the engine's memory without bound.
        self._namespace = functools.lru_cache(maxsize=4096)(
            lambda cache_salt: chain_seed(m.fingerprint, self.block_size, cache_salt,
                                          algorithm=config.cache.hash))
        self._is_closed = False
        #: outputs of requests added with add_request that finished while generate/stream/warm ran
        self._unclaimed: list[RequestOutput] = []
        logger.info("corekv engine: %s, %d KV blocks x %d tokens = %d tokens (%d bytes per token), backend %s",
                    config.model, num_blocks, self.block_size, self.kv_pool.capacity_tokens,
                    self.kv_pool.bytes_per_token, config.cache.backend)
        self.plugin_manager.hook.corekv_on_engine_started(engine=self)

    @classmethod
    def from_config(cls, config: Config | Mapping | str | os.PathLike | None = None, *,
                    model: LoadedModel | None = None, plugins: tuple = (),
                    plugin_manager: Any = None) -> Engine:
        """Build an engine from a :class:`corekv.Config`, a mapping, or a YAML file path.

        :param model: an already loaded model to serve instead of loading ``config.model``
            (its dtype and device then win over ``config.dtype`` / ``config.device``).
        :param plugins: extra plugin modules or objects, besides ``config.plugins``.
        :param plugin_manager: for a :class:`corekv.Config`, the manager it was checked against
            (:func:`corekv.config.read_config` returns both), so the engine builds no second one.
        """
        if isinstance(config, Config):
            return cls(config, model=model, plugins=tuple(plugins), plugin_manager=plugin_manager)
        from corekv.config import read_config

        # NOTE: one plugin manager checks the config and serves the engine
        config, plugin_manager = read_config(config, extra_plugins=tuple(plugins))
        return cls(config, model=model, plugin_manager=plugin_manager)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Abort what is in flight, finish the tiers' writes and release the KV pool. Idempotent.

        Persistent tiers also receive every block still cached on the device, so a new process
        with the same config finds them.
        """
        if self._is_closed:
            return
        for request_id in list(self._requests):
            self.abort(request_id)
        self._is_closed = True
        try:
            self.offload.close()
        finally:
            # NOTE: plugins release their sockets and servers even when the tiers failed to close
            self.plugin_manager.hook.corekv_on_engine_closed(engine=self)
            self._requests.clear()
            self.runner = self.kv_pool = self.blocks.kv_pool = None

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it (and any that finished
        while ``generate`` / ``stream`` / ``warm`` drove the loop for their own requests)."""
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + self._step()

    def _step(self) -> list[RequestOutput]:
        if self.speculative is not None:
            self.speculative.propose(self.scheduler.running, self.config.engine.max_num_batched_tokens)
        batch = self.scheduler.schedule()
        started = time.perf_counter()
        logits = self.runner.execute([self._chunk(item) for item in batch]) if batch else None
        seqs, rows = self.scheduler.advance(batch)
        if any(item.draft_token_ids for item in batch):
            token_ids = self.speculative.verify(logits, [item.draft_token_ids for item in batch], seqs, rows,
                                                self._sample)
        else:
            token_ids = self._sample(logits, seqs, rows)
        if any(seq.is_finished for seq in seqs):  # NOTE: aborted because its sampling failed
            kept = [(seq, t) for seq, t in zip(seqs, token_ids) if not seq.is_finished]
            seqs, token_ids = [seq for seq, _ in kept], [t for _, t in kept]
        if batch:  # NOTE: after sampling, which waits for the device
            seconds = time.perf_counter() - started
            num_tokens = sum(i.num_tokens + len(i.draft_token_ids) for i in batch)
            if self.speculative is not None:
                self.speculative.observe_step(num_tokens, seconds)
            self.offload.cost.observe_step(num_tokens, seconds)  # recompute's price, for reloads
        finished = self.scheduler.postprocess(seqs, token_ids)
        self.num_steps += bool(batch)
        return self._after_step(finished)

    @property
    def has_unfinished_requests(self) -> bool:
        """True while ``step()`` has outputs still to return (loop ``while ...: engine.step()``)."""
        return self.scheduler.has_unfinished or bool(self._unclaimed)

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                    cache_salt: str | None = None, *, request_id: str | None = None,
                    offload: bool = True, prompt_token_ids: list[int] | None = None,
                    priority: int = 0) -> str:
        """Queue one request (``step`` returns its output when done); returns its id.

        :param offload: False keeps this request's blocks off the storage tiers (it still reads
            them); e.g. a one-off prompt that should not displace shared prefixes on disk.
        :param prompt_token_ids: ``prompt`` already encoded by :meth:`encode` (e.g. on another
            thread, so a long prompt does not hold up the steps); ``prompt`` is kept for the output.
        :param priority: the request's eviction priority: under the ``priority`` eviction policy
            the prefixes it caches or hits are kept over those of lower priorities.

        :raises RequestRejectedError: if it could never be served (too long for the KV pool, the
            model's context, or — without chunked prefill — one step's token budget).
        """
        if prompt_token_ids is not None:  # NOTE: checked against the vocabulary like any ids
            prompt_token_ids = self.model.encode_prompt(prompt_token_ids)
        request = self._make_request(prompt, sampling_params, cache_salt, request_id, offload=offload,
                                     prompt_token_ids=prompt_token_ids)
        self._enqueue(request, cache_salt, _checked_priority(priority))
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its output (``finish_reason="abort"``) comes from the next step."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"abort: no request {request_id!r} is in flight")
        for seq in request.seqs:
            self.scheduler.abort(seq)

    # -- the calls most users make ----------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | list | None = None,
                 cache_salt: str | list | None = None, *, use_tqdm: bool | None = None,
                 offload: bool | list = True, priority: int | list = 0) -> list[RequestOutput]:
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
        :param priority: eviction priority (an int, higher is kept longer under the ``priority``
            eviction policy; 0 by default), one for all prompts or one per prompt.
        """
        prompt_list = as_prompt_list(prompts)
        params_list = per_prompt("sampling_params", sampling_params, len(prompt_list), SamplingParams)
        # NOTE: any one salt is spread over the prompts here and checked by _make_request, so a bad
        # one reads as at every other verb (check_cache_salt)
        salts = per_prompt("cache_salt", cache_salt, len(prompt_list), object)
        offloads = per_prompt("offload", offload, len(prompt_list), bool)
        priorities = [_checked_priority(p) for p in per_prompt("priority", priority, len(prompt_list), int)]
        # NOTE: every prompt is checked before any is queued, so a bad one leaves the engine idle.
        requests = [self._make_request(p, sp, salt, None, offload=o)
                    for p, sp, salt, o in zip(prompt_list, params_list, salts, offloads)]
        for request, salt, prio in zip(requests, salts, priorities):
            self._enqueue(request, salt, prio)
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

    def warm(self, prompt: Any, pin: bool = True, cache_salt: str | None = None, priority: int = 0) -> int:
        """Compute ``prompt``'s KV and keep its full blocks cached (and pinned when ``pin``).

        Chat messages are rendered without the assistant prompt, as the prefix of a later
        conversation. Returns the number of prompt tokens now cached (pinned, when ``pin``): whole
        blocks only, so a prompt shorter than one block (``engine.block_size`` tokens) keeps nothing,
        returns 0 and logs a warning saying so.
        ``priority`` is the eviction priority its blocks take (what keeps them once unpinned, or
        unpinned from the start, under the ``priority`` eviction policy).
        :raises PinLimitError: if pinning would exceed ``cache.max_pinned_fraction`` of the pool.
        """
        priority = _checked_priority(priority)
        if not self.config.engine.enable_prefix_caching:
            raise CoreKVError("warm() needs engine.enable_prefix_caching: true (nothing is kept otherwise)")
        if not isinstance(pin, bool):
            raise TypeError(f"warm(pin=...) must be True or False, got {pin!r}")
        check_cache_salt(cache_salt)  # NOTE: before a short prompt returns, so a bad salt never passes
        token_ids = self.encode(prompt, add_generation_prompt=False)
        if len(token_ids) < self.block_size:
            logger.warning("warm: the prompt is %d tokens, shorter than one %d-token block "
                           "(engine.block_size), so nothing is cached or pinned; warm a longer prefix "
                           "(the whole system prompt or document) or lower engine.block_size",
                           len(token_ids), self.block_size)
            return 0
        request = self._make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt,
                                     None, prompt_token_ids=token_ids)
        request.is_internal = True
        self._enqueue(request, cache_salt, priority)
        while not request.seqs[0].is_finished:
            self._unclaimed.extend(self._step())
        key = self.prefix_key(token_ids, cache_salt)
        num_blocks = self.backend.pin(key) if pin else len(self.backend.match(key))
        self._after_step([])  # publish the pin's events, if any
        return num_blocks * self.block_size

    def unpin(self, prompt: Any, cache_salt: str | None = None) -> int:
        """Undo one ``warm(prompt, pin=True, cache_salt)``; returns the number of tokens unpinned."""
        check_cache_salt(cache_salt)
        token_ids = self.encode(prompt, add_generation_prompt=False)
        return self.backend.unpin(self.prefix_key(token_ids, cache_salt)) * self.block_size

    def stats(self) -> dict[str, Any]:
        """Counters since the engine started (see the keys; ``tiers`` is per storage tier)."""
        sched, backend = self.scheduler, self.backend
        num_free = backend.num_free_blocks
        reused, prompt = sched.num_cached_prompt_tokens, sched.num_prompt_tokens
        return {
            "num_steps": self.num_steps,
            "num_waiting": len(sched.waiting),
            "num_running": len(sched.running),
            "num_preemptions": sched.num_preemptions,
            "num_cow_copies": self.blocks.num_cow_copies,
            "kv_num_blocks": backend.num_blocks,
            "kv_num_free_blocks": num_free,
            "kv_num_pinned_blocks": backend.num_pinned_blocks,
            "kv_usage": (backend.num_blocks - num_free) / backend.num_blocks,
            "kv_block_size": self.block_size,
            "kv_capacity_tokens": backend.num_blocks * self.block_size,
            "prompt_tokens": prompt,
            "prompt_tokens_reused": reused,
            "prompt_tokens_computed": prompt - reused,
            "hit_rate": reused / prompt if prompt else 0.0,
            "tokens_computed": sched.num_computed_tokens,
            "output_tokens": sched.num_output_tokens,
            "num_swapped_out_blocks": self.blocks.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.blocks.num_swapped_in_blocks,
            "backend": backend.stats(),
            "tiers": self.offload.stats(),
            "tiers_not_started": dict(self.tiers_not_started),
            "prefetch": self.offload.prefetch_stats(),
            "reload": self.offload.cost.stats(),
            "speculative": self.speculative.stats() if self.speculative is not None else dict(SPECULATIVE_OFF),
        }

    # -- helpers -----------------------------------------------------------------------------
    def _make_backend(self, num_blocks: int):
        cache = self.config.cache  # NOTE: the config reader checked the name and the options
        spec = self.plugin_manager.backends()[cache.backend]
        options = resolve_policy_options(spec.options, cache.backend_options, self.plugin_manager)
        return spec.factory(num_blocks, self.block_size, max_pinned_fraction=cache.max_pinned_fraction,
                            **options)

    def prefix_key(self, token_ids: list[int], cache_salt: str | None = None,
                   priority: int = 0) -> PrefixKey:
        """The :class:`PrefixKey` under which this engine caches ``token_ids`` for ``cache_salt``
        (``priority``: the eviction priority the cached blocks take)."""
        return PrefixKey(token_ids, self.block_size, self._namespace(cache_salt), self.config.cache.hash,
                         cache_salt=cache_salt, priority=priority)

    def encode(self, prompt: Any, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a prompt (str, token ids, or chat messages with the chat template).

        :raises RequestRejectedError: a prompt with more characters than :attr:`max_prompt_chars`,
            before it is tokenized.
        """
        check_prompt_chars(prompt, self.max_prompt_chars)
        return self.model.encode_prompt(prompt, add_generation_prompt=add_generation_prompt)

    def _make_request(self, prompt: Any, params: SamplingParams | None, cache_salt: str | None,
                      request_id: str | None, *, prompt_token_ids: list[int] | None = None,
                      offload: bool = True) -> Request:
        if self._is_closed:
            raise CoreKVError("this engine is closed; build a new one with Engine.from_config")
        if not isinstance(offload, bool):
            raise TypeError(f"offload must be True or False, got {offload!r}; pass False to keep this "
                            "request's blocks off the storage tiers")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a corekv.SamplingParams (or None), got "
                            f"{type(params).__name__}; build one with corekv.SamplingParams(max_tokens=...)")
        check_cache_salt(cache_salt)
        if request_id is None:
            request_id = str(next(self._request_counter))
        elif not isinstance(request_id, str) or request_id in self._requests:
            raise ValueError(f"request_id must be a str not already in flight, got {request_id!r}")
        token_ids = self.encode(prompt) if prompt_token_ids is None else prompt_token_ids
        if not token_ids:
            raise RequestRejectedError(f"prompt {prompt!r} encodes to no tokens; pass a non-empty prompt")
        check_logit_bias(params, self.model.vocab_size)
        check_request_fits(len(token_ids), params, num_blocks=self.backend.num_blocks,
                           num_pinned_blocks=self.backend.num_pinned_blocks, block_size=self.block_size,
                           max_model_len=self.max_model_len,
                           max_num_batched_tokens=self.config.engine.max_num_batched_tokens,
                           enable_chunked_prefill=self.enable_chunked_prefill,
                           max_num_seqs=self.config.engine.max_num_seqs)
        return Request(request_id, prompt, token_ids, params, offload=offload)

    def _enqueue(self, request: Request, cache_salt: str | None, priority: int = 0) -> None:
        params = request.params
        seq = Sequence(request.request_id, request.prompt_token_ids, params,
                       self.prefix_key(request.prompt_token_ids, cache_salt, priority),
                       generator=make_generator(params, 0), detokenizer=self._detokenizer(request))
        seq.offload = request.offload
        request.seqs.append(seq)
        self._requests[request.request_id] = request
        self.scheduler.add(seq)
        self.blocks.prefetch(seq)  # tier hits load into host staging while the request waits for admission

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.model.tokenizer, request.prompt_token_ids,
                                      skip_special_tokens=request.params.skip_special_tokens)

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = self._requests[parent.request_id]
        child = parent.fork(index, make_generator(parent.params, index), self._detokenizer(request))
        request.seqs.append(child)
        return child

    def _sample(self, logits, seqs: list[Sequence], rows: list[int]) -> list[int]:
        """One token per sequence; a sequence whose own sampling fails is aborted with the error
        (its token is then a placeholder, dropped by ``_step``), and the others keep theirs.

        NOTE: request isolation's second wall, behind the argument checks. A step is not retried
        whole (the forward has already advanced every sequence); what one request's arguments
        reach is its logits processors and its sampler row, so the batch is sampled again row by
        row, from the same generator states, and only the rows that fail again are aborted.
        """
        if not seqs:
            return []
        # NOTE: in a pure decode step every row samples once, in order: skip the [rows] gather,
        # which copies the whole [batch, vocab] logits.
        if rows != list(range(logits.shape[0])):
            logits = logits[rows]
        states = _rng_states(seqs)
        try:
            return self._sample_rows(logits, seqs)
        except Exception as error:
            logger.warning("sampling a batch of %d failed (%s); sampling it row by row to find the "
                           "request that caused it", len(seqs), describe_exception(error))
        _set_rng_states(states)
        token_ids = []
        for row, seq in enumerate(seqs):
            if seq.is_finished:  # NOTE: a fork of a request that already failed in this step
                token_ids.append(0)
                continue
            try:
                token_ids += self._sample_rows(logits[row:row + 1], [seq])
            except Exception as error:
                self._fail_request(seq.request_id, error)
                token_ids.append(0)
        return token_ids

    def _sample_rows(self, logits, seqs: list[Sequence]) -> list[int]:
        params = [s.params for s in seqs]
        # NOTE: the sampler draws from the processed logits; logprobs are of the raw ones (vLLM's default)
        processed = apply_logits_processors(logits, params, [s.token_ids for s in seqs],
                                            [s.num_prompt_tokens for s in seqs], self.model.eos_token_ids)
        token_ids = self.sampler(processed, params, [s.generator for s in seqs])
        if max(token_ids) >= logits.shape[1]:  # NOTE: NaN weights pick past the vocabulary
            raise ValueError(f"the sampler picked token {max(token_ids)} of a vocabulary of "
                             f"{logits.shape[1]} (NaN logits or weights)")
        if any(p.logprobs is not None for p in params):
            for seq, logprobs in zip(seqs, token_logprobs(logits, token_ids, [p.logprobs for p in params])):
                if logprobs is not None:
                    seq.output_logprobs.append(logprobs)
        return token_ids

    def _fail_request(self, request_id: str, error: Exception) -> None:
        """Abort every sequence of a request whose sampling failed; its output carries why."""
        request = self._requests[request_id]
        request.error = f"sampling this request failed: {describe_exception(error)}"
        logger.error("request %s aborted: %s", request_id, request.error)
        for seq in request.seqs:
            self.scheduler.abort(seq)

    @staticmethod
    def _chunk(item: ScheduledSeq) -> ScheduledChunk:
        seq, drafts = item.seq, item.draft_token_ids
        tokens = seq.token_ids[item.start_pos:item.start_pos + item.num_tokens]
        if drafts:  # a decode verifying its drafts: their logits rows too
            return ScheduledChunk(tokens + list(drafts), item.start_pos, seq.block_table, num_logits=1 + len(drafts))
        return ScheduledChunk(tokens, item.start_pos, seq.block_table)

    def _after_step(self, finished: list[Sequence]) -> list[RequestOutput]:
        hook = self.plugin_manager.hook
        # NOTE: one hook call per run of one kind, in the backend's order: a reset or eviction
        # followed by new blocks in one step must reach subscribers in that order.
        for kind, run in itertools.groupby(self.backend.take_events(), key=lambda e: e.kind):
            if kind == "stored":
                hook.corekv_on_blocks_stored(events=list(run))
            elif kind == "removed":
                hook.corekv_on_blocks_removed(events=list(run))
        outputs = []
        for seq in finished:
            request = self._requests[seq.request_id]
            request.num_finished += 1
            if request.num_finished < request.params.n:
                continue
            del self._requests[seq.request_id]
            output = make_output(request)
            if not request.is_internal:
                try:
                    hook.corekv_on_request_finished(output=output)
                except Exception as exc:
                    # NOTE: a plugin failing on one request's output fails that request alone;
                    # raising here would lose the outputs of every other request of the step
                    logger.exception("a corekv_on_request_finished hook failed for request %s",
                                     output.request_id)
                    output = dataclasses.replace(output, error=f"a plugin failed on this request's "
                                                 f"output: {describe_exception(exc)}")
                outputs.append(output)
        return outputs


def _allocate_pool(ecfg: Any, num_blocks: int, m: LoadedModel) -> KVPool:
    """The KV pool, or a :class:`ConfigError` naming the field that sized it when it cannot fit.

    NOTE: checked against the memory free now, before allocating: a pool of 10**12 blocks passes
    the config reader (which knows no model) and would fail inside torch with a message naming
    no field, or, on CPU, be granted by overcommit and kill the process later.
    """
    field = "engine.num_blocks" if ecfg.num_blocks else "engine.kv_cache_memory"
    per_block = KVPool.compute_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) * ecfg.block_size
    need, free = num_blocks * per_block, available_memory(m.device)
    fix = (f"lower {field} (one block of engine.block_size={ecfg.block_size} tokens is {per_block} bytes "
           f"for this model)")
    if free is not None and need > free:
        raise ConfigError(f"{field}: a KV pool of {num_blocks} blocks needs {need} bytes, more than the "
                          f"{free} bytes of {m.device.type} memory free; {fix}")
    try:
        return KVPool(m.num_layers, num_blocks, ecfg.block_size, m.num_kv_heads, m.head_dim, m.dtype, m.device)
    except (RuntimeError, MemoryError) as exc:  # NOTE: torch's out-of-memory errors
        raise ConfigError(f"{field}: a KV pool of {num_blocks} blocks ({need} bytes) could not be allocated "
                          f"({describe_exception(exc)}); {fix}") from exc


def _rng_states(seqs: list[Sequence]) -> tuple | None:
    """The random states a sampling call may draw from (the seeded rows' generators, the global
    RNG), so a failed call can be redone from where it began; None for a greedy batch."""
    if all(s.params.is_greedy for s in seqs):
        return None  # NOTE: the common case costs nothing: greedy rows draw no random number
    generators = {s.generator for s in seqs if s.generator is not None}
    uses_global = any(s.generator is None and not s.params.is_greedy for s in seqs)
    return torch.get_rng_state() if uses_global else None, [(g, g.get_state()) for g in generators]


def _set_rng_states(states: tuple | None) -> None:
    if states is not None:
        if states[0] is not None:
            torch.set_rng_state(states[0])
        for generator, state in states[1]:
            generator.set_state(state)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _checked_priority(priority: Any) -> int:
    if priority.__class__ is not int:
        raise TypeError(f"priority must be an int (higher is kept longer under the priority eviction "
                        f"policy), got {priority!r}")
    return priority


def _progress_bar(total: int, use_tqdm: bool | None):
    if use_tqdm is None:
        use_tqdm = sys.stderr.isatty()
    if not use_tqdm:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
