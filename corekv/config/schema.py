"""The configuration's shape: frozen dataclasses, one per area, and the per-field metadata
(help text and :class:`~corekv.config.values.Check` arguments) that reading, dumping and the
reference all use.

The dataclass shapes are the contract the engine, backends and tiers read. The sections plugins
declare (:class:`corekv.plugin.ConfigSectionSpec`) are not dataclasses here: their validated values
sit in :attr:`Config.sections` as :class:`Section` objects, read as ``cfg.kv_events.enabled``.
Nothing here checks values: :mod:`corekv.config.reader` does, once, for a config read from data.
"""
from __future__ import annotations

import functools
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, FrozenInstanceError, dataclass, field, fields
from typing import Any

from corekv.config.values import Check, did_you_mean
from corekv.errors import ConfigError


def _field(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **check: Any) -> Any:
    """A dataclass field whose metadata holds its help text and its :class:`Check` arguments."""
    return field(default=default, default_factory=factory, metadata={"help": help, "check": check})


@dataclass(frozen=True)
class SpeculativeConfig:
    """``engine.speculative``: propose a few tokens per decoding sequence and let the model verify
    them in one forward (off while ``method`` is unset). The reader checks that the fields given
    belong to the method chosen."""

    method: str | None = _field(None, "how drafts are proposed: ngram (the tokens that followed the "
                                "last earlier occurrence of the sequence's newest tokens: pays on "
                                "output that copies its input, such as edits and summaries) or draft "
                                "(a smaller model with the same tokenizer, greedy); unset: off",
                                choices=("ngram", "draft"))
    num_speculative_tokens: int = _field(4, "most draft tokens verified per sequence and step",
                                         minimum=1, maximum=16)
    prompt_lookup_min: int = _field(2, "ngram: the shortest n-gram of the newest tokens looked up",
                                    minimum=1)
    prompt_lookup_max: int = _field(5, "ngram: the longest n-gram looked up (the longest that occurs "
                                    "earlier wins)", minimum=1)
    model: str | None = _field(None, "draft: the draft model (an alias, a Hugging Face model folder "
                               "or a .gguf file), loaded with the engine's dtype and device")
    adaptive: bool = _field(True, "give each sequence the drafts that pay for their verification, "
                            "from its recent acceptance rate and the measured cost of a step per token "
                            "(off on large batches whose drafts are rarely accepted); false: always "
                            "num_speculative_tokens where the proposer has them")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's pool and scheduler. Exactly one of ``kv_cache_memory`` / ``num_blocks`` is
    set after loading: ``num_blocks`` wins when given (and ``kv_cache_memory`` becomes ``None``)."""

    block_size: int = _field(16, "tokens per KV block, the unit of caching and offload",
                             power_of_two=True, minimum=1)
    kv_cache_memory: int | None = _field(256 * 1024**2, "device memory for the KV pool; ignored "
                                         "when num_blocks is set", kind="size", minimum=1)
    num_blocks: int | None = _field(None, "size of the KV pool in blocks; wins over "
                                    "kv_cache_memory when both are given", minimum=1)
    max_num_seqs: int = _field(32, "most sequences in one batch", minimum=1)
    max_num_batched_tokens: int = _field(1024, "most tokens computed in one step", minimum=1)
    scheduling: str = _field("lpm", "waiting-queue order. lpm: longest cached prefix first, for "
                             "traffic whose hot prefixes stay cached (arrival order past 128 "
                             "waiting); dfs-weight: requests sharing a prefix one after another, "
                             "the biggest group first, for large batches of grouped prompts and a "
                             "pool smaller than them; lof: most max_tokens left first, so long "
                             "generations do not finish alone; fcfs: arrival order",
                             choices=("lpm", "fcfs", "dfs-weight", "lof"))
    preemption: str = _field("recompute", "what happens to a preempted sequence's KV",
                             choices=("recompute", "swap"))
    prefill_first: bool = _field(False, "a prompt that has produced no token yet and finds the pool "
                                 "full preempts running decodes (newest first) for its blocks, so "
                                 "first tokens come before the rest of other requests' outputs: lower "
                                 "mean TTFT when the pool cannot hold every request, paid for by "
                                 "swapping the preempted KV out and back in; needs preemption: swap")
    enable_prefix_caching: bool = _field(True, "reuse cached prefixes across requests")
    enable_chunked_prefill: bool = _field(True, "split long prompts across steps so decodes keep "
                                          "running; off: a prompt is prefilled in one step")
    compile: bool = _field(False, "compile the model's forward with torch.compile (inductor; "
                           "corekv's paged attention stays one opaque op) when the engine starts: a "
                           "start-up cost of a minute or two, faster steps on some CPUs only (slower on "
                           "AVX2 machines); bfloat16's greedy tokens are not bit-identical to eager "
                           "bfloat16's")
    cpu_kernels: str = _field("auto", "on a CPU device, float32 or bfloat16: corekv's native kernels "
                              "(paged decode and prefill attention, the linears of decode-sized steps) "
                              "for the CPU's instruction set, built with g++ and ninja once per machine "
                              "(about a minute, then cached). auto: native where they build, else the "
                              "torch path with a warning; native: required (a failed build is an error); "
                              "torch: never build them", choices=("auto", "native", "torch"))
    threads: int | None = _field(None, "threads the engine computes with (torch, OpenMP and the native "
                                 "kernels; process-wide); unset: the CPUs this process may use (its "
                                 "affinity and cgroup CPU quota), or OMP_NUM_THREADS where set",
                                 minimum=1)
    tune_cpu_malloc: bool = _field(True, "on a CPU device with glibc: keep freed activation "
                                   "buffers in the heap (mallopt) instead of page-faulting them in "
                                   "again every layer; off: leave the process's malloc as it is")
    speculative: SpeculativeConfig = _field(help="speculative decoding (off by default)",
                                            factory=SpeculativeConfig)


@dataclass(frozen=True)
class PinnedPrefix:
    """One ``cache.pinned`` entry: exactly one of ``text`` / ``token_ids``; optional salt."""

    text: str | None = _field(None, "the prefix as text (tokenized by the model's tokenizer)")
    token_ids: tuple[int, ...] | None = _field(None, "the prefix as token ids", minimum=0)
    salt: str | None = _field(None, "the cache_salt (tenant) the prefix is pinned for")
    chat: bool = _field(False, "apply the model's chat template (as a system message) to text")
    priority: int = _field(0, "eviction priority of its blocks under the priority eviction policy "
                           "(higher is kept longer; what keeps them if it is ever unpinned)")


@dataclass(frozen=True)
class TierConfig:
    """One ``cache.tiers`` entry. ``options`` holds the tier's own fields, validated against the
    options schema its plugin declares (sizes already converted to bytes, defaults filled in)."""

    type: str = _field(help="the tier plugin's name (see `corekv plugins`)")
    name: str = _field(help="a unique name for this tier in stats and events; defaults to type")
    options: Mapping[str, Any] = _field(help="every other key: the options the tier type declares",
                                        factory=dict)
    required: bool = _field(False, "an engine refuses to start when this tier cannot (false: it "
                            "starts without the tier, logs why once and counts it in stats)")


@dataclass(frozen=True)
class IntegrityConfig:
    """``cache.integrity``: a secret that turns every tier entry's checksum into a keyed MAC."""

    key_env: str | None = _field(None, "the environment variable that holds the secret (16-64 "
                                 "bytes; an even number of hex digits is decoded); set, every "
                                 "entry carries a keyed BLAKE2b MAC over its key, header and KV, "
                                 "and an entry without a valid one is a miss: turn it on for "
                                 "tiers others can write to (redis, fsspec, shared disks)",
                                 pattern=r"[A-Za-z_][A-Za-z0-9_]*",
                                 pattern_text="an environment variable name such as COREKV_TIER_KEY")

    def secret(self, env: Mapping[str, str] | None = None) -> bytes | None:
        """The secret named by ``key_env`` (``None`` when unset); raises :class:`ConfigError`
        when the variable is missing or the secret is too short or too long."""
        from corekv.block_format import check_secret  # NOTE: only engines read the secret

        if self.key_env is None:
            return None
        value = (os.environ if env is None else env).get(self.key_env, "")
        if not value:
            raise ConfigError(f"cache.integrity.key_env: the environment variable {self.key_env} "
                              "is not set or empty; export it with the tier secret (e.g. "
                              f"`export {self.key_env}=$(openssl rand -hex 32)`) in every process "
                              "that shares the tiers", path="cache.integrity.key_env")
        try:
            secret = bytes.fromhex(value) if len(value) % 2 == 0 else value.encode()
        except ValueError:
            secret = value.encode()
        try:
            return check_secret(secret)
        except ValueError as e:
            raise ConfigError(f"cache.integrity.key_env: ${self.key_env}: {e}",
                              path="cache.integrity.key_env") from e


