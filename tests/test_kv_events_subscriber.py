"""The KV event subscriber (``corekv.kv_event_subscriber``) on its own: the arguments it refuses, its
one start, and what it does with malformed messages and vLLM 0.32's replay replies from a
hand-driven socket. Its work against a real publisher (replay, gaps, restarts) is tested with the
``kv_events`` plugin in tests/test_kv_events_plugin.py, and against a real vLLM in
tests/vllm/test_vllm_kv_events.py."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from corekv.kv_event_subscriber import KVEventSubscriber
from corekv.kv_event_wire import decode_batch


@pytest.mark.parametrize("kwargs, error, message", [
    ({"endpoint": "localhost:5557"}, ValueError, r"endpoint=\.\.\.\) got 'localhost:5557'; expected a ZMQ address"),
    ({"replay_endpoint": 5558}, ValueError, r"replay_endpoint=\.\.\.\) got 5558"),
    ({"topic": b"kv"}, TypeError, r"topic=\.\.\.\) got b'kv'; expected a str"),
    ({"on_batch": None}, TypeError, r"on_batch=\.\.\.\) got None; expected a function"),
    ({"on_gap": "log"}, TypeError, r"on_gap=\.\.\.\) got 'log'"),
    ({"start_seq": -1}, ValueError, r"start_seq=\.\.\.\) got -1; expected an int >= 0 or None"),
    ({"replay_timeout_s": 0}, ValueError, r"replay_timeout_s=\.\.\.\) got 0; expected a number of seconds > 0"),
])
def test_the_subscriber_checks_its_arguments(kwargs, error, message):
    args = {"endpoint": "tcp://127.0.0.1:5557", "on_batch": lambda seq, batch: None, **kwargs}
    with pytest.raises(error, match=message):
        KVEventSubscriber(args.pop("endpoint"), **args)


def test_a_subscriber_starts_once():
    pytest.importorskip("zmq")
    with KVEventSubscriber("tcp://127.0.0.1:1", on_batch=lambda seq, batch: None) as subscriber:
        with pytest.raises(RuntimeError, match="already started; make a new one"):
            subscriber.start()


# -- against a hand-driven publisher: what a broken or hostile one sends -----------------------

VLLM_BATCH = (Path(__file__).parent / "data" / "vllm_0_32_kv_event_batch.msgpack").read_bytes()
END = (-1).to_bytes(8, "big", signed=True)


def wait_for(condition, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_malformed_live_messages_are_counted_and_skipped_and_the_stream_goes_on():
    """A real vLLM 0.32 payload (tests/data, see test_kv_events_format.py) on a hand-driven PUB
    socket, with broken messages between the good ones."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    received = []
    subscriber = KVEventSubscriber(endpoint, topic="kv",
                                   on_batch=lambda seq, batch: received.append((seq, batch))).start()
    try:
        seq = 0
        while not received:   # NOTE: a SUB socket misses what is sent before it has joined
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), VLLM_BATCH])
            seq += 1
            threading.Event().wait(0.02)
        wait_for(lambda: subscriber.last_seq == seq - 1, "the joining batches")
        array_layout = msgpack.packb([1.0, [["BlockRemoved", [7], "GPU"]], 0])   # vLLM < 0.32
        for frames in ([b"kv", b"\x00" * 4, VLLM_BATCH],                      # a 4-byte seq
                       [b"kv", seq.to_bytes(8, "big")],                        # no payload
                       [b"kv", seq.to_bytes(8, "big"), b"\xc1"],               # not msgpack
                       [b"kv", (seq + 1).to_bytes(8, "big"), array_layout],
                       [b"kv", (seq + 2).to_bytes(8, "big"), b"\x91" * 100_000],   # nested deep
                       [b"kv-other", (seq + 3).to_bytes(8, "big"), b"\xc1"]):   # not our topic
            pub.send_multipart(frames)
        pub.send_multipart([b"kv", (seq + 3).to_bytes(8, "big"), VLLM_BATCH])
        wait_for(lambda: subscriber.last_seq == seq + 3, "the batch after the broken ones")
        assert subscriber._thread.is_alive()
    finally:
        subscriber.close()
        ctx.destroy(linger=0)
    assert subscriber.num_decode_errors == 5 and subscriber.num_missed == 0
    assert [s for s, _ in received] == list(range(received[0][0], seq)) + [seq + 3]
    assert received[-1][1] == decode_batch(VLLM_BATCH)


def test_replay_replies_are_read_in_vllm_0_32s_layout_and_malformed_ones_counted():
    """A hand-driven ROUTER answers the subscriber's replay request as vLLM 0.32's publisher does
    (``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``), a reply in the older three-frame
    layout and an undecodable payload among them."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    replay_endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    received = []
    subscriber = KVEventSubscriber("tcp://127.0.0.1:1", replay_endpoint=replay_endpoint, topic="kv",
                                   start_seq=0, replay_timeout_s=5,
                                   on_batch=lambda seq, batch: received.append((seq, batch))).start()
    try:
        assert router.poll(10_000), "the subscriber sent no replay request"
        client, empty, start = router.recv_multipart()
        assert (empty, int.from_bytes(start, "big")) == (b"", 0)
        for frames in ([b"", b"kv", (0).to_bytes(8, "big"), VLLM_BATCH],
                       [b"", (1).to_bytes(8, "big"), VLLM_BATCH],             # the older layout
                       [b"", b"kv", (2).to_bytes(8, "big"), b"\xc1"],
                       [b"", b"kv", (3).to_bytes(8, "big"), VLLM_BATCH],
                       [b"", b"", END, b""]):
            router.send_multipart([client, *frames])
        wait_for(lambda: subscriber.last_seq == 3, "the replayed batches")
    finally:
        subscriber.close()
        ctx.destroy(linger=0)
    assert [seq for seq, _ in received] == [0, 3]
    assert all(batch == decode_batch(VLLM_BATCH) for _, batch in received)
    assert subscriber.num_decode_errors == 2
    assert subscriber.num_missed == 1    # seq 1 came in no readable form
