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


def fake_request(req_id: str, tokens: list[int], num_computed: int = 0):
    """The fields of vLLM's Request the scheduler side reads (no KV-event hashes: none published)."""
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens, num_tokens=len(tokens),
                           num_prompt_tokens=len(tokens), num_computed_tokens=num_computed, mm_features=None,
                           prompt_embeds=None, lora_request=None, cache_salt=None, block_hashes=[], priority=0)


def step(side, req, block_ids):
    """One scheduler step that computes all of ``req``'s tokens."""
    output = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
                             num_scheduled_tokens={req.request_id: req.num_tokens})
    plan = side.build_plan(output)
    req.num_computed_tokens = req.num_tokens
    return plan


def test_a_request_following_its_own_write_loads_it_at_once_from_the_write_in_flight(tmp_path, model_dir):
    """Both sides of the connector on real tiers (shm, then LMDB) and a real CPU KV layout, with
    vLLM's engine replaced by the calls it makes. A request that follows another at once is told
    "not yet" only until the other's saves reach the worker; then it loads them, bit for bit,
    from the worker's writes in flight (the tiers' writes are held back here by a gate, a stand-in
    for a slow tier), and once the worker reports them done, from the shm tier."""
    import shutil
    import threading

    from corekv.integrations.vllm.scheduler import SchedulerSide
    from corekv.integrations.vllm.worker import WorkerSide
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    shm = f"/dev/shm/corekv-test-sides-{tmp_path.name}"
    cfg = {"cache": {"tiers": [{"type": "shm", "path": shm, "size": "256MiB"},
                               {"type": "lmdb", "path": str(tmp_path / "kv"), "size": "256MiB", "sync": False}]}}
    settings = read_settings(vllm_config(model_dir, {"config": config_file(tmp_path, cfg)}), kv_cache_config())
    scheduler = SchedulerSide(settings, same_process=True)
    worker = WorkerSide(settings, num_blocks=24)
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(24, 3, 32, 128) for i in range(30)}
    worker.register(layers)
    gate = threading.Event()
    for tier in worker.offload.tiers:
        write = tier._write_entries
        tier._write_entries = lambda items, write=write: (gate.wait(60), write(items))[1]
    try:
        tokens = list(range(1000, 1200))  # 6 full blocks of 32 and a partial one
        first = fake_request("first", tokens)
        assert scheduler.matched_tokens(first, 0) == 0
        scheduler.allocated(first, list(range(7)), 0)
        worker.save(step(scheduler, first, list(range(7))))
        assert scheduler.finished(first, list(range(7)))  # write-back: vLLM keeps the blocks until saved
        second = fake_request("second", tokens)
        assert scheduler.matched_tokens(second, 0) is None  # its saves are not at the worker yet
        plan = step(scheduler, fake_request("idle", [1]), [])
        assert [s.block_ids for s in plan.saves] == [list(range(6))] and plan.saves[0].finished
        worker.save(plan)  # copied out; the tier writes wait at the gate

        assert scheduler.matched_tokens(second, 0) == 6 * 32
        scheduler.allocated(second, list(range(8, 15)), 6 * 32)
        assert scheduler.hit_sources(second, 6 * 32) == {CacheHitSource.HOST: 6 * 32}
        load_plan = step(scheduler, second, list(range(8, 15)))
        assert [load.block_ids for load in load_plan.loads] == [list(range(8, 14))]
        worker.load(load_plan)
        assert worker.load_errors() == set() and worker.take_counters()["loaded_blocks"] == 6
        for kv in layers.values():
            assert torch.equal(kv[8:14], kv[0:6])

        gate.set()
        worker.offload.flush()
        assert worker.finished_saving() == {"first"}
        scheduler.reported(worker.report())
        assert not scheduler.planner.in_flight
        third = fake_request("third", tokens)
        assert scheduler.matched_tokens(third, 0) == 6 * 32  # now from the shm tier
        scheduler.allocated(third, list(range(16, 23)), 6 * 32)
        worker.load(step(scheduler, third, list(range(16, 23))))
        assert worker.load_errors() == set()
        for kv in layers.values():
            assert torch.equal(kv[16:22], kv[0:6])
        assert scheduler.reset_cache() and scheduler.matched_tokens(fake_request("fourth", tokens), 0) == 0
    finally:
        gate.set()
        worker.close()
        scheduler.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_transfer_config_names_the_connector_and_the_config(tmp_path):
    from corekv.integrations.vllm import transfer_config

    made = transfer_config(tmp_path / "cache.yaml", fingerprint="smollm2@v1")
    assert (made.kv_connector, made.kv_connector_module_path, made.kv_role) == (
        "CoreKVConnector", "corekv.integrations.vllm", "kv_both")
    assert made.kv_connector_extra_config == {"config": str(tmp_path / "cache.yaml"), "fingerprint": "smollm2@v1"}