@dataclass(frozen=True)
class CacheConfig:
    """The prefix cache: which backend indexes the device pool, and the tiers below it."""

    backend: str = _field("radix", "the prefix-cache backend plugin (see `corekv plugins`)")
    backend_options: Mapping[str, Any] = _field(help="the options the backend declares",
                                                factory=dict)
    hash: str = _field("xxh3_128", "block hash function", choices=("xxh3_128", "sha256"))
    write_policy: str = _field("write_back", "offload a block when its device slot is reused "
                               "(write_back) or as soon as it is full (write_through)",
                               choices=("write_back", "write_through"))
    max_pinned_fraction: float = _field(0.2, "most of the pool that pinned prefixes may hold",
                                        minimum=0.0, maximum=1.0)
    offload_min_hits: int = _field(0, "offload only blocks hit at least this often on the device "
                                   "(keeps never-reused blocks off SSDs); 0 offloads every block",
                                   minimum=0)
    admission: str = _field("min_hits", "which cached blocks go to the tiers: min_hits (the rule of "
                            "offload_min_hits) or a plugin's admission policy (see `corekv plugins`)")
    offload_queue_blocks: int = _field(256, "most blocks waiting for the background tier writer; "
                                       "past it offloads are skipped and counted", minimum=1)
    prefetch_blocks: int | None = _field(None, "most blocks read ahead from the tiers into host "
                                         "staging when requests arrive (unset: the device pool's "
                                         "size; 0 turns prefetch off)", minimum=0)
    reload_policy: str = _field("always", "which tier hits a request loads: all of them (always), or "
                                "only where the measured load time beats recomputing the tokens "
                                "(cost; unmeasured tiers load)", choices=("always", "cost"))
    max_load_tokens: int | None = _field(None, "most tokens a request loads from the tiers (whole "
                                         "blocks; the rest are recomputed); unset: no cap", minimum=0)
    pinned: tuple[PinnedPrefix, ...] = _field((), "prefixes warmed and pinned when an engine starts")
    tiers: tuple[TierConfig, ...] = _field((), "storage tiers below the device pool, searched in order")
    integrity: IntegrityConfig = _field(help="keyed integrity of tier entries",
                                        factory=IntegrityConfig)


