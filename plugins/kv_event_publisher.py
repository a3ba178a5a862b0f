"""The ``kv_events`` plugin: publish the device cache's block events as vLLM 0.32's KV events
(ZMQ + msgpack).

With ``kv_events: {enabled: true}`` in the config, every engine gets a :class:`KVEventPublisher`
that turns the ``corekv_on_blocks_stored`` / ``corekv_on_blocks_removed`` hooks into
:class:`corekv.kv_event_wire.KVEventBatch` messages on a ZMQ PUB socket (the wire format is
described in :mod:`corekv.kv_event_wire`), so routers written for vLLM's KV events (llm-d,
``corekv route``) follow the cache as they follow a vLLM server's::

    engine = corekv.Engine.from_config({"kv_events": {"enabled": True,
                                                      "endpoint": "tcp://127.0.0.1:5557",
                                                      "replay_endpoint": "tcp://127.0.0.1:5558"}})
    publisher = publisher_for(engine)       # None when kv_events is off
    publisher.endpoint, publisher.num_batches, publisher.num_dropped

Off (the default), the plugin does nothing and imports neither ``zmq`` nor ``msgpack``.

The events say what vLLM's own device pool says of its blocks: ``medium`` ``"GPU"`` (vLLM's
pool reports it on every platform), KV cache group 0 of kind ``full_attention``, data-parallel
rank 0, block hashes as vLLM's default 64-bit ints (:func:`corekv.kv_event_wire.external_block_hash`
of corekv's chain hashes), and one ``extra_keys`` entry per block.

What a subscriber learns: every cached and evicted block's hash, when (each batch's time), the
blocks' token ids only with ``kv_events.include_token_ids: true`` (off by default: they are the
prompts), and for a salted chain a digest
of its tenant's salt (:func:`corekv.kv_event_wire.cache_salt_key`), never the salt itself. The
default endpoint listens on loopback only, so only processes on the same machine can subscribe.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from typing import Any

from corekv.errors import ConfigError
from corekv.plugin import ConfigSectionSpec, Option, hookimpl

logger = logging.getLogger(__name__)

PUBLISHER_NAME = "corekv.plugins.kv_event_publisher:publisher"
SECTION = "kv_events"
#: hosts whose endpoint is bound (vLLM binds only wildcards; a loopback address binds here too, so
#: a local-only publisher needs no wildcard); any other host is connected to (a broker or proxy)
BIND_HOSTS = ("*", "::", "[::]", "0.0.0.0", "localhost", "[::1]")


_ZMQ_ADDRESS = dict(pattern=r"(tcp|ipc|inproc)://\S+",
                    pattern_text="a ZMQ address such as tcp://*:5557, ipc:///tmp/kv-events or "
                                 "inproc://kv-events")

#: the ``kv_events:`` section of the config, validated by load_config
OPTIONS = {
    "enabled": Option("bool", default=False,
                      help="publish KV events (needs pyzmq and msgpack: corekv[events])"),
    "endpoint": Option("str", default="tcp://127.0.0.1:5557", **_ZMQ_ADDRESS,
                       help="the PUB socket: bound when the host is *, :: or a loopback address (or "
                            "ipc://, inproc://), else connected to; the default listens on loopback, "
                            "for subscribers on this machine only (tcp://*:5557 listens on every "
                            "interface: firewall it)"),
    "replay_endpoint": Option("str", default=None, **_ZMQ_ADDRESS,
                              help="a ROUTER socket (always bound) that resends buffered batches "
                                   "from a sequence number; none: no replay"),
    "topic": Option("str", default="", allow_empty=True,
                    help="the topic frame of every message, which subscribers filter on "
                         "(\"\": the empty topic)"),
    "buffer_steps": Option("int", default=10000, minimum=1, help="batches kept for replay"),
    "hwm": Option("int", default=100000, minimum=1,
                  help="most batches waiting to be sent (the publisher queue and the PUB socket's "
                       "high-water mark); past it batches are dropped and counted"),
    # NOTE: off by default: token ids are the tenants' prompts in clear text, for anyone who
    # can subscribe; a router matching prompts to blocks needs them turned on.
    "include_token_ids": Option("bool", default=False,
                                help="send each stored block's token ids (true: anyone who can "
                                     "subscribe reads every tenant's prompts, and corekv route can "
                                     "match prompts to the blocks; false: empty lists, and corekv "
                                     "route routes on the prompts it sent)"),
}


def check_section(values: Any) -> None:
    """The rule between the section's fields: the two sockets need two addresses."""
    # NOTE: port 0 asks for a free port, so two sockets may both say tcp://127.0.0.1:0.
    if values.replay_endpoint == values.endpoint and not values.endpoint.endswith(":0"):
        raise ConfigError(f"kv_events.replay_endpoint: got {values.replay_endpoint!r}, the same "
                          "address as kv_events.endpoint; expected another port or path, e.g. "
                          "tcp://127.0.0.1:5558", path="kv_events.replay_endpoint")