def test_the_scheduler_loads_only_what_beats_recompute_from_the_workers_timings(tmp_path, model_dir):
    """``cache.reload_policy: cost`` in the connector: the worker times its real LMDB reads and
    its steps and reports them; the scheduler's cost model learns from the reports. The prefill
    rates are injected reports (a forward is not run here): a slow recompute loads the tier's
    blocks, a fast one recomputes them (the tier not even asked, counted), ``always`` loads them whatever."""
    from corekv.integrations.vllm.metadata import StepReport
    from corekv.integrations.vllm.scheduler import SchedulerSide
    from corekv.integrations.vllm.worker import WorkerSide

    def sides(policy):
        cfg = {"cache": {"reload_policy": policy,
                         "tiers": [{"type": "lmdb", "path": str(tmp_path / "kv"), "size": "256MiB", "sync": False}]}}
        settings = read_settings(vllm_config(model_dir, {"config": config_file(tmp_path, cfg)}), kv_cache_config())
        return SchedulerSide(settings, same_process=True), WorkerSide(settings, num_blocks=24)

    tokens = list(range(1000, 1200))  # 6 full blocks of 32 and a partial one
    scheduler, worker = sides("cost")
    worker.register({f"model.layers.{i}.self_attn.attn": torch.randn(24, 3, 32, 128) for i in range(30)})
    try:
        first = fake_request("first", tokens)
        scheduler.matched_tokens(first, 0)
        scheduler.allocated(first, list(range(7)), 0)
        worker.step_started()
        worker.save(step(scheduler, first, list(range(7))))
        scheduler.finished(first, list(range(7)))
        worker.save(step(scheduler, fake_request("idle", [1]), []))
        worker.offload.flush()
        report = worker.report()
        assert [n for n, _ in report.step_timings] == [len(tokens)]  # the forward of first's step
        scheduler.reported(report)

        slow_recompute = StepReport(step_timings=[(256, 256 * 1.0)] * 4)  # 1 s a token
        scheduler.reported(slow_recompute)
        for i in range(4):  # real LMDB reads, timed by the worker
            req = fake_request(f"r{i}", tokens)
            assert scheduler.matched_tokens(req, 0) == 6 * 32
            scheduler.allocated(req, list(range(8, 15)), 6 * 32)
            worker.load(step(scheduler, req, list(range(8, 15))))
            assert worker.load_errors() == set()
            report = worker.report()
            assert {name for name, _, _ in report.load_timings} == {"lmdb"}
            scheduler.reported(report)
        assert scheduler.cost.stats()["load_s_per_block"]["lmdb"] > 0

        scheduler.reported(StepReport(step_timings=[(256, 1e-9)] * 200))  # recompute all but free (a mean of recent samples)
        assert scheduler.matched_tokens(fake_request("fast", tokens), 0) == 0
        assert scheduler.cost.stats()["skipped_lookups"] == 1  # not even asked: 6 hits could not pay
    finally:
        worker.close()
        scheduler.close()

    always, worker = sides("always")
    try:
        always.reported(StepReport(step_timings=[(256, 1e-9)] * 40, load_timings=[("lmdb", 1, 10.0)] * 8))
        assert always.matched_tokens(fake_request("any", tokens), 0) == 6 * 32
    finally:
        worker.close()
        always.close()


def test_a_saved_block_takes_vllms_request_priority_negated_into_the_tiers(tmp_path, model_dir):
    """vLLM serves the smaller ``request.priority`` first; corekv's ``priority`` eviction keeps the
    larger longer: a request of vLLM priority -2 has its blocks stored at corekv priority 2."""
    import struct

    import lmdb

    from corekv.integrations.vllm.scheduler import SchedulerSide
    from corekv.integrations.vllm.worker import WorkerSide

    cfg = {"cache": {"tiers": [{"type": "lmdb", "path": str(tmp_path / "kv"), "size": "256MiB",
                                "sync": False, "eviction": "priority"}]}}
    settings = read_settings(vllm_config(model_dir, {"config": config_file(tmp_path, cfg)}), kv_cache_config())
    scheduler = SchedulerSide(settings, same_process=True)
    worker = WorkerSide(settings, num_blocks=8)
    worker.register({f"model.layers.{i}.self_attn.attn": torch.randn(8, 3, 32, 128) for i in range(30)})
    try:
        urgent = fake_request("urgent", list(range(1000, 1064)))   # two full blocks of 32
        urgent.priority = -2
        assert scheduler.matched_tokens(urgent, 0) == 0
        scheduler.allocated(urgent, [0, 1], 0)
        worker.save(step(scheduler, urgent, [0, 1]))
        assert scheduler.finished(urgent, [0, 1])
        plan = step(scheduler, fake_request("idle", [1]), [])
        assert [s.priority for s in plan.saves] == [2]
        worker.save(plan)
        worker.offload.flush()
    finally:
        worker.close()
        scheduler.close()
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=3, subdir=True, readonly=True)
    with env.begin() as txn:
        records = [v for _, v in txn.cursor(db=env.open_db(b"stats", txn=txn, create=False))]
    env.close()
    assert len(records) == 2 and {struct.unpack("<QIi", v)[2] for v in records} == {2}
