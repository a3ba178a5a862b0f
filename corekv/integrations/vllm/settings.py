"""What the connector reads: corekv's cache config, and vLLM's model, KV layout and parallelism.

``kv_connector_extra_config`` takes ``config`` (a corekv YAML file; default: the file named by
``COREKV_CONFIG``) and optionally ``fingerprint`` (a string naming the model's weights, instead
of hashing the weight files at start). The YAML's ``cache`` section applies (``tiers``, ``hash``,
``write_policy``, ``admission``, ``offload_min_hits``, ``offload_queue_blocks``, ``integrity``); fields about
corekv's own engine make no sense where vLLM owns the model and the device cache and are refused
by name (:data:`REFUSED`).

The model fingerprint (the root of every block key and the check in every entry) covers the
model's config, its weight files' bytes, vLLM's KV dtype and block size, and the attention
layout inside a block (platform, backend, and on CPU the kernel ISA, which decides how K is laid
out), so a store is never read by a model, a dtype or a layout it was not written by.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from corekv.config import CacheConfig
from corekv.config.sources import CONFIG_ENV, read_config, read_yaml_file
from corekv.errors import ConfigError
from corekv.hashing import chain_seed

__all__ = ["ConnectorSettings", "REFUSED", "read_settings"]

#: config fields the connector refuses, with the reason given in the error
REFUSED = {
    "engine": "vLLM's engine arguments set block size, memory and scheduling",
    "model": "vLLM loads the model (--model)",
    "dtype": "vLLM sets the dtype (--dtype)",
    "device": "vLLM picks the device",
    "kv_events": "vLLM publishes the connector's KV events itself (--kv-events-config)",
    "cache.backend": "vLLM's own prefix cache is the device cache",
    "cache.backend_options": "vLLM's own prefix cache is the device cache",
    "cache.max_pinned_fraction": "vLLM's own prefix cache is the device cache",
    "cache.prefetch_blocks": "the connector loads in the step that needs the blocks",
    "cache.pinned": "pinned prefixes are not supported inside vLLM yet (corekv's own engine pins them)",
}
_EXTRA_KEYS = ("config", "fingerprint")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# NOTE: the keys of a model config that say where or how it was saved, not what it computes
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
                         "_attn_implementation_internal", "architectures", "torch_dtype", "dtype")


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything both sides of the connector derive alike from the configs (so keys agree)."""

    cache: CacheConfig
    plugin_manager: Any
    config_path: str
    block_size: int
    num_layers: int
    page_bytes: int
    fingerprint: str

    @property
    def store_key(self) -> tuple[str, str]:
        """Names the tiers: the same config file for the same model (see :mod:`.shared_tiers`)."""
        return (self.config_path, self.fingerprint)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def block_shape(self) -> tuple[int, int]:
        return (self.num_layers, self.page_bytes)

    @functools.cached_property
    def _seeds(self):
        return functools.lru_cache(maxsize=4096)(
            lambda salt, extra: chain_seed(self.fingerprint, self.block_size, salt, extra, algorithm=self.cache.hash))

    def namespace(self, cache_salt: str | None, extra_keys: tuple[str, ...] = ()) -> bytes:
        """The chain seed of a request's blocks (bounded cache: salts are per tenant)."""
        return self._seeds(cache_salt or None, extra_keys)


