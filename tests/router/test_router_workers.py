"""Worker: how KV event batches (corekv.kv_event_wire's real classes) and routed requests change the
router's view of one worker, a corekv one or a vLLM one, without a network (but for the sockets a
subscriber opens)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from corekv.kv_event_wire import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, cache_salt_key,
                                  decode_batch, encode_batch)
from corekv.router.policy import CacheAwarePolicy
from corekv.router.tree import BlockTree
from corekv.router.workers import EventEndpoints, Worker

BLOCK = 2


def subscribed_worker(url="http://10.0.0.7:8001", index=0) -> Worker:
    """A corekv worker (its /admin/info was read) with an events view."""
    worker = Worker(index, url, block_size=BLOCK, max_tree_blocks=100)
    worker.set_info({"model": "m", "block_size": BLOCK, "kv_events": None})
    worker.events_tree = BlockTree(BLOCK)  # what start_events sets up beside the subscriber
    return worker


def vllm_worker(url="http://10.0.0.8:8000", index=1, block_size=BLOCK) -> Worker:
    """A vLLM worker: no /admin/info, its publisher named (--worker-events), an events view."""
    worker = Worker(index, url, block_size=block_size, max_tree_blocks=100,
                    events=EventEndpoints("tcp://*:5557", "tcp://*:5558", "kv"))
    worker.set_info(None)   # what the health check reads from a server without /admin/info
    worker.events_tree = BlockTree(block_size)
    return worker


def vllm_batch(*stored: tuple[list[int], list[int], int | None, str | None], block_size=BLOCK) -> KVEventBatch:
    """What a vLLM 0.32 server publishes, through the wire and back: per ``(hashes, token_ids,
    parent, salt)`` a BlockStored with int hashes on the GPU medium, the salt in clear in the
    first block's extra keys of a chain's first run."""
    events = [BlockStored(hashes, parent, token_ids, block_size, medium="GPU", group_idx=0,
                          kv_cache_spec_kind="full_attention",
                          extra_keys=[(salt,) if salt and i == 0 and parent is None else None
                                      for i in range(len(hashes))])
              for hashes, token_ids, parent, salt in stored]
    return decode_batch(encode_batch(KVEventBatch(1.0, events, data_parallel_rank=0)))


def batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


def test_device_events_build_and_shrink_the_view():
    worker = subscribed_worker()
    worker.apply_batch(0, batch(BlockStored([b"a", b"b"], None, [1, 2, 3, 4], BLOCK)))
    assert worker.match([1, 2, 3, 4, 5], None) == 4
    worker.apply_batch(1, batch(BlockRemoved([b"b"])))
    assert worker.match([1, 2, 3, 4], None) == 2
    worker.apply_batch(2, batch(AllBlocksCleared()))
    assert worker.num_tree_blocks == 0


def test_a_salted_chain_is_matched_by_requests_with_its_salt_only():
    worker = subscribed_worker()
    tenant_a = [(cache_salt_key("tenant-a"),), None]
    worker.apply_batch(0, batch(BlockStored([b"a1", b"a2"], None, [1, 2, 3, 4], BLOCK, extra_keys=tenant_a),
                                BlockStored([b"a3"], b"a2", [5, 6], BLOCK),   # continues a's chain
                                BlockStored([b"u1"], None, [1, 2], BLOCK)))   # unsalted, equal tokens
    assert worker.match([1, 2, 3, 4, 5, 6], "tenant-a") == 6
    assert worker.match([1, 2, 3, 4, 5, 6], None) == 2
    assert worker.match([1, 2, 3, 4, 5, 6], "tenant-b") == 0
    assert worker.events_tree.stats()["namespaces"] == 2
    ticket = worker.begin([1, 2, 3, 4, 5, 6, 7, 8], "tenant-b")   # nothing of b's is cached here
    assert worker.num_tree_blocks == 4 + 4
    worker.finish(ticket)


def test_a_chain_with_extra_keys_of_another_kind_is_never_matched():
    worker = subscribed_worker()
    worker.apply_batch(0, batch(BlockStored([b"v"], None, [1, 2], BLOCK, extra_keys=[("tenant-a",)])))
    assert worker.num_tree_blocks == 1      # a salt in clear from a corekv worker: no request maps to it
    assert worker.match([1, 2], "tenant-a") == 0 and worker.match([1, 2], None) == 0


def test_a_worker_without_admin_info_is_a_vllm_worker():
    assert vllm_worker().kind == "vllm" and vllm_worker().state()["kind"] == "vllm"
    assert subscribed_worker().kind == "corekv" and subscribed_worker().state()["kind"] == "corekv"


def test_a_vllm_salted_chain_is_matched_by_requests_with_its_salt_only():
    worker = vllm_worker()
    worker.apply_batch(0, vllm_batch(([11, 12], [1, 2, 3, 4], None, "tenant-a"),
                                     ([13], [5, 6], 12, None),          # continues a's chain
                                     ([21], [1, 2], None, None)))       # unsalted, equal tokens
    assert worker.match([1, 2, 3, 4, 5, 6], "tenant-a") == 6
    assert worker.match([1, 2, 3, 4, 5, 6], None) == 2
    assert worker.match([1, 2, 3, 4, 5, 6], "tenant-b") == 0
    # the view is keyed by the tenant key, as a corekv worker's; the salt itself is not kept
    tree = worker.events_tree
    assert tree.match([1, 2, 3, 4], (cache_salt_key("tenant-a"),)) == 4
    assert tree.match([1, 2, 3, 4], ("tenant-a",)) == 0 and tree.stats()["namespaces"] == 2
    worker.apply_batch(1, batch(BlockRemoved([12], medium="GPU")))
    assert worker.match([1, 2, 3, 4, 5, 6], "tenant-a") == 2   # the block and the one chained after it


def test_the_workers_kind_decides_how_its_tenant_keys_are_read():
    """One request, two kinds of worker: the corekv worker's chain carries cache_salt_key(S), the
    vLLM worker's S itself, and the request with cache_salt S matches both; a vLLM tenant whose
    salt *is* another tenant's key is never taken for that tenant."""
    corekv_worker, vllm = subscribed_worker(index=0), vllm_worker(index=1)
    corekv_worker.apply_batch(0, batch(BlockStored([b"c1"], None, [1, 2], BLOCK,
                                                   extra_keys=[(cache_salt_key("tenant-a"),)])))
    vllm.apply_batch(0, vllm_batch(([31, 32], [1, 2, 3, 4], None, "tenant-a"),
                                   ([41], [7, 8], None, cache_salt_key("tenant-b"))))
    assert corekv_worker.match([1, 2, 3, 4], "tenant-a") == 2
    assert vllm.match([1, 2, 3, 4], "tenant-a") == 4
    assert vllm.match([7, 8], "tenant-b") == 0
    assert vllm.match([7, 8], cache_salt_key("tenant-b")) == 2   # the tenant whose salt it is
    choice = CacheAwarePolicy().choose([corekv_worker, vllm], [1, 2, 3, 4, 9, 9], "tenant-a")
    assert (choice.worker, choice.reason, choice.matched_tokens) == (vllm, "cache", 4)


