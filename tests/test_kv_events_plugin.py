"""The ``kv_events`` plugin on a real engine (the tiny random Llama, loaded from its model folder).

``RawReader`` is an independent consumer written with plain ``zmq`` + ``msgpack`` only, as a
vLLM-events router reads the stream: it checks the bytes on the wire (multipart frames, vLLM 0.32's
layout: an array batch of tagged event maps), not what corekv's own decoder makes of them. A
reader knows it has everything the engine published so far when the batch of a fresh "probe"
prompt it warmed arrives (a PUB socket keeps order); the first probes also wait out ZMQ's slow
joiner (a SUB socket misses what is sent before its subscription reaches the publisher), so a
reader may never see the first probes' batches: what a test compares with *everything* the engine
published is read from the replay socket, from seq 0.
"""
from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
import threading

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from corekv.backend import BlockEvent  # noqa: E402
from corekv.config import load_config  # noqa: E402
from corekv.engine.llm_engine import Engine  # noqa: E402
from corekv.engine.sampling import SamplingParams  # noqa: E402
from corekv.errors import ConfigError  # noqa: E402
from corekv.kv_event_subscriber import KVEventSubscriber  # noqa: E402
from corekv.kv_event_wire import cache_salt_key, decode_batch, external_block_hash  # noqa: E402
from corekv.plugins.kv_event_publisher import KVEventPublisher, publisher_for  # noqa: E402
from corekv.router.workers import Worker  # noqa: E402

BS = 16
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_folder):
    from corekv.engine.models import load_model

    return load_model(str(tiny_model_folder), device="cpu")


def make_engine(tiny, backend="hash_blocks", num_blocks=64, **kv_events):
    kv = {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
          "include_token_ids": True, **kv_events}
    config = load_config({"model": "tiny", "engine": {"num_blocks": num_blocks, "block_size": BS},
                          "cache": {"backend": backend}, "kv_events": kv}, env={})
    return Engine(config, model=tiny)


def prompt(n_tokens: int, start: int) -> list[int]:
    return [3 + (start + i) % 250 for i in range(n_tokens)]


class RawReader:
    """A vLLM-style consumer from plain zmq + msgpack: ``(topic, seq, decoded batch, payload)``."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.seqs: list[int] = []
        self.num_probes = 0

    def sync(self, engine) -> list[tuple]:
        """Everything published since the last sync, probes left out."""
        got = []
        for _ in range(50):
            self.num_probes += 1
            probe = [4, 5, 6, self.num_probes % 250 + 3, self.num_probes // 250 + 3] + [9] * (BS - 5)
            engine.warm(probe + [1], pin=False)
            probe_hash = external_block_hash(engine.prefix_key(probe).block_hashes[0])
            while self.sub.poll(1000):
                topic, seq_bytes, payload = self.sub.recv_multipart()
                assert len(seq_bytes) == 8
                seq, batch = int.from_bytes(seq_bytes, "big"), msgpack.unpackb(payload)
                self.seqs.append(seq)
                if any(e["type"] == "BlockStored" and e["block_hashes"][0] == probe_hash
                       for e in batch[1]):
                    return got
                if not any(e["type"] == "BlockStored" and e["token_ids"][:3] == [4, 5, 6]
                           for e in batch[1]):
                    got.append((topic, seq, batch, payload))
        raise AssertionError("the probe batch never arrived")

    def close(self):
        self.ctx.destroy(linger=0)


def replay(endpoint: str, start: int, topic: bytes = b"") -> list[tuple[int, bytes]]:
    """Ask a replay socket for batches from ``start`` (vLLM 0.32's protocol, a DEALER here)."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            empty, reply_topic, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END:
                assert (reply_topic, payload) == (b"", b"")
                return frames
            assert reply_topic == topic
            frames.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        ctx.destroy(linger=0)


def events_of(messages, tag):
    return [e for _, _, batch, _ in messages for e in batch[1] if e["type"] == tag]


def all_stored_hashes(publisher) -> set[int]:
    """Every block hash the publisher has sent in a BlockStored (its replay buffer from seq 0)."""
    return {h for _, payload in replay(publisher.replay_endpoint, 0)
            for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"
            for h in e["block_hashes"]}


def published(hashes) -> list[int]:
    """corekv chain hashes as the events name them (vLLM's default 64-bit ints)."""
    return [external_block_hash(h) for h in hashes]


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_a_prompt_is_published_as_block_stored_in_vllm_0_32_layout_with_its_chain(tiny, backend):
    with make_engine(tiny, backend) as engine:
        reader = RawReader(publisher_for(engine).endpoint)
        reader.sync(engine)
        ids = prompt(4 * BS + 6, start=0)
        engine.generate(ids, GREEDY)
        messages = reader.sync(engine)
        reader.close()
    for topic, _, batch, _ in messages:   # [ts, events, data_parallel_rank], as vLLM's publisher
        assert topic == b"" and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
    stored = events_of(messages, "BlockStored")
    for event in stored:
        hashes = event["block_hashes"]
        assert list(event) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name", "extra_keys",
                               "group_idx", "kv_cache_spec_kind"]
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        assert (event["block_size"], event["lora_id"], event["medium"], event["lora_name"]) == \
            (BS, None, "GPU", None)                   # what vLLM's device pool sends
        assert (event["group_idx"], event["kv_cache_spec_kind"]) == (0, "full_attention")
        assert event["extra_keys"] == [None] * len(hashes)
        assert len(event["token_ids"]) == BS * len(hashes)
    key = engine.prefix_key(ids)
    assert [h for e in stored for h in e["block_hashes"]] == published(key.block_hashes)
    assert [t for e in stored for t in e["token_ids"]] == ids[:4 * BS]
    assert stored[0]["parent_block_hash"] is None     # the chain's first block has no parent
    for before, after in zip(stored, stored[1:]):     # each run continues the one before
        assert after["parent_block_hash"] == before["block_hashes"][-1]
    assert reader.seqs == list(range(reader.seqs[0], reader.seqs[0] + len(reader.seqs)))


