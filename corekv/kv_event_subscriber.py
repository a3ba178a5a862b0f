"""Receiving KV events: :class:`KVEventSubscriber` follows one publisher's batches (the messages and
the replay exchange described in :mod:`corekv.kv_event_wire`: vLLM 0.32's, sent by corekv's
``kv_events`` plugin and by vLLM 0.32 servers alike) on a background thread, fills gaps from the
replay socket and reports what stays missing. ``zmq`` is imported on :meth:`start` only.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from corekv.kv_event_wire import (
    END_OF_REPLAY_SEQ, SEQ_BYTES, KVEventBatch, KVEventDecodeError, decode_batch,
)

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    """Receives one publisher's batches on a background thread, in sequence order.

    Invariants: ``on_batch(seq, batch)`` is called from the subscriber's thread only, with ``seq``
    strictly increasing, except that a publisher restart (a live ``seq`` that does not grow) calls
    ``on_restart()`` (drop what you knew of this publisher) and starts over from seq 0; a gap in the live stream is filled from ``replay_endpoint`` when given, and whatever
    stays missing is reported once to ``on_gap(first_missing_seq, num_missing)`` and counted in
    ``num_missed``; a malformed message (frames of the wrong shape) or an undecodable payload is
    counted in ``num_decode_errors``, logged once, and skipped: a hostile or broken publisher costs
    its own batches, never the thread.

    :param endpoint: the publisher's PUB address to connect to (``tcp://127.0.0.1:5557``).
    :param replay_endpoint: its replay ROUTER address, or ``None`` (gaps are then only reported).
    :param topic: receive only this topic (``""``: every message).
    :param on_gap: called with ``(first_missing_seq, num_missing)`` for batches lost for good.
    :param on_restart: called when the publisher restarted (a new engine: its cache is new).
    :param start_seq: replay the publisher's buffer from this sequence number on start (``0``: all
        it still holds); ``None`` starts with the first live batch.
    :param replay_timeout_s: how long to wait for each replay reply before giving up on the rest.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 on_batch: Callable[[int, KVEventBatch], None],
                 on_gap: Callable[[int, int], None] | None = None,
                 on_restart: Callable[[], None] | None = None, start_seq: int | None = None,
                 replay_timeout_s: float = 1.0):
        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if not (value is None and name == "replay_endpoint") and not (
                    isinstance(value, str) and "://" in value):
                raise ValueError(f"KVEventSubscriber({name}=...) got {value!r}; expected a ZMQ "
                                 "address such as tcp://127.0.0.1:5557")
        if not isinstance(topic, str):
            raise TypeError(f"KVEventSubscriber(topic=...) got {topic!r}; expected a str ('' for all)")
        for name, callback in (("on_batch", on_batch), ("on_gap", on_gap), ("on_restart", on_restart)):
            if not callable(callback) and not (callback is None and name != "on_batch"):
                raise TypeError(f"KVEventSubscriber({name}=...) got {callback!r}; expected a "
                                "function")
        if start_seq is not None and (start_seq.__class__ is not int or start_seq < 0):
            raise ValueError(f"KVEventSubscriber(start_seq=...) got {start_seq!r}; expected an "
                             "int >= 0 or None")
        if isinstance(replay_timeout_s, bool) or not isinstance(replay_timeout_s, (int, float)) \
                or not replay_timeout_s > 0:
            raise ValueError(f"KVEventSubscriber(replay_timeout_s=...) got {replay_timeout_s!r}; "
                             "expected a number of seconds > 0")
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_batch, self.on_gap, self.on_restart = on_batch, on_gap, on_restart
        self.start_seq, self.replay_timeout_s = start_seq, float(replay_timeout_s)
        #: the last sequence number handled (delivered, reported missing or undecodable)
        self.last_seq: int | None = None if start_seq is None else start_seq - 1
        self.num_batches = self.num_replayed = self.num_missed = self.num_decode_errors = 0
        self.num_restarts = 0
        self._is_error_logged = False
        self._last_live_seq: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> KVEventSubscriber:
        """Connect and start the receiving thread; returns ``self``. Bad addresses raise here."""
        import zmq

        if self._thread is not None:
            raise RuntimeError("this KVEventSubscriber was already started; make a new one")
        self._ctx = zmq.Context()
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            self._sub.connect(self.endpoint)
            self._replay = self._connect_replay() if self.replay_endpoint else None
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"KVEventSubscriber cannot connect to {self.endpoint!r} / "
                             f"{self.replay_endpoint!r}: {e}") from e
        self._thread = threading.Thread(target=self._run, name="corekv-kv-events-sub", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> KVEventSubscriber:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.start_seq is not None and self._replay is not None:
                self._fill_from_replay(self.start_seq)
            while not self._stop.is_set():
                if not self._sub.poll(100):
                    continue
                frames = self._sub.recv_multipart()
                if self.topic and frames[0] != self.topic.encode():
                    continue  # NOTE: another topic that shares our prefix
                if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                    self._count_error(f"a message of {len(frames)} frames; expected [topic, "
                                      f"{SEQ_BYTES}-byte seq, payload]")
                    continue
                self._receive(int.from_bytes(frames[1], "big"), frames[2])
        except Exception:  # pragma: no cover - a socket fault or a bug: say so, stop receiving
            logger.exception("KV event subscriber for %s stopped", self.endpoint)
        finally:
            self._ctx.destroy(linger=0)

    def _receive(self, seq: int, payload: bytes) -> None:
        # NOTE: one publisher run sends strictly increasing numbers on the live socket, so a
        # number that does not grow there means a new run; one at or below last_seq otherwise
        # only repeats what a replay already delivered.
        if self._last_live_seq is not None and seq <= self._last_live_seq:
            logger.info("KV event publisher %s restarted (seq %d after %d)", self.endpoint, seq,
                        self._last_live_seq)
            self.num_restarts += 1
            self.last_seq = -1   # the new run's batches before this one are a gap like any other
            if self.on_restart is not None:
                try:
                    self.on_restart()
                except Exception:
                    logger.exception("KVEventSubscriber on_restart failed")
        self._last_live_seq = seq
        last = self.last_seq
        if last is not None and seq <= last:
            return
        if last is not None and seq > last + 1:
            if self._replay is not None:
                self._fill_from_replay(last + 1)
            if self.last_seq < seq - 1:
                self._report_gap(self.last_seq + 1, seq - self.last_seq - 1)
            if seq <= self.last_seq:
                return
        self._deliver(seq, payload)

    def _fill_from_replay(self, start: int) -> None:
        """Ask the replay socket for ``start...`` and deliver what comes back, in order."""
        self._replay.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
        timeout_ms = int(self.replay_timeout_s * 1000)
        while True:
            if not self._replay.poll(timeout_ms):
                logger.warning("KV event replay from %s did not answer within %.1f s",
                               self.replay_endpoint, self.replay_timeout_s)
                # NOTE: a late answer must not be read as the reply to the next request.
                self._replay.close(linger=0)
                self._replay = self._connect_replay()
                return
            frames = self._replay.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != SEQ_BYTES:
                self._count_error(f"a replay reply of {len(frames)} frames; expected [b'', topic, "
                                  f"{SEQ_BYTES}-byte seq, payload]")
                continue
            _, topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_OF_REPLAY_SEQ:
                return
            if self.topic and topic != self.topic.encode():
                continue
            if self.last_seq is not None and seq <= self.last_seq:
                continue
            if self.last_seq is not None and seq > self.last_seq + 1:
                # the publisher's buffer no longer holds these
                self._report_gap(self.last_seq + 1, seq - self.last_seq - 1)
            self.num_replayed += 1
            self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as e:
            self._count_error(f"batch {seq}: {e}")
            return
        self.num_batches += 1
        try:
            self.on_batch(seq, batch)
        except Exception:
            # NOTE: a failing consumer must not stop the stream (the next batches still come).
            logger.exception("KVEventSubscriber on_batch failed for batch %d", seq)

    def _count_error(self, what: str) -> None:
        self.num_decode_errors += 1
        # NOTE: logged once: a broken publisher repeats its fault on every batch
        log = logger.debug if self._is_error_logged else logger.warning
        self._is_error_logged = True
        log("KV events from %s: skipped %s (counted in num_decode_errors)", self.endpoint, what)

    def _report_gap(self, first: int, count: int) -> None:
        self.num_missed += count
        self.last_seq = first + count - 1
        logger.warning("KV event batches %d..%d from %s are lost", first, first + count - 1,
                       self.endpoint)
        if self.on_gap is not None:
            try:
                self.on_gap(first, count)
            except Exception:
                logger.exception("KVEventSubscriber on_gap failed")

    def _connect_replay(self):
        import zmq

        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.replay_endpoint)
        return socket
