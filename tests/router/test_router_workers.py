"""Worker: how KV event batches (corekv.kv_event_wire's real classes) and routed requests change the
router's view of one worker, without a network."""
from __future__ import annotations

import asyncio

from corekv.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, cache_salt_key
from corekv.router.tree import BlockTree
from corekv.router.workers import Worker

BLOCK = 2


def subscribed_worker(url="http://10.0.0.7:8001") -> Worker:
    worker = Worker(0, url, block_size=BLOCK, max_tree_blocks=100)
    worker.events_tree = BlockTree(BLOCK)  # what start_events sets up beside the subscriber
    return worker


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
    assert worker.num_tree_blocks == 1      # vLLM's salt in clear: no request maps to it
    assert worker.match([1, 2], "tenant-a") == 0 and worker.match([1, 2], None) == 0


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
