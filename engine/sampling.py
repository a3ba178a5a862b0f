"""Per-request sampling parameters and the batched sampler that turns logits into next tokens.

A batch mixes greedy and sampled rows. Greedy rows are an exact ``argmax`` of the logits (the rule
of transformers' greedy ``generate``); a batch of greedy rows costs one argmax. Sampled rows go
through temperature, top-k, top-p and min-p, vectorised over the rows, and draw one token by
inverse-CDF sampling with a single uniform number from the row's own ``torch.Generator``:

* rows with top-k or top-p work on their best few tokens only (one ``topk`` pass, no full sort);
  a top-p row whose nucleus turns out wider than its candidates is redone with more of them;
* rows without (temperature and min-p only) sample the whole vocabulary by a two-level inverse CDF
  (pick a block of tokens by the block sums, then a token inside it).

Each row consumes exactly one number from its own generator and its candidate count depends only on
its own parameters, so a seeded request yields the same tokens whatever else shares the batch.

The sampler takes the logits as given: the engine first applies each request's logit_bias,
min_tokens and penalties (:mod:`corekv.engine.logits_processors`), and reports log-probabilities of
the raw, unprocessed logits (:mod:`corekv.engine.logprobs`).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corekv.config.values import describe_value
from corekv.errors import CoreKVError

__all__ = ["Sampler", "SamplingParams", "SamplingParamsError", "make_generator", "MAX_LOGPROBS"]

_MAX_SEED = 2**63 - 1
# NOTE: the sampler works in float32. A positive temperature below 1e-30 (or a repetition penalty
# outside [1e-2, 1e2]) underflows or overflows there into NaN weights, and NaN weights pick a
# token outside the vocabulary: such values are refused, not clamped. Below 1e-30 a temperature
# already picks the argmax; use 0 for that.
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 100.0  # far past any useful value (OpenAI documents [0, 2]); flat sampling at 100
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2
# NOTE: stop strings and stop token ids are checked on every token, and logit_bias is applied on
# every step: without a bound one request's 4,000 stop strings cost every step of every request
# ~5 ms. OpenAI allows 4 stop strings; these bounds are generous beside it.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
#: the most top log-probabilities a request may ask for per token (OpenAI's chat limit, vLLM's default)
MAX_LOGPROBS = 20
# NOTE: a top-p nucleus of a trained model is rarely more than a few dozen tokens; a wider one costs
# one more topk pass per growth step, the last one over the whole vocabulary.
_NUM_NUCLEUS_CANDIDATES = 64
_CANDIDATE_GROWTH = 8
_BLOCK = 256  # tokens per block of the two-level inverse CDF


class SamplingParamsError(CoreKVError, ValueError):
    """A sampling parameter is invalid; the message names the field, the value, and the fix.

    :ivar field: that field's name (``None`` when the error is about the whole mapping), so callers
        (the server's ``param``) can tell which one was rejected without parsing the message.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


def _fail(field: str, value: Any, expected: str, fix: str) -> SamplingParamsError:
    # NOTE: cut to one line: an attacker's value may be a 4,000-digit number
    return SamplingParamsError(f"SamplingParams.{field} must be {expected}, got {describe_value(value)}; {fix}",
                               field=field)


class _Quoted:
    """A value whose repr is cut to one readable line (for error messages)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return describe_value(self.value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # NOTE: an int too large for a float (JSON allows 4300 digits)
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Invariants (checked in ``__post_init__``): every field has its documented type and range,
    ``stop`` and ``stop_token_ids`` are tuples, ``logit_bias`` is a tuple of ``(token_id, bias)``
    pairs sorted by token id (``dict(params.logit_bias)`` reads it), ``min_tokens <= max_tokens``,
    and ``temperature == 0`` means greedy (the filters are then ignored; logit_bias, min_tokens and
    the penalties still apply, so greedy is the argmax of the processed logits). Instances are
    immutable, so the engine may share one between requests.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None  # None = the global torch RNG
    stop: tuple[str, ...] | str | list = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: OpenAI's penalties on the generated tokens: ``logit - frequency_penalty * count -
    #: presence_penalty * (count > 0)``; 0.0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: vLLM's and transformers' penalty on every token of the prompt and the output: a positive
    #: logit is divided by it, a negative one multiplied; 1.0 = off
    repetition_penalty: float = 1.0
    #: ``{token_id: bias}`` added to the logits (a mapping in, sorted ``(token_id, bias)`` pairs kept)
    logit_bias: tuple[tuple[int, float], ...] | Mapping = ()
    #: EOS and ``stop_token_ids`` cannot be sampled, nor stop strings end the text, before this many
    min_tokens: int = 0
    #: None = off; ``k``: each generated token's log-probability and the ``k`` most likely tokens'
    #: (:class:`corekv.engine.outputs.TokenLogprobs`). They are of the model's raw distribution,
    #: ``log_softmax(logits)`` before logit_bias, min_tokens, penalties, temperature and the filters
    #: (vLLM's default), so they do not depend on how the token was picked.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _fail("max_tokens", self.max_tokens, "an integer >= 1",
                        "pass the number of new tokens to generate, e.g. max_tokens=32")
        if not _is_real(self.temperature) or not (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise _fail("temperature", self.temperature,
                        f"0 or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
                        "use 0 for greedy decoding or e.g. 0.7 for sampling")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _fail("top_k", self.top_k, "an integer >= 0",
                        "use 0 to disable top-k or e.g. top_k=50")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise _fail("top_p", self.top_p, "in (0, 1]",
                        "use 1.0 to disable nucleus sampling or e.g. top_p=0.9")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise _fail("min_p", self.min_p, "in [0, 1]",
                        "use 0.0 to disable min-p or e.g. min_p=0.05")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise _fail("seed", self.seed, f"None or an integer in [0, {_MAX_SEED}]",
                        "pass e.g. seed=1234 for reproducible sampling, or None")
        object.__setattr__(self, "stop", self._normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "a bool", f"pass {name}=True or {name}=False")
        if not _is_int(self.n) or self.n < 1:
            raise _fail("n", self.n, "an integer >= 1",
                        "pass the number of completions wanted per prompt, e.g. n=1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise _fail(name, value, "a number in [-2, 2]",
                            f"use 0 to disable it or e.g. {name}=0.5 (negative values encourage repeats)")
        if not _is_real(self.repetition_penalty) or not (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise _fail("repetition_penalty", self.repetition_penalty,
                        f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
                        "use 1.0 to disable it or e.g. repetition_penalty=1.2 (< 1 encourages repeats)")
        object.__setattr__(self, "logit_bias", self._normalise_logit_bias(self.logit_bias))
        # NOTE: stored as floats: an int field value (JSON's 2) reaches torch.tensor in the sampler
        # beside other rows' floats, where a large int would not convert
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]",
                        "use 0 to let the model stop at once, or raise max_tokens")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _fail("logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]",
                        "use None for none, 0 for the sampled token's only, or e.g. logprobs=5")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def has_logits_processors(self) -> bool:
        """True when logit_bias, min_tokens or a penalty changes the logits before sampling (see
        :func:`corekv.engine.logits_processors.apply_logits_processors`)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping (YAML, JSON, CLI); a misspelled key names the closest valid one."""
        if not isinstance(d, Mapping):
            raise SamplingParamsError(
                f"SamplingParams.from_dict expects a mapping of field names to values, got "
                f"{type(d).__name__}; pass e.g. {{'max_tokens': 32, 'temperature': 0.0}}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
                raise SamplingParamsError(f"SamplingParams has no field {key!r}; {hint}")
        return cls(**d)

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise _fail("stop", stop, "a non-empty string or a list of non-empty strings",
                        "pass e.g. stop=['\\n\\n', 'User:'], or () for none")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise _fail("stop", _Quoted(stop), f"at most {MAX_STOP_STRINGS} strings of at most "
                        f"{MAX_STOP_CHARS} characters", "send fewer or shorter stop strings")
        return tuple(stop)

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
        fix = "pass e.g. logit_bias={50256: -100} (token id to a bias in [-100, 100]), or {} for none"
        if isinstance(bias, Mapping):
            pairs = list(bias.items())
        elif isinstance(bias, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2
                                                     for p in bias):
            pairs = [tuple(p) for p in bias]
        else:
            raise _fail("logit_bias", _Quoted(bias), "a mapping of token ids to biases", fix)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise _fail("logit_bias", _Quoted(bias), f"a mapping of at most {MAX_LOGIT_BIAS} token ids",
                        fix)
        # NOTE: an error quotes the offending entry, not a mapping that may hold thousands
        for token_id, value in pairs:
            if not _is_int(token_id) or token_id < 0:
                raise _fail("logit_bias", {token_id: value}, "a mapping of token ids (integers >= 0) "
                            "to biases", fix)
            if not _is_real(value) or not -100 <= value <= 100:
                raise _fail("logit_bias", {token_id: value}, "a mapping of token ids to biases in "
                            "[-100, 100]", fix)
        if len({token_id for token_id, _ in pairs}) != len(pairs):
            raise _fail("logit_bias", _Quoted(bias), "a mapping with each token id once", fix)
        return tuple(sorted((token_id, float(value)) for token_id, value in pairs))

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if not isinstance(ids, (tuple, list)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _fail("stop_token_ids", ids, "a list of token ids (integers >= 0)",
                        "pass e.g. stop_token_ids=[2], or () for none")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _fail("stop_token_ids", _Quoted(ids), f"at most {MAX_STOP_TOKEN_IDS} token ids",
                        "send fewer stop token ids")
        return tuple(ids)


def make_generator(params: SamplingParams, index: int = 0) -> torch.Generator | None:
    """The CPU generator for completion ``index`` of ``params.n``, seeded with ``seed + index``.

    Returns None when ``params.seed`` is None: that request then samples from the global torch RNG.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"make_generator: params must be a SamplingParams, got "
                        f"{type(params).__name__}; build one with corekv.SamplingParams(...)")
    if not _is_int(index) or not 0 <= index < params.n:
        raise ValueError(f"make_generator: index must be an integer in [0, {params.n}) "
                         f"(params.n={params.n}), got {index!r}; pass the completion's number")
    if params.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    # NOTE: seed + index stays below 2**64 (seed <= 2**63 - 1 and n is small), manual_seed's limit.
    generator.manual_seed(params.seed + index)
    return generator


