"""The connector's settings (corekv.integrations.vllm.settings) on vLLM's own KV-cache spec classes
and a stand-in for vLLM's config object (the fields the connector reads, as plain attributes):
what is refused with which message, and what goes into the model fingerprint. No vLLM engine runs."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from corekv.errors import ConfigError
from corekv.integrations.vllm.connector import CoreKVConnector
from corekv.integrations.vllm.settings import read_settings


def kv_cache_config(spec=None, groups: int = 1) -> KVCacheConfig:
    spec = spec or FullAttentionSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for _ in range(groups)])


def vllm_config(model_dir, extra: dict, *, tp: int = 1, hf: dict | None = None):
    hf_config = SimpleNamespace(to_dict=lambda: dict(hf or {"hidden_size": 576, "num_hidden_layers": 30}))
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        model_config=SimpleNamespace(model=str(model_dir), revision=None, dtype=torch.float32, hf_config=hf_config),
        attention_config=SimpleNamespace(backend=None))


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights v1")
    return folder


def config_file(tmp_path, data: dict) -> str:
    path = tmp_path / "cache.yaml"
    path.write_text(json.dumps(data))
    return str(path)


LMDB = {"cache": {"tiers": [{"type": "lmdb", "path": "kvstore", "size": "1GiB"}]}}


@pytest.mark.parametrize("field, data", [
    ("engine", {"engine": {"block_size": 16}, **LMDB}),
    ("model", {"model": "smollm2-135m-instruct", **LMDB}),
    ("cache.backend", {"cache": {"backend": "radix", **LMDB["cache"]}}),
    ("cache.pinned", {"cache": {"pinned": [{"text": "You are helpful."}], **LMDB["cache"]}}),
    ("kv_events", {"kv_events": {"enabled": True}, **LMDB}),
])
def test_fields_about_corekvs_own_engine_are_refused_by_name(tmp_path, model_dir, field, data):
    with pytest.raises(ConfigError, match=f"{field}.*do not apply inside vLLM") as e:
        read_settings(vllm_config(model_dir, {"config": config_file(tmp_path, data)}), kv_cache_config())
    assert e.value.path == field


@pytest.mark.parametrize("extra, match", [
    ({}, "kv_connector_extra_config.config: name corekv's cache config"),
    ({"config": "x.yaml", "store": "y"}, r"unknown key\(s\) \['store'\]"),
    ({"config": "missing.yaml"}, "not found"),
    ({"config": "CFG", "fingerprint": ""}, "fingerprint must be a non-empty string"),
])
def test_the_extra_config_is_checked(tmp_path, model_dir, monkeypatch, extra, match):
    monkeypatch.delenv("COREKV_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    if extra.get("config") == "CFG":
        extra["config"] = config_file(tmp_path, LMDB)
    with pytest.raises(ConfigError, match=match):
        read_settings(vllm_config(model_dir, extra), kv_cache_config())


def test_a_config_without_tiers_and_unsupported_models_are_refused(tmp_path, model_dir):
    extra = {"config": config_file(tmp_path, LMDB)}
    with pytest.raises(ConfigError, match="tensor and pipeline parallel size 1"):
        read_settings(vllm_config(model_dir, extra, tp=2), kv_cache_config())
    with pytest.raises(ConfigError, match="one KV cache group"):
        read_settings(vllm_config(model_dir, extra), kv_cache_config(groups=2))
    window = SlidingWindowSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.float32, sliding_window=128)
    with pytest.raises(ConfigError, match="full attention KV"):
        read_settings(vllm_config(model_dir, extra), kv_cache_config(window))
    extra = {"config": config_file(tmp_path, {"cache": {"tiers": []}})}
    with pytest.raises(ConfigError, match="needs at least one tier"):
        read_settings(vllm_config(model_dir, extra), kv_cache_config())


def test_the_fingerprint_changes_with_the_weights_config_dtype_and_block_layout(tmp_path, model_dir):
    extra = {"config": config_file(tmp_path, LMDB)}
    base = read_settings(vllm_config(model_dir, extra), kv_cache_config()).fingerprint
    assert read_settings(vllm_config(model_dir, extra), kv_cache_config()).fingerprint == base  # stable
    (model_dir / "model.safetensors").write_bytes(b"weights v2")  # a fine-tune: same config, other weights
    assert read_settings(vllm_config(model_dir, extra), kv_cache_config()).fingerprint != base
    (model_dir / "model.safetensors").write_bytes(b"weights v1")
    assert read_settings(vllm_config(model_dir, extra), kv_cache_config()).fingerprint == base
    other = vllm_config(model_dir, extra, hf={"hidden_size": 576, "num_hidden_layers": 31})
    assert read_settings(other, kv_cache_config()).fingerprint != base
    bf16 = FullAttentionSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    assert read_settings(vllm_config(model_dir, extra), kv_cache_config(bf16)).fingerprint != base
    named = read_settings(vllm_config(model_dir, {**extra, "fingerprint": "smollm2@v1"}), kv_cache_config())
    assert named.fingerprint != base and named.block_shape == (30, 32 * 3 * 64 * 2 * 4)


def test_the_workers_counters_reach_vllms_stats_summed():
    stats = CoreKVConnector.build_kv_connector_stats({"loaded_blocks": 3, "load_errors": 1})
    stats.aggregate(CoreKVConnector.build_kv_connector_stats({"loaded_blocks": 2, "saved_blocks": 5}))
    assert stats.reduce() == {"loaded_blocks": 5, "load_errors": 1, "saved_blocks": 5}
    assert not stats.is_empty() and CoreKVConnector.build_kv_connector_stats({}).is_empty()