def test_a_prompt_sharing_a_cached_prefix_publishes_only_its_new_blocks_with_their_parent(tiny):
    with make_engine(tiny, "radix") as engine:
        reader = RawReader(publisher_for(engine).endpoint)
        reader.sync(engine)
        first = prompt(3 * BS + 2, start=0)
        second = first[:2 * BS] + prompt(2 * BS, start=100)
        engine.generate(first, GREEDY)
        reader.sync(engine)
        engine.generate(second, GREEDY)
        [event] = events_of(reader.sync(engine), "BlockStored")
        reader.close()
    hashes = published(engine.prefix_key(second).block_hashes)
    assert (event["block_hashes"], event["parent_block_hash"], event["token_ids"]) == \
        (hashes[2:4], hashes[1], second[2 * BS:4 * BS])


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_evicted_blocks_are_published_as_block_removed(tiny, backend):
    with make_engine(tiny, backend, num_blocks=12) as engine:
        reader = RawReader(publisher_for(engine).endpoint)
        reader.sync(engine)
        first = prompt(3 * BS, start=0)
        engine.generate(first, GREEDY)
        for i in range(1, 6):   # 5 more prompts of 4 blocks each through a 12-block pool
            engine.generate(prompt(3 * BS, start=40 * i), GREEDY)
        messages = reader.sync(engine)
        reader.close()
        # NOTE: from the replay buffer, not the reader: a probe block stored before the reader's
        # subscription took effect is evicted here too, and its BlockStored is on no live reader
        stored_hashes = all_stored_hashes(publisher_for(engine))
    removed = events_of(messages, "BlockRemoved")
    assert removed and all(list(e) == ["type", "block_hashes", "medium", "group_idx"] and
                           (e["medium"], e["group_idx"]) == ("GPU", 0) for e in removed)
    removed_hashes = {h for e in removed for h in e["block_hashes"]}
    assert set(published(engine.prefix_key(first).block_hashes)) <= removed_hashes
    assert removed_hashes <= stored_hashes            # only what was published as stored


