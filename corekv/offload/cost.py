"""Reload or recompute: how many of the blocks the tiers hold for a request are worth loading.

A tier hit is not always cheaper than computing the same tokens again (a file or remote tier
under load, a small model on a fast device). One :class:`ReloadCost` per process learns, as the
engine runs, what each costs:

- per tier, **seconds per block loaded**: the tier reads (and, at admission, the copies into the
  pool) the reloader times on every load, on the prefetch thread and the engine's;
- the engine's **prefill seconds per token**: from its steps of at least ``block_size`` tokens,
  the slope of seconds over tokens (a weighted least-squares line): what a token adds to a step
  beyond the step's fixed cost, which a request whose suffix runs anyway pays either way. NOTE:
  the step's time over its tokens (before) made short steps count their fixed cost as recompute's;
  with the tiny model a 16-token suffix step read 10 ms a token against 0.2 ms in a 1K-token
  step, and an S3 tier four times slower than recompute was loaded (BENCHMARKS.md, "Reload or
  recompute on five tiers"). Steps all of one size give no slope: then the ratio stands in.

Both are exponentially weighted (recent samples count ``weight``), used once they have
``min_samples`` samples. With ``policy: cost`` a lookup's tier runs (leading blocks, tier by
tier) are loaded up to the cut that saves the most expected time, each block saving
``prefill s/token * block_size - tier s/block``: a slow tier's run is recomputed, and so is
everything after it unless a faster run behind it wins the time back. A tier not yet measured,
or an engine whose prefill rate is not, counts as free to load (the prior: reload, as without a
cost model). A tier whose blocks were skipped ``probe_every`` times is loaded once more, so its
estimate follows a tier that recovered. ``max_load_tokens`` caps the blocks loaded per request
whatever the policy (vLLM's knob of that name). A run with a negative tier index is blocks
already in this machine's memory (the vLLM connector's writes in flight): loaded, never measured.

**Seeded when a tier opens**: :mod:`.measure` times a few reads of a probe entry and gives
:meth:`ReloadCost.seed` the tier's latency (one round trip) and its seconds per block beyond it;
the seed counts as ``min_samples`` samples, so the first requests decide on it, and real loads
take over as they come (each sample is a load's time less the latency, over its blocks). A run of
``n`` blocks from a seeded tier costs ``latency + n * seconds per block``; an unseeded tier's
latency is 0 (its per-block mean then carries it).

**A tier not worth a lookup is not asked.** A lookup is a round trip too (an object store's
membership call can cost more than recomputing a short suffix), so before a tier is asked about
``n`` blocks, :meth:`ReloadCost.worth_asking` checks that even ``n`` hits would save time
(``n * (recompute - load per block) > latency``); a tier that cannot is skipped like a recomputed
run (``skipped_lookups``, and its skips count towards the next probe).

**Why blocks were skipped** is counted per tier (``skipped_blocks_by_tier``) and per reason
(``skipped_by_reason``): ``slower_than_recompute`` (the run's own load costs more than computing
its tokens) or ``after_a_skipped_run`` (a run behind one that was cut: runs are cut, never holed).

The vLLM connector's scheduler side uses the same object, fed with the timings its worker
reports (the worker's tier reads, and the forward time of its steps over their tokens).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from corekv.offload.prefetch import TierRun

__all__ = ["POLICIES", "SKIP_REASONS", "ReloadCost"]

#: ``always``: load every tier hit (up to ``max_load_tokens``); ``cost``: only where it beats recompute
POLICIES = ("always", "cost")
#: why ``cost`` recomputed blocks a tier holds (the module docstring says what each means)
SKIP_REASONS = ("slower_than_recompute", "after_a_skipped_run")


class _Mean:
    """An exponentially weighted mean; the plain mean over its first ``1 / weight`` samples."""

    __slots__ = ("num_samples", "value")

    def __init__(self) -> None:
        self.num_samples, self.value = 0, 0.0

    def add(self, sample: float, weight: float) -> None:
        self.num_samples += 1
        self.value += (sample - self.value) * max(weight, 1.0 / self.num_samples)


class _Line:
    """Exponentially weighted least squares of ``y = a + b x`` (weights as :class:`_Mean`'s).

    :meth:`slope` is the marginal ``y`` per ``x``: a step's seconds per token *beyond* its fixed
    cost, which is what recomputing a prefix's tokens adds to a request that runs its suffix's
    step anyway. Steps of one size only (no spread in ``x``) give no slope; then the ratio of
    means (``y`` per ``x``, fixed cost included) stands in, as does any slope not in
    ``(0, ratio]`` (noise: a negative fixed cost is not a cost)."""

    __slots__ = ("num_samples", "mean_x", "mean_y", "mean_xx", "mean_xy")

    def __init__(self) -> None:
        self.num_samples = 0
        self.mean_x = self.mean_y = self.mean_xx = self.mean_xy = 0.0

    def add(self, x: float, y: float, weight: float) -> None:
        self.num_samples += 1
        w = max(weight, 1.0 / self.num_samples)
        self.mean_x += (x - self.mean_x) * w
        self.mean_y += (y - self.mean_y) * w
        self.mean_xx += (x * x - self.mean_xx) * w
        self.mean_xy += (x * y - self.mean_xy) * w

    def slope(self) -> float:
        ratio = self.mean_y / self.mean_x
        spread = self.mean_xx - self.mean_x ** 2
        if spread <= (0.05 * self.mean_x) ** 2:
            return ratio
        slope = (self.mean_xy - self.mean_x * self.mean_y) / spread
        return slope if 0.0 < slope <= ratio else ratio


class ReloadCost:
    """Measured load and prefill costs, and the per-request decision (see the module docstring).

    Invariants: an estimate is used only once it has ``min_samples`` samples; a decision never
    loads a block after one it does not load (runs are cut, never holed); ``counters`` only grow.
    Thread-safe: the prefetch thread and the engine's measure and decide.
    """

    def __init__(self, tier_names: Sequence[str], block_size: int, *, policy: str = "always",
                 max_load_tokens: int | None = None, min_samples: int = 4, probe_every: int = 32,
                 weight: float = 0.2):
        if policy not in POLICIES:
            raise ValueError(f"reload policy must be one of {POLICIES}, got {policy!r}")
        if max_load_tokens is not None and (isinstance(max_load_tokens, bool) or not isinstance(max_load_tokens, int)
                                            or max_load_tokens < 0):
            raise ValueError(f"max_load_tokens must be an int >= 0 or None (no cap), got {max_load_tokens!r}")
        if min_samples < 1 or probe_every < 1 or not 0.0 < weight <= 1.0:
            raise ValueError(f"need min_samples >= 1, probe_every >= 1 and 0 < weight <= 1, got "
                             f"{min_samples}, {probe_every}, {weight}")
        self.tier_names = list(tier_names)
        self.block_size = block_size
        self.policy = policy
        #: most blocks loaded per request (``max_load_tokens`` rounded down to whole blocks); None: no cap
        self.max_load_blocks = None if max_load_tokens is None else max_load_tokens // block_size
        self.min_samples, self.probe_every, self.weight = min_samples, probe_every, weight
        self._loads = [_Mean() for _ in self.tier_names]
        self._latency_s = [0.0] * len(self.tier_names)  # per call, from the measurement at open
        self._is_seeded = [False] * len(self.tier_names)
        self._prefill = _Line()  # tokens -> seconds of the engine's steps
        self._num_skips = [0] * len(self.tier_names)  # decisions that skipped the tier since it last loaded
        #: skipped_blocks (held by a tier, recomputed: cheaper), probes (skipped tiers loaded again)
        self.counters: Counter = Counter()
        self._skipped_by_tier: Counter = Counter()
        self._skipped_by_reason: Counter = Counter()
        self._lock = threading.Lock()

    # -- measurements ------------------------------------------------------------------------
    def seed(self, tier_index: int, *, latency_s: float, s_per_block: float) -> None:
        """Tier ``tier_index`` answered a call in ``latency_s`` and reads a block in
        ``s_per_block`` more (:mod:`.measure`, when it opened): its estimate until real loads
        outweigh it (it counts as ``min_samples`` samples)."""
        with self._lock:
            self._latency_s[tier_index] = max(0.0, latency_s)
            mean = self._loads[tier_index]
            mean.value, mean.num_samples = max(0.0, s_per_block), self.min_samples
            self._is_seeded[tier_index] = True

    def observe_load(self, tier_index: int, num_blocks: int, seconds: float) -> None:
        """Reading ``num_blocks`` blocks from tier ``tier_index`` took ``seconds`` (hits or not)."""
        if num_blocks > 0:
            with self._lock:
                per_block = max(0.0, seconds - self._latency_s[tier_index]) / num_blocks
                self._loads[tier_index].add(per_block, self.weight)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """An engine step computed ``num_tokens`` tokens in ``seconds`` (short steps are ignored:
        their fixed cost would dominate)."""
        if num_tokens >= self.block_size:
            with self._lock:
                self._prefill.add(num_tokens, seconds, self.weight)

    # -- decisions ---------------------------------------------------------------------------
    def limit(self, start: int, stop: int) -> int:
        """``stop`` capped so that at most ``max_load_blocks`` blocks from ``start`` on are loaded."""
        return stop if self.max_load_blocks is None else min(stop, start + self.max_load_blocks)

    def num_blocks_to_load(self, runs: Sequence[TierRun], *, count: bool = True) -> int:
        """How many leading blocks of ``runs`` (a lookup's tier runs, in order) to load; the rest
        are recomputed. ``count``: admission's decision (counted, and probes taken), not a
        prefetch's early look (admission decides again on what the prefetch left out)."""
        total = sum(run.num_blocks for run in runs)
        with self._lock:
            best = self._best_cut(runs, count) if self.policy == "cost" and total else total
            if count:
                self.counters["skipped_blocks"] += total - best
        return best

    def worth_asking(self, tier_index: int, num_blocks: int, *, count: bool = True) -> bool:
        """Whether tier ``tier_index`` is worth a lookup of ``num_blocks`` blocks: unmeasured, a
        probe due, or ``num_blocks`` hits would save more than the call's latency (see the module
        docstring). ``count``: admission's question (a skip counted), not a prefetch's look."""
        if self.policy != "cost":
            return True
        with self._lock:
            per_token = self._prefill_estimate()
            load_s = self._estimate(self._loads[tier_index])
            if per_token is None or load_s is None or self._num_skips[tier_index] >= self.probe_every:
                return True
            saving = num_blocks * (per_token * self.block_size - load_s) - self._latency_s[tier_index]
            if saving > 0:
                return True
            if count:
                self.counters["skipped_lookups"] += 1
                self._num_skips[tier_index] += 1
            return False

    def stats(self) -> dict:
        """The decisions' counters and the estimates (None: fewer than ``min_samples`` samples)."""
        with self._lock:
            out = {name: self.counters[name] for name in ("skipped_blocks", "skipped_lookups", "probes")}
            out["policy"] = self.policy
            out["prefill_s_per_token"] = self._prefill_estimate()
            out["load_s_per_block"] = {name: self._estimate(m) for name, m in zip(self.tier_names, self._loads)}
            out["load_latency_s"] = dict(zip(self.tier_names, self._latency_s))
            out["seeded"] = [name for name, is_seeded in zip(self.tier_names, self._is_seeded) if is_seeded]
            out["skipped_blocks_by_tier"] = {name: self._skipped_by_tier[name] for name in self.tier_names}
            out["skipped_by_reason"] = {reason: self._skipped_by_reason[reason] for reason in SKIP_REASONS}
        return out

    # -- helpers -----------------------------------------------------------------------------
    def _estimate(self, mean: _Mean) -> float | None:
        return mean.value if mean.num_samples >= self.min_samples else None

    def _prefill_estimate(self) -> float | None:
        return self._prefill.slope() if self._prefill.num_samples >= self.min_samples else None

    def _best_cut(self, runs: Sequence[TierRun], count: bool) -> int:
        """The cut (a run boundary) that saves the most expected time; with ``count``, a tier
        skipped ``probe_every`` times counts as unmeasured once (a probe)."""
        per_token = self._prefill_estimate()
        if per_token is None:
            return sum(run.num_blocks for run in runs)
        recompute_s = per_token * self.block_size  # one block's tokens
        best = pos = 0
        best_saving = saving = 0.0
        probes = set()
        run_savings = []
        for run in runs:
            in_memory = run.tier_index < 0
            load_s = 0.0 if in_memory else self._estimate(self._loads[run.tier_index])
            if count and not in_memory and load_s is not None and self._num_skips[run.tier_index] >= self.probe_every:
                probes.add(run.tier_index)
                load_s = None  # NOTE: this load measures the tier again, in case it got faster
            latency_s = 0.0 if in_memory or load_s is None else self._latency_s[run.tier_index]
            run_saving = run.num_blocks * (recompute_s - (load_s or 0.0)) - latency_s
            run_savings.append(run_saving)
            saving += run_saving
            pos += run.num_blocks
            if saving >= best_saving:  # ties load: the prior
                best, best_saving = pos, saving
        if count:
            pos, is_after_a_skip = 0, False
            for run, run_saving in zip(runs, run_savings):
                is_loaded = pos < best
                pos += run.num_blocks
                if run.tier_index < 0:
                    continue
                if not is_loaded:
                    self._skipped_by_tier[self.tier_names[run.tier_index]] += run.num_blocks
                    reason = "after_a_skipped_run" if is_after_a_skip or run_saving >= 0 else "slower_than_recompute"
                    self._skipped_by_reason[reason] += run.num_blocks
                    is_after_a_skip = True
                self._num_skips[run.tier_index] = 0 if is_loaded else self._num_skips[run.tier_index] + 1
                if is_loaded and run.tier_index in probes:
                    self.counters["probes"] += 1
                    probes.discard(run.tier_index)
        return best
