"""Per-request sampling parameters and the batched sampler that turns logits into next tokens.

A batch mixes greedy and sampled rows. Greedy rows are an exact ``argmax`` of the float32 logits (the
same rule as transformers' greedy ``generate``). Sampled rows go through temperature, top-k, top-p
and min-p filtering, vectorised over the rows, and then draw one token by inverse-CDF sampling with a
single uniform number taken from the row's own ``torch.Generator``. Because each row consumes exactly
one number from its own generator, a seeded request yields the same tokens whatever else shares the
batch, and on any device (the uniform is drawn where the generator lives, normally the CPU).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corekv.errors import CoreKVError

__all__ = ["Sampler", "SamplingParams", "SamplingParamsError", "make_generator"]

_MAX_SEED = 2**63 - 1


class SamplingParamsError(CoreKVError, ValueError):
    """A sampling parameter is invalid; the message names the field, the value, and the fix."""


def _fail(field: str, value: Any, expected: str, fix: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field} must be {expected}, got {value!r}; {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Invariants (checked in ``__post_init__``): every field has its documented type and range,
    ``stop`` and ``stop_token_ids`` are tuples, and ``temperature == 0`` means greedy (the filters
    are then ignored). Instances are immutable, so the engine may share one between requests.
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

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _fail("max_tokens", self.max_tokens, "an integer >= 1",
                        "pass the number of new tokens to generate, e.g. max_tokens=32")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise _fail("temperature", self.temperature, "a finite number >= 0",
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

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax (``temperature == 0``)."""
        return self.temperature == 0

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
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if not isinstance(ids, (tuple, list)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _fail("stop_token_ids", ids, "a list of token ids (integers >= 0)",
                        "pass e.g. stop_token_ids=[2], or () for none")
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

    Stateless: all randomness comes from the per-row generators (or the global RNG for rows whose
    generator is None), one uniform number per sampled row per call, drawn in row order.
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
        picked = self._sample([params[i] for i in sampled_rows], logits[sampled_rows],
                              [generators[i] for i in sampled_rows])
        for row, token_id in zip(sampled_rows, picked):
            token_ids[row] = token_id
        return token_ids

    def _sample(self, params: list[SamplingParams], logits: torch.Tensor,
                generators: list[torch.Generator | None]) -> list[int]:
        device = logits.device
        x = logits.float()
        # NOTE: shifting by the row max before dividing keeps tiny temperatures from overflowing
        # to +inf (and NaN in softmax); the max becomes 0 and everything else goes towards -inf.
        x = x - x.max(dim=-1, keepdim=True).values
        x = x / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        top_ks = [p.top_k for p in params]
        if any(top_ks):
            x = _apply_top_k(x, torch.tensor(top_ks, device=device))
        if any(p.top_p < 1 for p in params):
            x = _apply_top_p(x, torch.tensor([p.top_p for p in params], device=device))
        if any(p.min_p > 0 for p in params):
            x = _apply_min_p(x, torch.tensor([p.min_p for p in params], device=device))
        cdf = torch.softmax(x, dim=-1).double().cumsum(dim=-1)
        total = cdf[:, -1:]
        uniforms = _draw_uniforms(generators).to(device).unsqueeze(1)
        # NOTE: capping just below the total guarantees searchsorted lands on a token with positive
        # probability (the first index whose CDF exceeds u), never past the end of the vocabulary.
        u = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, u, right=True).squeeze(1).tolist()


def _apply_top_k(x: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Mask everything below each row's k-th largest value (k = 0 keeps the row as it is)."""
    max_k = min(int(top_ks.max()), x.shape[-1])
    kth = torch.topk(x, max_k, dim=-1).values
    k_index = (top_ks.clamp(1, max_k) - 1).unsqueeze(1)
    threshold = kth.gather(1, k_index)
    threshold = torch.where(top_ks.unsqueeze(1) > 0, threshold, torch.full_like(threshold, -math.inf))
    return x.masked_fill(x < threshold, -math.inf)


def _apply_top_p(x: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one token)."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # NOTE: the most likely token has mass_before == 0 < top_p, so every row keeps a token.
    drop_sorted = mass_before >= top_ps.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, -math.inf)


def _apply_min_p(x: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's highest probability."""
    probs = torch.softmax(x, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
    return x.masked_fill(probs < threshold, -math.inf)


def _draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from the row's generator or the global RNG."""
    values = []
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