def test_salts_stay_out_of_the_logs_and_the_workers_state(caplog):
    worker = vllm_worker()
    with caplog.at_level(logging.DEBUG, logger="corekv.router"):
        worker.apply_batch(0, vllm_batch(([11, 12], [1, 2, 3, 4], None, "secret-salt-x")))
        worker.apply_batch(1, vllm_batch(([13], [5, 6, 7, 8], None, "secret-salt-x"), block_size=4))
        worker.begin([1, 2, 3, 4], "secret-salt-x")
        worker.is_healthy = True
        worker.mark_down("test")
    assert "secret-salt-x" not in caplog.text and "secret-salt-x" not in repr(worker.state())


def test_a_vllm_workers_view_takes_the_block_size_of_its_events():
    """vLLM announces its --block-size nowhere but in its events."""
    worker = vllm_worker(block_size=16)
    worker.apply_batch(0, vllm_batch(([11, 12], [1, 2, 3, 4], None, None)))
    assert worker.block_size == BLOCK and worker.state()["block_size"] == BLOCK
    assert worker.match([1, 2, 3, 4, 5], None) == 4
    # a run of blocks of another size, once the view holds blocks: skipped
    worker.apply_batch(1, vllm_batch(([13], [5, 6, 7, 8], 12, None), block_size=4))
    assert worker.num_tree_blocks == 2 and worker.block_size == BLOCK
    worker.apply_batch(2, batch(AllBlocksCleared()))
    worker.apply_batch(3, vllm_batch(([14], [5, 6, 7, 8], None, None), block_size=4))
    assert worker.block_size == 4 and worker.match([5, 6, 7, 8], None) == 4


def test_a_named_publisher_is_subscribed_as_named_and_before_an_announced_one():
    pytest.importorskip("zmq")
    worker = Worker(0, "http://10.0.0.8:8000", block_size=BLOCK, max_tree_blocks=100,
                    events=EventEndpoints("tcp://*:5557", "tcp://127.0.0.1:5558", "kv"))
    worker.set_info({"model": "m", "block_size": BLOCK,
                     "kv_events": {"endpoint": "tcp://*:6000", "replay_endpoint": None, "topic": ""}})
    loop = asyncio.new_event_loop()
    try:
        worker.start_events(loop)
        subscriber = worker.subscriber
        # a wildcard reached at the worker's host; a loopback address trusted as named (a tunnel)
        assert (subscriber.endpoint, subscriber.replay_endpoint, subscriber.topic) == \
            ("tcp://10.0.0.8:5557", "tcp://127.0.0.1:5558", "kv")
        assert subscriber.start_seq == 0   # with a replay socket: from its first buffered batch
        assert worker.state()["events"]["endpoint"] == "tcp://10.0.0.8:5557"
    finally:
        worker.stop_events(wait=True)
        loop.close()