@hookimpl
def corekv_register_config_sections() -> list:
    return [ConfigSectionSpec(SECTION, options=OPTIONS, check=check_section,
                              description="KV event publishing: the device cache's block events "
                                          "as vLLM 0.32 KV events on a ZMQ PUB socket")]


class KVEventPublisher:
    """One engine's KV event publisher: a PUB socket, an optional replay ROUTER, one thread.

    Invariants: batches get sequence numbers 0, 1, 2, ... in the order the hooks handed their
    events over, and each number is sent at most once on the PUB socket; a batch that is lost
    (dropped at a full queue: ``num_dropped``; or unencodable: ``num_errors``) still takes its
    number, which is never sent, so subscribers see the gap (and a replay cannot fill it); the
    hooks (the engine's step) never block and never touch a socket: they only put the events on
    a queue of at most ``hwm`` batches; only the publisher thread touches the sockets; the replay
    buffer holds the last ``buffer_steps`` sent batches, oldest first.
    """

    #: seconds close() waits for queued batches to go out
    CLOSE_TIMEOUT_S = 2.0

    def __init__(self, config: Any, *, block_size: int):
        """:param config: the ``kv_events`` section as ``load_config`` validated it
            (``cfg.kv_events``); read as it is, never checked again."""
        try:
            import zmq
            import msgpack  # noqa: F401  (encode_batch needs it; fail here, not on the thread)
        except ImportError as e:
            raise ConfigError(f"kv_events.enabled: true needs pyzmq and msgpack ({e}); install "
                              "them with pip install 'corekv[events]' or set kv_events.enabled: "
                              "false", path="kv_events.enabled") from e
        self.config, self.block_size = config, block_size
        #: batches sent; dropped at a full queue; lost to a malformed event; replays served
        self.num_batches = self.num_dropped = self.num_errors = self.num_replay_requests = 0
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.hwm)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        try:
            self._pub = self._open(zmq.PUB, config.endpoint, "kv_events.endpoint",
                                   send_hwm=config.hwm)
            self._replay = None
            if config.replay_endpoint is not None:
                self._replay = self._open(zmq.ROUTER, config.replay_endpoint,
                                          "kv_events.replay_endpoint", bind=True)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        #: the addresses actually bound (a port 0 in the config becomes the port chosen)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else None)
        self._is_closed = self._is_aborted = False
        self._num_drops_unannounced = 0   # written by the engine's thread only
        self._thread = threading.Thread(target=self._run, name="corekv-kv-events-pub", daemon=True)
        self._thread.start()
        logger.info("KV events on %s (replay: %s, topic %r)", self.endpoint, self.replay_endpoint,
                    config.topic)

    # -- hook implementations (registered per engine; called on the engine's thread) ----------
    @hookimpl
    def corekv_on_blocks_stored(self, events: list) -> None:
        self.publish(events)

    @hookimpl
    def corekv_on_blocks_removed(self, events: list) -> None:
        self.publish(events)

    def publish(self, events: list) -> None:
        """Queue ``events`` (:class:`corekv.backend.BlockEvent`) as one batch; never blocks."""
        if self._is_closed or not events:
            return
        try:
            self._queue.put_nowait((time.time(), events, self._num_drops_unannounced))
            self._num_drops_unannounced = 0
        except queue.Full:
            self.num_dropped += 1
            self._num_drops_unannounced += 1
            if self.num_dropped == 1:
                logger.warning("KV event queue full (kv_events.hwm=%d): batches are dropped and "
                               "counted", self.config.hwm)

    @hookimpl
    def corekv_on_engine_closed(self, engine: Any) -> None:
        self.close()

    def close(self) -> None:
        """Send what is queued (up to CLOSE_TIMEOUT_S), then close the sockets. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            # NOTE: a full queue makes close() wait for room (the hooks never wait).
            self._queue.put(None, timeout=self.CLOSE_TIMEOUT_S)
        except queue.Full:
            self._is_aborted = True   # the thread stops without sending the rest
        self._thread.join(self.CLOSE_TIMEOUT_S)

    # -- the publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        from corekv.kv_event_wire import encode_batch

        seq = 0
        try:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    # NOTE: replays are served only with the queue empty, so a replay holds
                    # every batch published before the request came.
                    if self._replay is not None and self._replay.poll(0):
                        self._serve_replay()
                        continue
                    try:
                        item = self._queue.get(timeout=0.05)
                    except queue.Empty:
                        continue
                if item is None or self._is_aborted:
                    break
                ts, events, num_dropped_before = item
                seq += num_dropped_before   # NOTE: skipped numbers tell subscribers what was lost
                try:
                    batch = self._to_batch(ts, events)
                    payload = encode_batch(batch)
                except (TypeError, ValueError) as e:
                    # NOTE: a backend's malformed event costs its batch (and a number), not the
                    # publisher.
                    self.num_errors += 1
                    seq += 1
                    logger.warning("KV event batch dropped: %s", e)
                    continue
                if not batch.events:
                    continue
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.num_batches += 1
        except Exception:  # pragma: no cover - a bug or a socket fault: say so, stop publishing
            logger.exception("KV event publisher on %s stopped", self.endpoint)
        finally:
            self._ctx.destroy(linger=0)

    def _serve_replay(self) -> None:
        from corekv.kv_event_wire import END_OF_REPLAY_SEQ

        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV event replay request ignored: expected [identity, b'', 8-byte "
                           "start seq], got %d frames", len(frames))
            return
        self.num_replay_requests += 1
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        # NOTE: vLLM 0.32's replies: [b"", topic, seq, payload] per batch, then the end marker
        # with an empty topic.
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"",
                                     END_OF_REPLAY_SEQ.to_bytes(8, "big", signed=True), b""))

    def _to_batch(self, ts: float, events: list) -> Any:
        from corekv.kv_event_wire import (
            FULL_ATTENTION, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
            external_block_hash,
        )

        wire = []
        for e in events:
            hashes = [] if e.is_cleared else [external_block_hash(h) for h in e.block_hashes]
            if e.kind == "stored" and hashes:
                parent = e.parent_block_hash
                wire.append(BlockStored(
                    hashes, None if parent is None else external_block_hash(parent),
                    e.token_ids if self.config.include_token_ids else (),
                    e.block_size or self.block_size, medium=MEDIUM_GPU,
                    extra_keys=self._extra_keys(e), group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION))
            elif e.kind == "removed" and e.is_cleared:
                wire.append(AllBlocksCleared())
            elif e.kind == "removed" and hashes:
                wire.append(BlockRemoved(hashes, medium=MEDIUM_GPU, group_idx=0))
        # NOTE: vLLM's publisher stamps every batch with its data-parallel rank; corekv has one.
        return KVEventBatch(ts, wire, data_parallel_rank=0)

    @staticmethod
    def _extra_keys(event: Any) -> list:
        """One entry per block, as vLLM's pool sends them: ``None``, except that the first block
        of a salted chain holds the tenant's key, where vLLM puts the salt.

        NOTE: only a run that starts the chain carries it (vLLM: the block at token 0); a run
        continuing a chain belongs to the tenant of its parent block, which a consumer already
        knows. The key is a digest of the salt, not the salt (see
        corekv.kv_event_wire.cache_salt_key for why)."""
        from corekv.kv_event_wire import cache_salt_key

        keys: list = [None] * len(event.block_hashes)
        key = cache_salt_key(event.cache_salt) if event.parent_block_hash is None else None
        if key is not None:
            keys[0] = (key,)
        return keys

    def _open(self, kind: int, endpoint: str, field: str, bind: bool | None = None,
              send_hwm: int | None = None):
        import zmq

        socket = self._ctx.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if send_hwm is not None:
            socket.setsockopt(zmq.SNDHWM, send_hwm)   # NOTE: before bind: it applies per pipe
        scheme, _, rest = endpoint.partition("://")
        host = rest.rpartition(":")[0]
        if bind is None:
            bind = scheme in ("ipc", "inproc") or host in BIND_HOSTS or host.startswith("127.")
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as e:
            socket.close(linger=0)
            raise ConfigError(f"{field}: cannot {'bind' if bind else 'connect'} {endpoint!r} "
                              f"({e}); expected a free local address (another engine or process "
                              "may hold it: choose another port)", path=field) from e
        return socket


def publisher_for(engine: Any) -> Any:
    """The :class:`KVEventPublisher` of ``engine``, or ``None`` (``kv_events.enabled`` is off)."""
    manager = getattr(engine, "plugin_manager", None)
    if manager is None:
        raise TypeError(f"publisher_for(engine=...) got {type(engine).__name__}; expected a "
                        "corekv.Engine")
    return manager.pm.get_plugin(PUBLISHER_NAME)


@hookimpl
def corekv_describe_kv_events(engine: Any) -> dict[str, Any] | None:
    """Where ``engine`` publishes (the server's ``/admin/info``): the addresses the publisher
    bound (a port 0 in the config becomes the port chosen; ``tcp://*:P`` reads
    ``tcp://0.0.0.0:P``), else the config's; ``None`` when ``kv_events`` is off."""
    section = getattr(engine.config, "sections", {}).get(SECTION)
    if section is None or not section.enabled:
        return None
    endpoint, replay = section.endpoint, section.replay_endpoint
    publisher = engine.plugin_manager.pm.get_plugin(PUBLISHER_NAME)
    if publisher is not None:
        endpoint, replay = publisher.endpoint, publisher.replay_endpoint
    return {"endpoint": endpoint, "replay_endpoint": replay, "topic": section.topic}


# NOTE: tryfirst: other engine-started hooks (the pinned plugin warming cache.pinned) store
# blocks, and those events must find the publisher registered.
@hookimpl(tryfirst=True)
def corekv_on_engine_started(engine: Any) -> None:
    # NOTE: a config built by hand, not by load_config, may lack the section: then nothing is on.
    section = engine.config.sections.get(SECTION)
    if section is None or not section.enabled:
        return
    publisher = KVEventPublisher(section, block_size=engine.block_size)
    # NOTE: registered on *this engine's* plugin manager, so each engine's events reach only its
    # own publisher. engine.close() closes the sockets (corekv_on_engine_closed); an engine that
    # is never closed closes them when it is garbage-collected.
    engine.plugin_manager.register(publisher, name=PUBLISHER_NAME)
    weakref.finalize(engine, publisher.close)
