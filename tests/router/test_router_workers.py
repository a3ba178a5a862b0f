"""Worker: how KV event batches (corekv.kv_events' real classes) and routed requests change the
router's view of one worker, without a network."""
from __future__ import annotations

from corekv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
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
    assert worker.match([1, 2, 3, 4, 5], "any-salt") == 4  # events carry no salt
    worker.apply_batch(1, batch(BlockRemoved([b"b"])))
    assert worker.match([1, 2, 3, 4], None) == 2
    worker.apply_batch(2, batch(AllBlocksCleared()))
    assert worker.num_tree_blocks == 0


def test_events_of_other_media_and_lora_blocks_are_ignored():
    worker = subscribed_worker()
    worker.apply_batch(0, batch(BlockStored([b"a"], None, [1, 2], BLOCK, medium="lmdb"),
                                BlockStored([b"l"], None, [3, 4], BLOCK, lora_id=7),
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
    assert worker._reachable("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert worker._reachable("ipc:///tmp/kv") == "ipc:///tmp/kv"


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
