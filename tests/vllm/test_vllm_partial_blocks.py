"""The vLLM connector's partial blocks: a prompt's last block, where the prompt ends inside it, is
offloaded when the prefill ends and loaded by a prompt that continues it. Both sides run on real
tiers and a real CPU KV layout, with vLLM's engine replaced by the calls it makes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from test_vllm_connector_config import config_file, fake_request, kv_cache_config, step, vllm_config
from corekv.integrations.vllm.settings import read_settings

BLOCK = 32


def connector_sides(tmp_path, tier_type: str):
    """Both sides of the connector on one real tier (lmdb or a local fsspec folder) and a CPU KV
    layout of 24 blocks: (scheduler side, worker side, vLLM's per-layer KV tensors)."""
    from corekv.integrations.vllm.scheduler import SchedulerSide
    from corekv.integrations.vllm.worker import WorkerSide

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"weights v1")
    tier = ({"type": "lmdb", "path": str(tmp_path / "kv"), "size": "256MiB", "sync": False} if tier_type == "lmdb"
            else {"type": "fsspec", "url": f"file://{tmp_path / 'objects'}", "size": "256MiB"})
    settings = read_settings(vllm_config(model_dir, {"config": config_file(tmp_path, {"cache": {"tiers": [tier]}})}),
                             kv_cache_config())
    scheduler, worker = SchedulerSide(settings, same_process=True), WorkerSide(settings, num_blocks=24)
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(24, 3, 32, 128) for i in range(30)}
    worker.register(layers)
    return scheduler, worker, layers


@pytest.mark.parametrize("tier_type", ["lmdb", "fsspec"])
def test_a_continuing_prompt_loads_the_partial_block_from_this_machines_tiers(tmp_path, tier_type):
    """lmdb (this machine's disk) is asked for partial blocks; fsspec (a remote store would take
    a request per key) is not, and offers the whole blocks only."""
    scheduler, worker, layers = connector_sides(tmp_path, tier_type)
    try:
        tokens = list(range(1000, 1200))  # 6 whole blocks of 32, then 8 tokens
        first = fake_request("first", tokens)
        assert scheduler.matched_tokens(first, 0) == 0
        scheduler.allocated(first, list(range(7)), 0)
        plan = step(scheduler, first, list(range(7)))  # the prefill ends: the partial block is saved now
        (partial,) = [s for s in plan.saves if not s.finished]
        assert partial.block_ids == [6] and partial.block_hashes == [first_key_partial(scheduler, tokens)]
        worker.save(plan)
        assert scheduler.finished(first, list(range(7)))  # write-back: the whole blocks at the end
        worker.save(step(scheduler, fake_request("idle", [1]), []))
        worker.offload.flush()
        scheduler.reported(worker.report())
        assert not scheduler.planner.in_flight

        follow = fake_request("follow", tokens + list(range(5000, 5100)))  # the next round of the chat
        diverge = fake_request("diverge", tokens[:-3] + list(range(6000, 6050)))  # leaves it inside block 6
        if tier_type == "fsspec":
            assert scheduler.matched_tokens(follow, 0) == 6 * BLOCK
            return
        assert scheduler.matched_tokens(diverge, 0) == 6 * BLOCK
        assert scheduler.matched_tokens(follow, 0) == len(tokens)
        scheduler.allocated(follow, list(range(8, 18)), len(tokens))
        load_plan = step(scheduler, follow, list(range(8, 18)))
        assert [load.block_ids for load in load_plan.loads] == [list(range(8, 15))]
        worker.load(load_plan)
        assert worker.load_errors() == set()
        for kv in layers.values():
            assert torch.equal(kv[8:15], kv[0:7])  # the partial block's bytes too
    finally:
        worker.close()
        scheduler.close()


def first_key_partial(scheduler, tokens: list[int]) -> bytes:
    return scheduler._key(fake_request("k", tokens)).partial_hashes(len(tokens) // BLOCK, len(tokens) % BLOCK)[0]


def test_the_block_a_finished_request_ends_in_is_offloaded_for_the_chats_next_round(tmp_path):
    """A chat's next prompt continues the generated answer too: the partial block the request's
    computed tokens end in (the last sampled token has none) is saved when it finishes, and the
    next round loads it after the whole blocks, the answer's included."""
    scheduler, worker, layers = connector_sides(tmp_path, "lmdb")
    try:
        prompt, answer = list(range(1000, 1170)), list(range(7000, 7050))  # 170 + 50 tokens
        first = fake_request("first", prompt)
        scheduler.allocated(first, list(range(7)), 0)
        worker.save(step(scheduler, first, list(range(7))))  # the prompt's partial block (10 tokens)
        first.all_token_ids, first.num_tokens = prompt + answer, 220
        decode = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                       resumed_req_ids=set()),
                                 num_scheduled_tokens={"first": 49})  # the answer's steps, as one
        worker.save(scheduler.build_plan(decode))
        first.num_computed_tokens = 219  # the last answer token was sampled, never computed
        assert scheduler.finished(first, list(range(7)))
        plan = step(scheduler, fake_request("idle", [1]), [])
        (save,) = plan.saves
        assert save.finished and save.block_ids == [0, 1, 2, 3, 4, 5, 6]  # 6 whole blocks, then the partial
        assert save.block_hashes[-1] == scheduler._key(fake_request("k", prompt + answer)).partial_hashes(6, 27)[0]
        worker.save(plan)
        worker.offload.flush()
        scheduler.reported(worker.report())

        next_round = fake_request("next", prompt + answer + list(range(8000, 8040)))
        assert scheduler.matched_tokens(next_round, 0) == 219
        # another answer leaves this one inside block 5: the whole blocks before it, then the
        # prompt's own partial block
        another_answer = fake_request("other", prompt + answer[:5] + list(range(9000, 9060)))
        assert scheduler.matched_tokens(another_answer, 0) == len(prompt)
    finally:
        worker.close()
        scheduler.close()