def router_worker(publisher, loop: asyncio.AbstractEventLoop) -> Worker:
    """``corekv route``'s view of this engine as a worker on this machine, subscribed the way its
    health check subscribes (a real KVEventSubscriber, replaying from seq 0)."""
    worker = Worker(0, "http://127.0.0.1:8001", block_size=BS, max_tree_blocks=1000)
    worker.set_info({"model": "tiny", "block_size": BS, "kv_events": {
        "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint, "topic": ""}})
    worker.start_events(loop)
    assert worker.subscriber is not None
    return worker


def run_loop_until(loop: asyncio.AbstractEventLoop, condition, what: str) -> None:
    for _ in range(200):
        loop.run_until_complete(asyncio.sleep(0.05))   # the worker's batches apply on the loop
        if condition():
            return
    raise AssertionError(f"timed out waiting for {what}")


def test_equal_prompts_of_two_tenants_publish_apart_and_the_router_keeps_them_apart(tiny):
    ids = prompt(2 * BS + 3, start=0)         # 2 full blocks, also with the 3 generated tokens
    salts = (None, "tenant-a", "tenant-b")
    loop = asyncio.new_event_loop()
    with make_engine(tiny, "radix") as engine:
        publisher = publisher_for(engine)
        reader = RawReader(publisher.endpoint)
        reader.sync(engine)
        for salt in salts:
            engine.generate(ids, GREEDY, cache_salt=salt)
        messages = reader.sync(engine)
        reader.close()
        worker = router_worker(publisher, loop)
        run_loop_until(loop, lambda: worker.subscriber.last_seq == reader.seqs[-1] and
                       worker.num_event_batches == worker.subscriber.num_batches, "the router's view")
        view = worker.state()["cache_view"], worker.events_tree.stats()["namespaces"]
        matched = {salt: worker.match(ids, salt) for salt in (*salts, "tenant-c")}
        worker.stop_events(wait=True)
        hashes = [published(engine.prefix_key(ids, salt).block_hashes) for salt in salts]
    loop.close()
    stored = events_of(messages, "BlockStored")
    assert [e["block_hashes"] for e in stored] == hashes
    assert len({h for e in stored for h in e["block_hashes"]}) == 6   # no two tenants share a hash
    assert all(e["parent_block_hash"] is None and e["token_ids"] == ids[:2 * BS] for e in stored)
    unsalted, *salted = stored
    assert unsalted["extra_keys"] == [None, None]                # no extra keys without a salt
    for event, salt in zip(salted, salts[1:]):   # where vLLM puts the salt, corekv its digest
        assert event["extra_keys"] == [[cache_salt_key(salt)], None]
    assert not any(salt.encode() in payload for *_, payload in messages for salt in salts[1:])
    # the router's view of the same stream: one namespace per tenant (the probes are unsalted),
    # and each tenant's prompt matches its own blocks only
    assert view == ("events", 3)
    assert matched == {None: 2 * BS, "tenant-a": 2 * BS, "tenant-b": 2 * BS, "tenant-c": 0}


def test_without_token_ids_blocks_are_named_by_hash_and_the_router_routes_on_prompts(tiny):
    ids = prompt(2 * BS + 3, start=0)
    loop = asyncio.new_event_loop()
    with make_engine(tiny, "radix", include_token_ids=False) as engine:
        publisher = publisher_for(engine)
        reader = RawReader(publisher.endpoint)
        reader.sync(engine)
        engine.generate(ids, GREEDY, cache_salt="tenant-a")
        messages = reader.sync(engine)
        reader.close()
        worker = router_worker(publisher, loop)
        run_loop_until(loop, lambda: worker.events_tree is None, "the router to drop the events view")
        key = engine.prefix_key(ids, "tenant-a")
    loop.close()
    stored = events_of(messages, "BlockStored")
    assert stored and all(e["token_ids"] == [] for e in stored)   # probes included
    hashes = published(key.block_hashes)
    [event] = [e for e in stored if e["block_hashes"][0] == hashes[0]]
    assert (event["block_hashes"], event["parent_block_hash"], event["block_size"]) == \
        (hashes, None, BS)
    assert event["extra_keys"] == [[cache_salt_key("tenant-a")], None]   # tenants still apart
    assert worker.subscriber is None and worker.state()["cache_view"] == "routed_prompts"


def local_non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the one its default route uses)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))   # UDP: picks the interface, sends nothing
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_corekv_describe_kv_events_names_the_sockets_bound_and_none_when_off(tiny):
    with make_engine(tiny, topic="kv") as engine:
        publisher = publisher_for(engine)
        described = engine.plugin_manager.hook.corekv_describe_kv_events(engine=engine)
        assert described == {"endpoint": publisher.endpoint, "topic": "kv",
                             "replay_endpoint": publisher.replay_endpoint}
        assert not publisher.endpoint.endswith(":0")  # the port bound, not the config's 0
    with Engine(load_config({"model": "tiny", "engine": {"num_blocks": 8, "block_size": BS}},
                            env={}), model=tiny) as off:
        assert off.plugin_manager.hook.corekv_describe_kv_events(engine=off) is None