class Sampler:
    """Picks one next token per row of a ``[B, V]`` logits tensor.

    Invariants: a greedy row's token is ``torch.argmax`` of its logits whatever the other rows are;
    a sampled row's token has positive probability under its filtered distribution. Stateless: all
    randomness comes from the per-row generators (or the global RNG for rows whose generator is
    None), one uniform number per sampled row per call, drawn in row order.
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"Sampler: logits must be a floating [batch, vocab] tensor, got "
                             f"{_describe(logits)}; pass the last position's logits per sequence")
        if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
            raise ValueError(f"Sampler: need one SamplingParams and one generator per logits row; got "
                             f"{logits.shape[0]} rows, {len(params)} params, {len(generators)} "
                             f"generators; pass lists aligned with the rows")
        greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
        if len(greedy_rows) == len(params):
            return torch.argmax(logits, dim=-1).tolist()  # NOTE: the common path: one argmax.
        token_ids = [0] * len(params)
        if greedy_rows:
            picked = torch.argmax(logits[greedy_rows], dim=-1).tolist()
            for row, token_id in zip(greedy_rows, picked):
                token_ids[row] = token_id
        sampled_rows = [i for i, p in enumerate(params) if p.temperature != 0]
        sampled_logits = logits if len(sampled_rows) == len(params) else logits[sampled_rows]
        picked = self._sample([params[i] for i in sampled_rows], sampled_logits,
                              [generators[i] for i in sampled_rows])
        for row, token_id in zip(sampled_rows, picked):
            token_ids[row] = token_id
        return token_ids

    def _sample(self, params: list[SamplingParams], logits: torch.Tensor,
                generators: list[torch.Generator | None]) -> list[int]:
        uniforms = _draw_uniforms(generators).to(logits.device)
        rows = _Rows(logits, params, uniforms)
        token_ids = [0] * len(params)
        # NOTE: rows that truncate (top-k, top-p) only need their best few tokens: a top-k pass over
        # the vocabulary instead of a full sort. Each row's candidate count depends only on its own
        # parameters, so its result does not depend on what else shares the batch.
        num_candidates = [_num_candidates(p, logits.shape[1]) for p in params]
        full = [i for i, k in enumerate(num_candidates) if k is None]
        if full:
            for row, token_id in zip(full, _sample_full(rows.take(full))):
                token_ids[row] = token_id
        truncated = [i for i, k in enumerate(num_candidates) if k is not None]
        while truncated:
            picked, uncovered = _sample_truncated(rows.take(truncated),
                                                  [num_candidates[i] for i in truncated])
            for row, token_id in zip(truncated, picked):
                token_ids[row] = token_id
            # NOTE: a flat distribution whose nucleus is wider than the candidates is redone with
            # more of them (rare for trained models; the last step is the whole vocabulary).
            truncated = [truncated[j] for j in uncovered]
            for row in truncated:
                num_candidates[row] = min(num_candidates[row] * _CANDIDATE_GROWTH, logits.shape[1])
        return token_ids


class _Rows:
    """Sampled rows with their per-row parameters as ``[rows, 1]`` tensors."""

    def __init__(self, logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor,
                 maxes: torch.Tensor | None = None) -> None:
        device = logits.device
        self.logits, self.params, self.uniforms = logits, params, uniforms
        self.maxes = logits.amax(dim=-1, keepdim=True).float() if maxes is None else maxes
        self.temperatures = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        self.min_ps = [p.min_p for p in params]
        self.top_ps = [p.top_p for p in params]

    def take(self, rows: list[int]) -> _Rows:
        if len(rows) == len(self.params):  # all of them, in order: no copy
            return self
        return _Rows(self.logits[rows], [self.params[i] for i in rows], self.uniforms[rows],
                     self.maxes[rows])

    def log_weights(self, values: torch.Tensor) -> torch.Tensor:
        """(logit - row max) / temperature: 0 for the best token, so its weight exp() is 1.

        NOTE: shifting before dividing keeps tiny temperatures from overflowing to +inf.
        """
        return (values.float() - self.maxes).div_(self.temperatures)


def _num_candidates(params: SamplingParams, vocab_size: int) -> int | None:
    """How many best tokens a row starts from; None when it needs the whole vocabulary."""
    if params.top_k > 0:
        return min(params.top_k, vocab_size)
    if params.top_p < 1:
        return min(_NUM_NUCLEUS_CANDIDATES, vocab_size)
    return None


def _sample_full(rows: _Rows) -> list[int]:
    """Sample from all tokens (temperature and min-p only) by a two-level inverse CDF."""
    weights = rows.log_weights(rows.logits).exp_()
    if len(set(rows.min_ps)) == 1 and rows.min_ps[0] > 0:
        # NOTE: one shared min-p (the usual case) is one in-place threshold pass; a boolean mask
        # and a multiply cost several times more on CPU. threshold keeps w > t, so t is the float
        # just below min_p to keep w >= min_p.
        below = torch.nextafter(torch.tensor(rows.min_ps[0]), torch.tensor(0.0)).item()
        torch.nn.functional.threshold(weights, below, 0.0, inplace=True)
    elif any(rows.min_ps):
        weights.mul_(weights >= torch.tensor(rows.min_ps, device=weights.device).unsqueeze(1))
    # NOTE: a full-vocabulary cumsum costs as much as the rest of the step; summing blocks, picking
    # a block, then scanning only its tokens gives the same distribution for a fraction of the work.
    num_rows, vocab_size = weights.shape
    num_blocks = -(-vocab_size // _BLOCK)
    if vocab_size % _BLOCK:
        weights = torch.nn.functional.pad(weights, (0, num_blocks * _BLOCK - vocab_size))
    blocks = weights.view(num_rows, num_blocks, _BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = _scaled_below_total(rows.uniforms, block_cdf[:, -1])
    block = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).squeeze(1)
    block = block.clamp(max=num_blocks - 1)
    cdf_before = block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    cdf_before = torch.where(block > 0, cdf_before, torch.zeros_like(cdf_before))
    inner_cdf = blocks[torch.arange(num_rows, device=weights.device), block].double().cumsum(dim=-1)
    # NOTE: the block's own scan and its sum may differ in the last bit: stay inside the block.
    offset = torch.minimum(target - cdf_before,
                           torch.nextafter(inner_cdf[:, -1], torch.zeros_like(target)))
    inner = torch.searchsorted(inner_cdf, offset.clamp(min=0).unsqueeze(1), right=True).squeeze(1)
    return (block * _BLOCK + inner.clamp(max=_BLOCK - 1)).tolist()


def _sample_truncated(rows: _Rows, num_candidates: list[int]) -> tuple[list[int], list[int]]:
    """Sample among each row's best tokens after top-k, then top-p, then min-p.

    Returns the token ids and the indexes of rows whose nucleus may reach past their candidates
    (their token is not valid; the caller retries them with more candidates).
    """
    device = rows.logits.device
    num_kept = torch.tensor(num_candidates, device=device)
    # NOTE: temperature is monotonic, so the best logits are the best scaled logits.
    values, token_order = torch.topk(rows.logits, max(num_candidates), dim=-1)  # best first
    columns = torch.arange(values.shape[1], device=device).unsqueeze(0)
    weights = rows.log_weights(values).exp_().masked_fill_(columns >= num_kept.unsqueeze(1), 0)
    cdf = weights.double().cumsum(dim=-1)
    uncovered = torch.zeros(len(num_candidates), dtype=torch.bool, device=device)
    if any(top_p < 1 for top_p in rows.top_ps):
        top_p = torch.tensor(rows.top_ps, dtype=torch.float64, device=device)
        is_nucleus_only = torch.tensor([p.top_k == 0 for p in rows.params], device=device)
        total = cdf[:, -1]
        if bool(is_nucleus_only.any()):
            # NOTE: top-k rows renormalise over their k tokens; top-p-only rows over the whole
            # vocabulary, which reaches past the candidates.
            vocab_total = rows.log_weights(rows.logits).exp_().sum(dim=-1).double()
            total = torch.where(is_nucleus_only, vocab_total, total)
            is_short = (cdf[:, -1] / total < top_p) & (num_kept < rows.logits.shape[1])
            uncovered = is_nucleus_only & is_short
        mass_before = (cdf - weights) / total.unsqueeze(1)
        num_in_nucleus = (mass_before < top_p.unsqueeze(1)).sum(dim=-1)  # the best is always in
        num_kept = torch.minimum(num_kept, num_in_nucleus)
    if any(rows.min_ps):
        min_p = torch.tensor(rows.min_ps, device=device).unsqueeze(1)
        num_kept = torch.minimum(num_kept, (weights >= min_p).sum(dim=-1))
    # NOTE: every filter keeps a prefix of the best-first order, so the kept mass is a CDF value.
    kept_total = cdf.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    target = _scaled_below_total(rows.uniforms, kept_total)
    position = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    position = torch.minimum(position, num_kept - 1)
    picked = token_order.gather(1, position.unsqueeze(1)).squeeze(1).tolist()
    return picked, uncovered.nonzero().squeeze(1).tolist()


def _scaled_below_total(uniforms: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """u * total, capped just below total, so a right-searchsorted lands on a positive weight."""
    return torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))


def _draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from the row's generator or the global RNG."""
    values = []
    # NOTE: one number per row, drawn where the row's generator lives (normally the CPU): the same
    # seed gives the same tokens on any device and next to any other rows.
    for generator in generators:
        if generator is None:
            values.append(torch.rand(1, dtype=torch.float64))
        else:
            values.append(torch.rand(1, dtype=torch.float64, generator=generator,
                                     device=generator.device).cpu())
    return torch.cat(values)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