def read_settings(vllm_config, kv_cache_config) -> ConnectorSettings:
    """Check vLLM's configs and the connector's extra config; raise :class:`ConfigError` naming the field."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; the corekv connector "
                          f"takes {list(_EXTRA_KEYS)}", path="kv_connector_extra_config")
    path = extra.get("config") or os.environ.get(CONFIG_ENV)
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError("kv_connector_extra_config.config: name corekv's cache config, a YAML file "
                          f"with cache.tiers (or set {CONFIG_ENV}), e.g. {{\"config\": \"cache.yaml\"}}",
                          path="kv_connector_extra_config.config")
    _refuse_fields(read_yaml_file(Path(path)), str(path))
    config, plugin_manager = read_config(path)
    if not config.cache.tiers:
        raise ConfigError(f"cache.tiers in {path}: the corekv connector needs at least one tier "
                          "(e.g. - {type: lmdb, path: ./kvstore, size: 20GiB})", path="cache.tiers")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise ConfigError("the corekv connector supports one worker (tensor and pipeline parallel size "
                          f"1), got tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size}")
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
        raise ConfigError("the corekv connector supports models with one KV cache group (full attention "
                          "in every layer); this model has "
                          f"{len(kv_cache_config.kv_cache_groups) if kv_cache_config else 'no'} groups")
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        raise ConfigError(f"the corekv connector supports full attention KV; this model's is {type(spec).__name__}")
    block_size = vllm_config.cache_config.block_size
    layout = _kv_layout(vllm_config, spec)
    given = extra.get("fingerprint")
    if given is not None and (not isinstance(given, str) or not given.strip()):
        raise ConfigError(f"kv_connector_extra_config.fingerprint must be a non-empty string naming the "
                          f"model's weights, got {given!r}", path="kv_connector_extra_config.fingerprint")
    fingerprint = _fingerprint(vllm_config.model_config, given, layout=layout, block_size=block_size,
                               num_layers=len(group.layer_names), page_bytes=spec.page_size_bytes,
                               cache_dtype=str(vllm_config.cache_config.cache_dtype))
    return ConnectorSettings(cache=config.cache, plugin_manager=plugin_manager, config_path=os.path.realpath(path),
                             block_size=block_size, num_layers=len(group.layer_names),
                             page_bytes=spec.page_size_bytes, fingerprint=fingerprint)


def _refuse_fields(raw: Any, path: str) -> None:
    if not isinstance(raw, Mapping):
        return  # read_config names the problem
    cache = raw.get("cache") if isinstance(raw.get("cache"), Mapping) else {}
    present = [f for f in REFUSED if (f[6:] in cache if f.startswith("cache.") else f in raw)]
    present += [f for f in REFUSED if "." not in f and f"COREKV_{f.upper()}" in os.environ]
    if present:
        reasons = "; ".join(f"{f}: {REFUSED[f]}" for f in present)
        raise ConfigError(f"{path}: field(s) {present} do not apply inside vLLM and are refused ({reasons}); "
                          "remove them: the connector reads the cache section (tiers, hash, write_policy, "
                          "admission, offload_min_hits, offload_queue_blocks, integrity)", path=present[0])


def _kv_layout(vllm_config, spec) -> str:
    """Names how one block's bytes are laid out, the same in the scheduler and the worker."""
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype)
        return f"cpu/CPU_ATTN/{isa}/{spec.num_kv_heads}x{spec.head_size}"
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    backend = getattr(vllm_config.attention_config, "backend", None)
    return (f"{device}/{getattr(backend, 'name', backend) or 'auto'}/{get_kv_connector_cache_layout()}/"
            f"{spec.num_kv_heads}x{spec.head_size}")


def _fingerprint(model_config, given: str | None, **layout: Any) -> str:
    digest = xxhash.xxh3_128()
    hf = {k: v for k, v in model_config.hf_config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    parts = {"hf_config": hf, "dtype": str(model_config.dtype), **layout,
             "weights": given if given is not None else _weights_digest(model_config)}
    digest.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _weights_digest(model_config) -> str:
    folder = Path(model_config.model)
    if not folder.is_dir():
        revision = model_config.revision or getattr(model_config.hf_config, "_commit_hash", None)
        if not revision:
            raise ConfigError(f"the corekv connector cannot identify the weights of {model_config.model!r} "
                              "(not a local folder, no revision); pass a pinned --revision, or "
                              "kv_connector_extra_config.fingerprint naming the weights",
                              path="kv_connector_extra_config.fingerprint")
        return f"{model_config.model}@{revision}"
    files = sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError(f"the corekv connector found no weight files in {folder}; pass "
                          "kv_connector_extra_config.fingerprint naming the weights",
                          path="kv_connector_extra_config.fingerprint")
    return _hash_files(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=8)
def _hash_files(files: tuple[tuple[str, int, int], ...]) -> str:
    """xxh3-128 over every weight file's name and bytes (once per process per set of files)."""
    digest = xxhash.xxh3_128()
    for path, size, _ in files:
        digest.update(f"{os.path.basename(path)}|{size}|".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
