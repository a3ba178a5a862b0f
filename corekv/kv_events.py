"""KV events on the wire, compatible with vLLM's (``vllm.distributed.kv_events``).

A publisher sends one ZMQ multipart message per batch on a PUB socket::

    [topic (utf-8), seq (8 bytes, big-endian, from 0), payload (msgpack)]

The payload is a batch encoded as positional msgpack arrays, exactly as vLLM's msgspec structs
with ``array_like=True, omit_defaults=True, tag=True`` encode them (tag first, fields in order)::

    batch:            [ts: float64, [event, ...]]            (+ [data_parallel_rank] when set)
    BlockStored:      ["BlockStored", [hash, ...], parent_hash | nil, [token id, ...],
                       block_size, lora_id | nil, medium | nil]
                      (+ [lora_name | nil, [extra keys | nil, ...]] when extra keys are set)
    BlockRemoved:     ["BlockRemoved", [hash, ...], medium | nil]
    AllBlocksCleared: ["AllBlocksCleared"]

A hash is ``bytes`` (msgpack bin; corekv's 16-byte xxh3-128 or 32-byte sha256 chain hashes) or an
``int`` (older vLLM). ``extra_keys`` has one entry per block, as in vLLM: an array of what set the
block's hash apart besides its tokens and parent (vLLM: LoRA name, multimodal hashes, the salt), or
nil. corekv sets it only on the first block of a salted chain, to ``[cache_salt_key(salt)]`` (a
digest of the tenant's salt); ``token_ids`` is empty when the publisher withholds them
(``kv_events.include_token_ids: false``).

A replay ROUTER socket, when the publisher has one, answers a request ``[b"", start seq (8 bytes
big-endian)]`` with ``[b"", seq, payload]`` for every buffered batch from ``start`` on, then the
end marker ``[b"", -1 (8 bytes, signed), b""]``.

:func:`decode_batch` also reads what newer and older vLLM versions send: extra trailing fields
are ignored, missing trailing optional fields read as ``None``, and map-encoded events
(``{"type": "BlockStored", ...}``) are accepted. ``msgpack`` is imported on first use only.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from corekv.errors import CoreKVError
from corekv.config.values import describe_value

logger = logging.getLogger(__name__)

ExternalBlockHash = Union[bytes, int]
SEQ_BYTES = 8
#: how a tenant's extra key starts (see :func:`cache_salt_key`)
CACHE_SALT_KEY_PREFIX = "cache_salt_sha256:"
#: the replay socket's end-of-replay sequence number (sent as 8 signed big-endian bytes)
END_OF_REPLAY_SEQ = -1


class KVEventDecodeError(CoreKVError, ValueError):
    """A payload is not a KV event batch in the vLLM wire format; the message says what is wrong."""


def cache_salt_key(cache_salt: str | None) -> str | None:
    """The extra key that names a salted chain's tenant in KV events; ``None`` for no salt.

    ``"cache_salt_sha256:"`` and the first 16 bytes, in hex, of sha256 over a fixed label and the
    salt. A publisher puts it in the first block's ``extra_keys`` of a salted chain, and a router
    computes it from a request's ``cache_salt`` to find that tenant's blocks: equal salts give
    equal keys, and ``None`` and ``""`` are both no salt (as in :func:`corekv.hashing.chain_seed`).

    NOTE: vLLM sends the salt itself; corekv sends this digest instead, so a subscriber can tell
    tenants apart but cannot read their salts (which are often tenant ids or secrets). It is not
    keyed: whoever guesses a salt can confirm the guess, so salts meant to stay private should be
    random strings, not names.
    """
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt_key(cache_salt=...) got {describe_value(cache_salt)}; "
                        "expected the request's cache_salt (a str) or None")
    if not cache_salt:
        return None
    digest = hashlib.sha256(b"corekv-kv-events-cache-salt-v1\0" + cache_salt.encode()).digest()
    return CACHE_SALT_KEY_PREFIX + digest[:16].hex()


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became cached: one contiguous run of a hash chain.

    ``parent_block_hash`` is the hash of the block just before ``block_hashes[0]`` (``None`` at the
    chain's start); ``token_ids`` are the stored blocks' tokens, ``block_size`` per block, or empty
    when the publisher withholds them; ``extra_keys`` is ``None`` or one entry per block: a tuple
    of the block's extra hash keys, or ``None`` (the fields after ``medium`` are vLLM's, in its
    order).
    """

    block_hashes: Sequence[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None

    def __post_init__(self) -> None:
        _set_tuple(self, "block_hashes", self.block_hashes, _check_hash)
        _set_tuple(self, "token_ids", self.token_ids, _check_token)
        if self.parent_block_hash is not None:
            _check_hash("parent_block_hash", self.parent_block_hash)
        _check_int("block_size", self.block_size)
        if self.lora_id is not None:
            _check_int("lora_id", self.lora_id)
        _check_medium(self.medium)
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise TypeError(f"lora_name got {describe_value(self.lora_name)}; expected a str or None")
        if self.extra_keys is not None:
            _set_tuple(self, "extra_keys", self.extra_keys, _check_extra_keys)
            if len(self.extra_keys) != len(self.block_hashes):
                raise ValueError(f"extra_keys has {len(self.extra_keys)} entries for "
                                 f"{len(self.block_hashes)} block hashes; expected one per block "
                                 "(None for a block without extra keys)")
            object.__setattr__(self, "extra_keys", tuple(
                None if keys is None else _frozen(keys) for keys in self.extra_keys))


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks left the cache (``medium``: where from; ``None`` is the device cache)."""

    block_hashes: Sequence[ExternalBlockHash]
    medium: str | None = None

    def __post_init__(self) -> None:
        _set_tuple(self, "block_hashes", self.block_hashes, _check_hash)
        _check_medium(self.medium)


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone (a cache reset): consumers drop everything of this publisher."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, in order; ``ts`` is the publisher's ``time.time()``."""

    ts: float
    events: Sequence[KVEvent]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ts, bool) or not isinstance(self.ts, (int, float)):
            raise TypeError(f"KVEventBatch(ts=...) got {self.ts!r}; expected seconds as a float "
                            "(time.time())")
        object.__setattr__(self, "ts", float(self.ts))
        _set_tuple(self, "events", self.events, _check_event)
        if self.data_parallel_rank is not None:
            _check_int("data_parallel_rank", self.data_parallel_rank)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM consumers decode (see the module docstring for the layout)."""
    import msgpack  # NOTE: lazy: the optional `events` extra, loaded only by those who use it

    if not isinstance(batch, KVEventBatch):
        raise TypeError(f"encode_batch(batch=...) got {type(batch).__name__}; expected a "
                        "KVEventBatch")
    events = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            fields = ["BlockStored", list(e.block_hashes), e.parent_block_hash,
                      list(e.token_ids), e.block_size, e.lora_id, e.medium]
            if e.extra_keys is not None:
                fields += [e.lora_name, list(e.extra_keys)]
            elif e.lora_name is not None:
                fields.append(e.lora_name)
            events.append(fields)
        elif isinstance(e, BlockRemoved):
            events.append(["BlockRemoved", list(e.block_hashes), e.medium])
        else:
            events.append(["AllBlocksCleared"])
    # NOTE: omit_defaults on an array_like struct drops only trailing defaults: the rank goes
    # when unset, and so do lora_name and extra_keys; lora_id and medium are required fields in
    # vLLM's structs, so always sent.
    fields: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        fields.append(batch.data_parallel_rank)
    return msgpack.packb(fields, use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read a batch payload (from corekv or vLLM); raises :class:`KVEventDecodeError`."""
    import msgpack

    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_batch(payload=...) got {type(payload).__name__}; expected bytes "
                        "(the third frame of a KV event message)")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise KVEventDecodeError(f"payload of {len(payload)} bytes is not valid msgpack ({e})") from e
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventDecodeError(f"payload decodes to {describe_value(raw)}; expected a batch "
                                 "[ts, [event, ...]] (+ [data_parallel_rank])")
    try:
        return KVEventBatch(raw[0], [_decode_event(e) for e in raw[1]],
                            raw[2] if len(raw) > 2 else None)
    except (TypeError, ValueError) as e:
        raise KVEventDecodeError(f"malformed KV event batch: {e}") from e


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):  # map-encoded (a struct without array_like): tag under "type"
        tag = raw.get("type")
        names = _FIELDS.get(tag)
        if names is None:
            raise KVEventDecodeError(f"event {describe_value(raw)} has unknown type {tag!r}; expected one "
                                     f"of {', '.join(_FIELDS)}")
        return _EVENT_TYPES[tag](**{n: raw[n] for n in names if n in raw})
    if not isinstance(raw, list) or not raw or raw[0] not in _FIELDS:
        raise KVEventDecodeError(f"event {describe_value(raw)} is not a tagged array; expected "
                                 f"[tag, fields...] with tag one of {', '.join(_FIELDS)}")
    tag = raw[0]
    names = _FIELDS[tag]
    # NOTE: zip drops extra trailing fields (newer vLLM adds some); missing optional ones default.
    return _EVENT_TYPES[tag](**dict(zip(names, raw[1:])))