def test_the_default_endpoint_listens_on_loopback_only(tiny):
    config = load_config({"model": "tiny", "engine": {"num_blocks": 16, "block_size": BS},
                          "kv_events": {"enabled": True}}, env={})
    try:
        engine = Engine(config, model=tiny)
    except ConfigError as e:
        pytest.skip(f"the default port is taken on this machine ({e})")
    with engine:
        assert publisher_for(engine).endpoint == "tcp://127.0.0.1:5557"   # the address bound
        socket.create_connection(("127.0.0.1", 5557), timeout=5).close()
        address = local_non_loopback_address()
        if address is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, 5557), timeout=5)


def test_a_reset_is_published_as_all_blocks_cleared(tiny):
    with make_engine(tiny, "hash_blocks") as engine:
        reader = RawReader(publisher_for(engine).endpoint)
        reader.sync(engine)
        engine.generate(prompt(2 * BS + 1, start=0), GREEDY)
        reader.sync(engine)
        engine.backend.reset()
        engine.step()            # nothing to run: the step only publishes the reset
        messages = reader.sync(engine)
        reader.close()
    assert [batch[1] for _, _, batch, _ in messages] == [[{"type": "AllBlocksCleared"}]]


def test_a_reset_before_new_blocks_in_one_step_is_published_before_them(tiny):
    with make_engine(tiny, "hash_blocks") as engine:
        reader = RawReader(publisher_for(engine).endpoint)
        reader.sync(engine)
        engine.backend.reset()
        engine.generate(prompt(2 * BS + 1, start=0), GREEDY)
        tags = [e["type"] for _, _, batch, _ in reader.sync(engine) for e in batch[1]]
        reader.close()
    assert tags.index("AllBlocksCleared") < tags.index("BlockStored")


