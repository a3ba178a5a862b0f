"""The KV event subscriber (``corekv.kv_event_subscriber``) on its own: the arguments it refuses and
its one start. Its work against a real publisher (replay, gaps, restarts) is tested with the
``kv_events`` plugin in tests/test_kv_events_plugin.py."""
from __future__ import annotations

import pytest

from corekv.kv_event_subscriber import KVEventSubscriber


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