_EVENT_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                "AllBlocksCleared": AllBlocksCleared}
_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name", "extra_keys"),
           "BlockRemoved": ("block_hashes", "medium"),
           "AllBlocksCleared": ()}


def _set_tuple(obj: Any, name: str, values: Any, check: Any) -> None:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{type(obj).__name__}({name}=...) got {describe_value(values)}; expected a list")
    values = tuple(values)
    for v in values:
        check(name, v)
    object.__setattr__(obj, name, values)


def _check_hash(name: str, value: Any) -> None:
    if value.__class__ is not bytes and (value.__class__ is not int):
        raise TypeError(f"{name} holds {describe_value(value)}; expected block hashes as bytes (or int)")


def _check_int(name: str, value: Any) -> None:
    if value.__class__ is not int:
        raise TypeError(f"{name} got {describe_value(value)}; expected an int")


def _check_token(name: str, value: Any) -> None:
    if value.__class__ is not int:
        raise TypeError(f"{name} holds {describe_value(value)}; expected token ids (ints)")


def _check_medium(value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"medium got {describe_value(value)}; expected a tier name (str) or None")


def _check_extra_keys(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
        raise TypeError(f"{name} holds {describe_value(value)}; expected a tuple of a block's "
                        "extra hash keys, or None")


def _frozen(value: Any) -> Any:
    """``value`` with every list turned into a tuple (msgpack reads tuples back as lists)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _check_event(name: str, value: Any) -> None:
    if not isinstance(value, (BlockStored, BlockRemoved, AllBlocksCleared)):
        raise TypeError(f"{name} holds {describe_value(value)}; expected BlockStored, BlockRemoved or "
                        "AllBlocksCleared")


class KVEventSubscriber:
    """Receives one publisher's batches on a background thread, in sequence order.

    Invariants: ``on_batch(seq, batch)`` is called from the subscriber's thread only, with ``seq``
    strictly increasing, except that a publisher restart (a live ``seq`` that does not grow) calls
    ``on_restart()`` (drop what you knew of this publisher) and starts over from seq 0; a gap in the live stream is filled from ``replay_endpoint`` when given, and whatever
    stays missing is reported once to ``on_gap(first_missing_seq, num_missing)`` and counted in
    ``num_missed``; an undecodable payload is counted in ``num_decode_errors`` and skipped.

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
                if len(frames) != 3 or len(frames[1]) != SEQ_BYTES or (
                        self.topic and frames[0] != self.topic.encode()):
                    continue  # NOTE: another topic that shares our prefix, or not a KV event
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
            if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_OF_REPLAY_SEQ:
                return
            if self.last_seq is not None and seq <= self.last_seq:
                continue
            if self.last_seq is not None and seq > self.last_seq + 1:
                # the publisher's buffer no longer holds these
                self._report_gap(self.last_seq + 1, seq - self.last_seq - 1)
            self.num_replayed += 1
            self._deliver(seq, frames[2])

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as e:
            self.num_decode_errors += 1
            logger.warning("KV event batch %d from %s skipped: %s", seq, self.endpoint, e)
            return
        self.num_batches += 1
        try:
            self.on_batch(seq, batch)
        except Exception:
            # NOTE: a failing consumer must not stop the stream (the next batches still come).
            logger.exception("KVEventSubscriber on_batch failed for batch %d", seq)

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