def test_events_without_token_ids_turn_the_view_to_routed_prompts():
    worker = subscribed_worker()
    in_flight = worker.begin([1, 2, 3, 4], "tenant-a")
    worker.apply_batch(0, batch(BlockStored([b"a", b"b"], None, [], BLOCK)))
    assert worker.events_tree is None and worker.state()["cache_view"] == "routed_prompts"
    assert worker.match([1, 2, 3, 4], "tenant-a") == 4      # the prompt in flight seeds the view
    assert worker.match([1, 2, 3, 4], None) == 0
    worker.finish(in_flight)
    worker.begin([5, 6], None)
    assert worker.match([5, 6], None) == 2


def test_events_of_other_media_and_lora_blocks_are_ignored():
    worker = subscribed_worker()
    worker.apply_batch(0, batch(BlockStored([b"a"], None, [1, 2], BLOCK, medium="lmdb"),
                                BlockStored([b"l"], None, [3, 4], BLOCK, lora_id=7),
                                BlockStored([b"n"], None, [3, 4], BLOCK, lora_name="my-lora"),
                                BlockStored([b"g"], None, [5, 6], BLOCK, medium="GPU")))
    assert worker.num_tree_blocks == 1 and worker.match([5, 6], None) == 2
    worker.apply_batch(1, batch(BlockRemoved([b"g"], medium="host")))
    assert worker.match([5, 6], None) == 2


def test_a_restarted_publisher_starts_the_view_over():
    """KVEventSubscriber detects the restart (its own tests) and calls on_restart, which
    start_events wires to clear_events_view."""
    worker = subscribed_worker()
    worker.apply_batch(0, batch(BlockStored([b"a"], None, [1, 2], BLOCK)))
    worker.apply_batch(1, batch(BlockStored([b"b"], b"a", [3, 4], BLOCK)))
    worker.clear_events_view()
    worker.apply_batch(0, batch(BlockStored([b"c"], None, [9, 9], BLOCK)))  # the new run's seq 0
    assert worker.match([1, 2], None) == 0 and worker.match([9, 9], None) == 2


def test_routed_requests_count_load_and_fill_the_routed_view_per_salt():
    worker = Worker(0, "http://127.0.0.1:8001", block_size=BLOCK, max_tree_blocks=100)
    first = worker.begin([1, 2, 3, 4], "tenant-a")
    second = worker.begin([1, 2], None)
    assert worker.load == 2 and worker.match([1, 2, 3, 4], "tenant-a") == 4
    assert worker.match([1, 2, 3, 4], "tenant-b") == 0
    worker.finish(first)
    worker.finish(first)  # NOTE: idempotent: a stream's two cleanup paths may both call it
    worker.finish(second)
    assert worker.load == 0 and worker.match([1, 2, 3, 4], "tenant-a") == 4


def test_mark_down_drops_the_view_and_the_subscription():
    worker = Worker(0, "http://127.0.0.1:8001", block_size=BLOCK, max_tree_blocks=100)
    worker.is_healthy = True
    worker.begin([1, 2], None)
    worker.mark_down("test")
    assert not worker.is_healthy and worker.num_tree_blocks == 0 and worker.events_tree is None


def test_a_publisher_on_every_interface_is_reached_at_the_worker_host():
    worker = subscribed_worker("http://10.0.0.7:8001")
    assert worker._reachable("tcp://*:5557") == "tcp://10.0.0.7:5557"
    assert worker._reachable("tcp://0.0.0.0:5557") == "tcp://10.0.0.7:5557"
    assert worker._reachable("ipc:///tmp/kv") == "ipc:///tmp/kv"


def test_a_publisher_on_loopback_is_reached_only_from_the_same_machine():
    """NOTE: from another machine, its loopback address would reach this machine's loopback,
    where another worker's publisher may listen on the same default port."""
    assert subscribed_worker("http://127.0.0.1:8001")._reachable("tcp://127.0.0.1:5557") == \
        "tcp://127.0.0.1:5557"
    assert subscribed_worker("http://localhost:8001")._reachable("tcp://[::1]:5557") == "tcp://[::1]:5557"
    remote = Worker(0, "http://10.0.0.7:8001", block_size=BLOCK, max_tree_blocks=100)
    assert remote._reachable("tcp://127.0.0.1:5557") is None
    remote.set_info({"model": "m", "block_size": BLOCK,
                     "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": None, "topic": ""}})
    loop = asyncio.new_event_loop()
    try:
        remote.start_events(loop)
    finally:
        loop.close()
    assert remote.subscriber is None and remote.state()["cache_view"] == "routed_prompts"


def test_info_with_another_block_size_resizes_the_view():
    worker = Worker(0, "http://127.0.0.1:8001", block_size=16, max_tree_blocks=100)
    worker.set_info({"model": "m", "block_size": 4, "kv_events": None})
    worker.begin([1, 2, 3, 4], None)
    assert worker.block_size == 4 and worker.match([1, 2, 3, 4], None) == 4


def test_prompts_in_flight_count_toward_an_events_view_size():
    worker = subscribed_worker()
    worker.apply_batch(0, batch(BlockStored([b"a"], None, [1, 2], BLOCK)))
    ticket = worker.begin([1, 2, 3, 4, 5, 6], None)  # 2 blocks beyond what the events hold
    assert worker.num_tree_blocks == 3
    worker.finish(ticket)
    assert worker.num_tree_blocks == 1