def test_prefixes_pinned_at_startup_are_published(tiny):
    pinned = prompt(2 * BS + 3, start=7)
    config = load_config({"model": "tiny", "engine": {"num_blocks": 64, "block_size": BS},
                          "cache": {"pinned": [{"token_ids": pinned}]},
                          "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                                        "replay_endpoint": "tcp://127.0.0.1:0"}}, env={})
    with Engine(config, model=tiny) as engine:
        frames = replay(publisher_for(engine).replay_endpoint, 0)
    events = [e for _, payload in frames for e in msgpack.unpackb(payload)[1]]
    assert [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]] == \
        published(engine.prefix_key(pinned).block_hashes)


def test_a_late_subscriber_gets_missed_batches_from_the_replay_socket(tiny):
    with make_engine(tiny, "radix") as engine:
        publisher = publisher_for(engine)
        reader = RawReader(publisher.endpoint)
        reader.sync(engine)
        for i in range(3):
            engine.generate(prompt(2 * BS + 1, start=50 * i), GREEDY)
        live = reader.sync(engine)
        reader.close()
        start = live[1][1]
        frames = replay(publisher.replay_endpoint, start)
        assert [seq for seq, _ in frames] == list(range(start, reader.seqs[-1] + 1))
        by_seq = {seq: payload for _, seq, _, payload in live}
        assert [(s, p) for s, p in frames if s in by_seq] == [(s, by_seq[s]) for s in sorted(by_seq)
                                                              if s >= start]
        assert replay(publisher.replay_endpoint, reader.seqs[-1] + 1) == []


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches(tiny):
    with make_engine(tiny, "radix", buffer_steps=2) as engine:
        publisher = publisher_for(engine)
        reader = RawReader(publisher.endpoint)
        reader.sync(engine)
        for i in range(3):
            engine.generate(prompt(BS + 1, start=50 * i), GREEDY)
        reader.sync(engine)
        reader.close()
        assert [seq for seq, _ in replay(publisher.replay_endpoint, 0)] == reader.seqs[-2:]


def wait_for(condition, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def level_with(reader: RawReader, engine, received: list[int]) -> None:
    """Probe until a late-joining subscriber has received the reader's latest batch too."""
    for _ in range(50):
        reader.sync(engine)
        try:
            wait_for(lambda: received and received[-1] == reader.seqs[-1], "a probe")
            return
        except AssertionError:
            continue
    raise AssertionError("the subscriber never caught up with the reader")


def test_kv_event_subscriber_replays_from_start_then_follows_live(tiny):
    with make_engine(tiny, "hash_blocks") as engine:
        publisher = publisher_for(engine)
        engine.generate(prompt(2 * BS + 1, start=0), GREEDY)     # before anyone listens
        received = []
        reader = RawReader(publisher.endpoint)
        with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint,
                               start_seq=0, on_batch=lambda *item: received.append(item)) as subscriber:
            raw = reader.sync(engine)
            engine.generate(prompt(2 * BS + 1, start=100), GREEDY)
            raw += reader.sync(engine)
            last = reader.seqs[-1]
            wait_for(lambda: received and received[-1][0] >= last, "the subscriber to catch up")
        reader.close()
    assert [seq for seq, _ in received] == list(range(0, last + 1))   # in order, none twice
    assert subscriber.num_replayed >= 1 and subscriber.num_missed == 0
    decoded = dict(received)
    assert raw and all(decoded[seq] == decode_batch(payload) for _, seq, _, payload in raw)


class DroppingForwarder:
    """Relays a publisher's messages to a new PUB socket, dropping the ones with seq in ``drop``:
    a lossy link, so that a subscriber sees a real gap in the live stream."""

    def __init__(self, endpoint: str, drop: set[int]):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.drop, self.stop = drop, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            if self.sub.poll(50):
                frames = self.sub.recv_multipart()
                if int.from_bytes(frames[1], "big") not in self.drop:
                    self.pub.send_multipart(frames)

    def close(self):
        self.stop.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


@pytest.mark.parametrize("with_replay", [True, False])
def test_kv_event_subscriber_fills_a_live_gap_from_replay_or_reports_it(tiny, with_replay):
    with make_engine(tiny, "radix") as engine:
        publisher = publisher_for(engine)
        reader = RawReader(publisher.endpoint)
        forwarder = DroppingForwarder(publisher.endpoint, drop=set())
        received, gaps = [], []
        subscriber = KVEventSubscriber(
            forwarder.endpoint, replay_endpoint=publisher.replay_endpoint if with_replay else None,
            on_batch=lambda seq, batch: received.append(seq),
            on_gap=lambda first, count: gaps.append((first, count))).start()
        level_with(reader, engine, received)
        num_gaps, num_missed = len(gaps), subscriber.num_missed
        gap_at = reader.seqs[-1] + 2
        forwarder.drop = {gap_at}
        for i in range(3):    # one batch each: the second one is dropped on the way
            engine.generate(prompt(BS + 1, start=60 * i), GREEDY)
        reader.sync(engine)
        last = reader.seqs[-1]
        wait_for(lambda: received[-1] >= last, "the subscriber to catch up")
        subscriber.close()
        forwarder.close()
        reader.close()
    after = [s for s in received if s >= gap_at - 1]
    if with_replay:
        assert after == list(range(gap_at - 1, last + 1)) and subscriber.num_replayed >= 1
        assert gaps[num_gaps:] == [] and subscriber.num_missed == num_missed
    else:
        assert after == [s for s in range(gap_at - 1, last + 1) if s != gap_at]
        assert gaps[num_gaps:] == [(gap_at, 1)] and subscriber.num_missed == num_missed + 1


def test_kv_event_subscriber_sees_a_publisher_restart_and_starts_over_from_zero(tiny):
    first = make_engine(tiny, "radix")
    endpoint, replay_endpoint = publisher_for(first).endpoint, publisher_for(first).replay_endpoint
    received, restarts = [], []
    subscriber = KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint,
                                   on_batch=lambda seq, batch: received.append(seq),
                                   on_restart=lambda: restarts.append(len(received))).start()
    reader = RawReader(endpoint)
    for i in range(4):
        first.warm(prompt(BS + 1, start=30 * i), pin=False)
    level_with(reader, first, received)
    reader.close()
    publisher_for(first).close()
    first.close()
    with make_engine(tiny, "radix", endpoint=endpoint, replay_endpoint=replay_endpoint) as second:
        reader = RawReader(endpoint)
        level_with(reader, second, received)   # the new run counts from 0 again
        reader.close()
        subscriber.close()
    assert len(restarts) == 1 and subscriber.num_restarts == 1
    assert received[restarts[0]:] == list(range(0, reader.seqs[-1] + 1))


