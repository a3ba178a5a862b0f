"""KV events on the wire, compatible with vLLM's (``vllm.distributed.kv_events``): the event
classes, their checks, :func:`encode_batch` / :func:`decode_batch` and :func:`cache_salt_key`.
The ``kv_events`` plugin (:mod:`corekv.plugins.kv_event_publisher`) sends them;
:class:`corekv.kv_event_subscriber.KVEventSubscriber` receives them.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from corekv.errors import CoreKVError
from corekv.config.values import describe_value

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
