"""``cache.max_load_tokens`` in the vLLM connector: the scheduler side offers vLLM at most that many
tier tokens per request (whole blocks), from the same cost model corekv's engine uses. Both sides
run on a real LMDB tier and a real CPU KV layout, with vLLM's engine replaced by the calls it makes."""
from __future__ import annotations

import torch

from test_vllm_connector_config import config_file, fake_request, kv_cache_config, step, vllm_config
from corekv.integrations.vllm.settings import read_settings


def test_max_load_tokens_caps_what_the_scheduler_offers(tmp_path):
    from corekv.integrations.vllm.scheduler import SchedulerSide
    from corekv.integrations.vllm.worker import WorkerSide

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"weights v1")
    tiers = [{"type": "lmdb", "path": str(tmp_path / "kv"), "size": "256MiB", "sync": False}]
    offered = {}
    for cap in (None, 2 * 32 + 7):  # 71 tokens: two blocks of 32
        cache = {"tiers": tiers, **({"max_load_tokens": cap} if cap is not None else {})}
        path = tmp_path / f"cap-{cap}"
        path.mkdir()
        settings = read_settings(vllm_config(model_dir, {"config": config_file(path, {"cache": cache})}),
                                 kv_cache_config())
        scheduler, worker = SchedulerSide(settings, same_process=True), WorkerSide(settings, num_blocks=24)
        worker.register({f"model.layers.{i}.self_attn.attn": torch.randn(24, 3, 32, 128) for i in range(30)})
        try:
            tokens = list(range(1000, 1200))  # 6 full blocks of 32 and a partial one
            if cap is None:  # the first run stores the blocks
                first = fake_request("first", tokens)
                scheduler.allocated(first, list(range(7)), 0)
                worker.save(step(scheduler, first, list(range(7))))
                scheduler.finished(first, list(range(7)))
                worker.save(step(scheduler, fake_request("idle", [1]), []))
                worker.offload.flush()
                scheduler.reported(worker.report())
            offered[cap] = scheduler.matched_tokens(fake_request("again", tokens), 0)
        finally:
            worker.close()
            scheduler.close()
    assert offered == {None: 6 * 32, 2 * 32 + 7: 2 * 32}