def test_the_topic_is_the_first_frame_live_and_in_replay_replies(tiny):
    with make_engine(tiny, "radix", topic="kv@engine-1") as engine:
        reader = RawReader(publisher_for(engine).endpoint, topic=b"kv@engine-1")
        reader.sync(engine)
        engine.generate(prompt(BS + 1, start=0), GREEDY)
        messages = reader.sync(engine)
        reader.close()
        replayed = replay(publisher_for(engine).replay_endpoint, 0, topic=b"kv@engine-1")
    assert messages and {topic for topic, *_ in messages} == {b"kv@engine-1"}
    assert {(seq, payload) for _, seq, _, payload in messages} <= set(replayed)


def test_a_full_queue_drops_batches_without_blocking_and_their_numbers_show_the_gap():
    config = load_config({"kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                                        "replay_endpoint": "tcp://127.0.0.1:0", "hwm": 1}},
                         env={}).kv_events
    publisher = KVEventPublisher(config, block_size=BS)
    num_published = 0
    for i in range(2000):
        publisher.publish([BlockEvent("removed", (i.to_bytes(16, "big"),))])
        num_published += 1
    marker = BlockEvent("removed", (b"\xff" * 16,))
    while True:   # the last batch must get through: it announces the drops before it
        num_dropped = publisher.num_dropped
        publisher.publish([marker])
        num_published += 1
        if publisher.num_dropped == num_dropped:
            break
        threading.Event().wait(0.01)
    frames = []
    for _ in range(200):   # replay what has been sent so far, until the marker is among it
        frames += replay(publisher.replay_endpoint, frames[-1][0] + 1 if frames else 0)
        if frames and msgpack.unpackb(frames[-1][1])[1][0]["block_hashes"] == [2**64 - 1]:
            break
        threading.Event().wait(0.05)
    publisher.close()
    seqs = [seq for seq, _ in frames]
    assert publisher.num_dropped > 0 and publisher.num_batches == len(seqs)
    assert publisher.num_batches + publisher.num_dropped == num_published
    assert seqs == sorted(set(seqs)) and seqs[-1] + 1 == num_published   # each drop left a hole


def test_a_taken_endpoint_is_a_config_error_naming_the_field(tiny):
    with make_engine(tiny) as first:
        taken = publisher_for(first).endpoint
        with pytest.raises(ConfigError, match=r"kv_events.endpoint: cannot bind 'tcp://127.0.0.1:\d+' "
                                              r"\(Address already in use"):
            make_engine(tiny, endpoint=taken, replay_endpoint=None)


def test_the_sockets_close_when_the_engine_is_closed(tiny):
    engine = make_engine(tiny)
    endpoint, replay = publisher_for(engine).endpoint, publisher_for(engine).replay_endpoint
    engine.close()  # corekv_on_engine_closed; the engine object is still alive here
    make_engine(tiny, endpoint=endpoint, replay_endpoint=replay).close()  # both addresses are free


def test_the_sockets_close_with_the_publisher_and_when_the_engine_is_collected(tiny):
    engine = make_engine(tiny)
    endpoint = publisher_for(engine).endpoint
    publisher_for(engine).close()
    with make_engine(tiny, endpoint=endpoint, replay_endpoint=None) as second:
        assert publisher_for(second).endpoint == endpoint
    engine.close()
    del engine, second
    gc.collect()                 # the collected engine's finalizer closed its publisher
    make_engine(tiny, endpoint=endpoint, replay_endpoint=None).close()


def test_off_by_default_the_plugin_publishes_nothing_and_imports_no_zmq():
    """In a fresh interpreter (this module imports zmq itself): a whole engine is built and run, so
    this takes the seconds of importing torch and transformers."""
    code = (
        "import sys\n"
        "from corekv.engine.llm_engine import Engine\n"
        "from corekv.engine.tiny_model import make_tiny_llama\n"
        "from corekv.plugins.kv_event_publisher import publisher_for\n"
        "engine = Engine.from_config({'model': 'tiny', 'engine': {'num_blocks': 8}}, model=make_tiny_llama())\n"
        "engine.generate([list(range(3, 40))])\n"
        "assert engine.config.kv_events.enabled is False\n"
        "assert publisher_for(engine) is None\n"
        "print(sorted(m for m in ('zmq', 'msgpack') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COREKV_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
