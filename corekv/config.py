"""Configuration: frozen dataclasses, one per area, loaded from YAML or a mapping.

(The dataclass shapes below are the contract the engine, backends and tiers read; loading and
validation — ``load_config`` — live in this module too.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    #: bytes of KV pool (parsed from "256MiB"); ignored when num_blocks is set
    kv_cache_memory: int | None = 256 * 1024**2
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    scheduling: str = "lpm"  # lpm | fcfs
    preemption: str = "recompute"  # recompute | swap
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class PinnedPrefix:
    """One ``cache.pinned`` entry: exactly one of ``text`` / ``token_ids``; optional salt."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    salt: str | None = None
    #: apply the model's chat template (as a system message) to ``text``
    chat: bool = False


@dataclass(frozen=True)
class TierConfig:
    """One ``cache.tiers`` entry. ``options`` holds the tier's own fields, validated against the
    options schema its plugin declares (sizes already converted to bytes)."""

    type: str
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheConfig:
    backend: str = "radix"
    #: the backend's own options, validated against its declared schema
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    hash: str = "xxh3_128"  # xxh3_128 | sha256
    write_policy: str = "write_back"  # write_back | write_through
    max_pinned_fraction: float = 0.2
    pinned: tuple[PinnedPrefix, ...] = ()
    tiers: tuple[TierConfig, ...] = ()


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    plugins: tuple[str, ...] = ()