class Section(Mapping):
    """One plugin's config section as ``load_config`` validated it: every option its
    :class:`corekv.plugin.ConfigSectionSpec` declares, defaults filled in. Read it as a mapping
    (``section["endpoint"]``) or by attribute (``section.endpoint``); it equals a dict with the same
    items.

    Invariant: immutable, like the dataclasses (a value derived at run time belongs in the
    plugin's runtime objects, not back in the config).
    """

    def __init__(self, name: str, values: Mapping[str, Any]):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, key: str) -> Any:
        # NOTE: only called when normal lookup fails; private and dunder names (pickle and copy ask
        # for __setstate__ before _values exists) are never options.
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self._values[key]
        except KeyError:
            hint = did_you_mean(key, self._values)
            raise AttributeError(f"config section {self._name!r} has no option {key!r}{hint}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to option {key!r} of config section {self._name!r}")

    def __delattr__(self, key: str) -> None:
        raise FrozenInstanceError(f"cannot delete option {key!r} of config section {self._name!r}")

    def __repr__(self) -> str:
        return f"Section({self._name!r}, {self._values!r})"


@dataclass(frozen=True)
class Config:
    """The whole configuration (the YAML file's top level).

    ``sections`` holds the sections plugins declare, by name; each is also an attribute
    (``cfg.kv_events``). A config read by ``load_config`` has one for every registered section;
    a config built by hand has those it is given, and a plugin whose section is absent does
    nothing.
    """

    model: str = _field("smollm2-135m-instruct", "a model alias, a Hugging Face model folder, "
                        "or a .gguf file")
    dtype: str = _field("float32", "weights and KV dtype", choices=("float32", "bfloat16", "float16"))
    device: str = _field("auto", "cuda when available, else cpu", pattern=r"auto|cpu|cuda(:\d+)?",
                         pattern_text="auto, cpu, cuda or cuda:N (e.g. cuda:0)",
                         suggestions=("auto", "cpu", "cuda"))
    engine: EngineConfig = _field(help="the engine", factory=EngineConfig)
    cache: CacheConfig = _field(help="the prefix cache and its tiers", factory=CacheConfig)
    #: NOTE: in the file each section is a top-level key of its own, here (in field order)
    sections: Mapping[str, Section] = _field(help="the sections plugins declare, each a top-level "
                                             "key (e.g. kv_events)", factory=dict)
    plugins: tuple[str, ...] = _field((), "modules to load as plugins besides the installed "
                                      "entry points (e.g. my_package.my_plugin)")

    def __post_init__(self) -> None:
        # NOTE: a config built by hand may give a section as a plain dict; it reads like a loaded one
        if any(not isinstance(v, Section) for v in self.sections.values()):
            object.__setattr__(self, "sections", {name: v if isinstance(v, Section) else Section(name, v)
                                                  for name, v in self.sections.items()})

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            sections = self.__dict__.get("sections") or {}
            if name in sections:
                return sections[name]
            hint = did_you_mean(name, [f.name for f in fields(Config)] + list(sections))
            raise AttributeError(f"Config has no field or section {name!r}{hint} (plugin sections: "
                                 f"{', '.join(sections) or 'none'})")
        raise AttributeError(name)


#: the top-level keys of the file that are corekv's own (``sections`` stands for the plugins')
CORE_KEYS = tuple(f.name for f in fields(Config) if f.name != "sections")


def top_level_keys(section_names: typing.Iterable[str]) -> list[str]:
    """The keys a config file's top level may have, in field order, with the plugins' section
    names where the ``sections`` field is (``model, ..., cache, kv_events, plugins``)."""
    keys: list[str] = []
    for f in fields(Config):
        keys.extend(section_names if f.name == "sections" else [f.name])
    return keys


@functools.cache
def field_types(cls: type) -> dict[str, tuple[Any, bool, bool]]:
    """``{field: (item type, is a list, accepts None)}`` from the dataclass's type hints."""
    result = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        is_list = typing.get_origin(hint) is tuple
        result[name] = (typing.get_args(hint)[0] if is_list else hint, is_list, optional)
    return result


def field_check(cls: type, f: Field) -> Check:
    """The :class:`Check` a scalar field (or each item of a list field) must pass."""
    check = dict(f.metadata["check"])
    item_type = field_types(cls)[f.name][0]
    kind = check.pop("kind", None) or {int: "int", float: "float", str: "str", bool: "bool"}[item_type]
    return Check(kind, **check)
