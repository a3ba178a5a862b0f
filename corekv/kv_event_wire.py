"""KV events on the wire, in vLLM 0.32's format (``vllm.distributed.kv_events``): the event classes,
their checks, :func:`encode_batch` / :func:`decode_batch`, :func:`external_block_hash` and
:func:`cache_salt_key`. The ``kv_events`` plugin (:mod:`corekv.plugins.kv_event_publisher`) sends
them; :class:`corekv.kv_event_subscriber.KVEventSubscriber` receives them.

A publisher sends one ZMQ multipart message per batch on a PUB socket::

    [topic (utf-8), seq (8 bytes, big-endian, from 0), payload (msgpack)]

The payload is what vLLM 0.32's ``msgspec.msgpack.Encoder`` makes of its structs: the batch is
``array_like`` and the events are tagged maps (``tag=True``: the class name under ``"type"``,
first; ``omit_defaults=True``: a field with a default is left out while it holds the default)::

    KVEventBatch:     [ts: float64, [event, ...], data_parallel_rank: int | nil]
    BlockStored:      {"type": "BlockStored", "block_hashes": [hash, ...],
                       "parent_block_hash": hash | nil, "token_ids": [int, ...], "block_size": int,
                       "lora_id": int | nil, "medium": str | nil, "lora_name": str | nil,
                       + when set: "extra_keys", "group_idx", "kv_cache_spec_kind",
                       "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"}
    BlockRemoved:     {"type": "BlockRemoved", "block_hashes": [hash, ...], "medium": str | nil,
                       + when set: "group_idx", "locality", "ownership"}
    AllBlocksCleared: {"type": "AllBlocksCleared"}

The fields up to ``lora_name`` (``medium`` for ``BlockRemoved``) have no default in vLLM, so they
are always sent, ``nil`` included. A hash is an ``int`` (vLLM 0.32's default: the low 64 bits of
its hash, :func:`external_block_hash`) or ``bytes`` (msgpack bin; vLLM with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). ``extra_keys`` has one entry per block: ``nil``, or an
array of what set the block's hash apart besides its tokens and parent, untagged (vLLM: the LoRA
name, ``[mm identifier, offset]`` pairs, the cache salt, prompt-embedding digests). corekv puts
``[cache_salt_key(salt)]`` on the first block of a salted chain.

A replay ROUTER socket answers a request ``[b"", start seq (8 bytes big-endian)]`` with
``[b"", topic, seq, payload]`` for every buffered batch from ``start`` on, then the end marker
``[b"", b"", -1 (8 bytes, signed), b""]``.

:func:`decode_batch` reads this format only, as strictly as vLLM's own decoder
(``msgspec.msgpack.Decoder(KVEventBatch)``) and stricter where corekv relies on a value (one
``extra_keys`` entry per block, hashable extra keys, ``block_size`` >= 1). Like vLLM's decoder it
ignores map keys and trailing batch fields it does not know (newer vLLMs add fields); the array
events of vLLM before the tagged maps are refused. ``msgpack`` is imported on first use only.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from corekv.errors import CoreKVError
from corekv.config.values import describe_value

ExternalBlockHash = Union[bytes, int]
SEQ_BYTES = 8
#: how a tenant's extra key starts (see :func:`cache_salt_key`)
CACHE_SALT_KEY_PREFIX = "cache_salt_sha256:"
#: the replay socket's end-of-replay sequence number (sent as 8 signed big-endian bytes)
END_OF_REPLAY_SEQ = -1
#: the medium vLLM's device block pool reports (on every platform, CPU included), and corekv's
MEDIUM_GPU = "GPU"
#: the kind vLLM reports for a KV cache group of full-attention layers; corekv's pool is one such
FULL_ATTENTION = "full_attention"

_INT64_MIN, _UINT64_END = -(1 << 63), 1 << 64   # what a msgpack int can hold
_SCALARS = (type(None), bool, int, float, str, bytes)


class KVEventDecodeError(CoreKVError, ValueError):
    """A payload is not a KV event batch in vLLM 0.32's wire format; the message says what is wrong."""


def external_block_hash(block_hash: bytes) -> int:
    """A corekv chain hash as vLLM 0.32 publishes its own by default: the low 64 bits, read
    big-endian (vLLM's ``maybe_convert_block_hash``).

    NOTE: consumers written for vLLM (llm-d, Dynamo) expect these ints, the reason vLLM keeps
    them the default; the events only name blocks, so 64 bits are enough there, while the tiers
    keep the full hash."""
    if block_hash.__class__ is not bytes or not block_hash:
        raise TypeError(f"external_block_hash(block_hash=...) got {describe_value(block_hash)}; "
                        "expected a corekv block hash (non-empty bytes)")
    return int.from_bytes(block_hash, "big") & (_UINT64_END - 1)


def cache_salt_key(cache_salt: str | None) -> str | None:
    """The extra key that names a salted chain's tenant in KV events; ``None`` for no salt.

    ``"cache_salt_sha256:"`` and the first 16 bytes, in hex, of sha256 over a fixed label and the
    salt. A publisher puts it in the first block's ``extra_keys`` of a salted chain, and a router
    computes it from a request's ``cache_salt`` to find that tenant's blocks: equal salts give
    equal keys, and ``None`` and ``""`` are both no salt (as in :func:`corekv.hashing.chain_seed`).

    NOTE: vLLM sends the salt itself, in the same place and shape (a str in the first block's
    extra keys); corekv sends this digest instead, so a subscriber can tell tenants apart but
    cannot read their salts (which are often tenant ids or secrets). It is not keyed: whoever
    guesses a salt can confirm the guess, so salts meant to stay private should be random strings,
    not names.
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
    """Full blocks became cached: one contiguous run of a hash chain (vLLM's fields, in its order).

    ``parent_block_hash`` is the hash of the block just before ``block_hashes[0]`` (``None`` at the
    chain's start); ``token_ids`` are the stored blocks' tokens, ``block_size`` per block, or empty
    when the publisher withholds them; ``extra_keys`` is ``None`` or one entry per block: a tuple
    of the block's extra hash keys, or ``None``; ``group_idx`` the KV cache group (vLLM's hybrid
    models) and ``kv_cache_spec_kind`` its kind; the rest is vLLM's metadata, carried as sent.
    """

    block_hashes: Sequence[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    #: the fields vLLM declares without a default: always on the wire, nil included
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name")

    def __post_init__(self) -> None:
        _set_tuple(self, "block_hashes", self.block_hashes, _check_hash)
        _set_tuple(self, "token_ids", self.token_ids, _check_int)
        if self.parent_block_hash is not None:
            _check_hash("parent_block_hash", self.parent_block_hash)
        _check_int("block_size", self.block_size)
        if self.block_size < 1:
            raise ValueError(f"block_size got {self.block_size}; expected tokens per block (>= 1)")
        _check_optional(self, int, "lora_id", "group_idx", "kv_cache_spec_sliding_window")
        _check_optional(self, str, "medium", "lora_name", "kv_cache_spec_kind", "locality",
                        "ownership", "session_id")
        if self.extra_keys is not None:
            _set_tuple(self, "extra_keys", self.extra_keys, _check_extra_keys)
            if len(self.extra_keys) != len(self.block_hashes):
                raise ValueError(f"extra_keys has {len(self.extra_keys)} entries for "
                                 f"{len(self.block_hashes)} block hashes; expected one per block "
                                 "(None for a block without extra keys)")
            object.__setattr__(self, "extra_keys", tuple(
                None if keys is None else tuple(_frozen(key) for key in keys)
                for keys in self.extra_keys))


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks left the cache; ``medium`` says which one (``"GPU"``: the device pool)."""

    block_hashes: Sequence[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ("block_hashes", "medium")

    def __post_init__(self) -> None:
        _set_tuple(self, "block_hashes", self.block_hashes, _check_hash)
        _check_optional(self, int, "group_idx")
        _check_optional(self, str, "medium", "locality", "ownership")


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone (a cache reset): consumers drop everything of this publisher."""

    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ()


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, in order; ``ts`` is the publisher's ``time.time()``, and
    ``data_parallel_rank`` the publishing engine's (vLLM's publisher always sets it; corekv's 0)."""

    ts: float
    events: Sequence[KVEvent]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ts, bool) or not isinstance(self.ts, (int, float)):
            raise TypeError(f"KVEventBatch(ts=...) got {describe_value(self.ts)}; expected seconds "
                            "as a float (time.time())")
        object.__setattr__(self, "ts", float(self.ts))
        _set_tuple(self, "events", self.events, _check_event)
        _check_optional(self, int, "data_parallel_rank")


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``, byte for byte what vLLM 0.32's encoder makes of it."""
    import msgpack  # NOTE: lazy: the optional `events` extra, loaded only by those who use it

    if not isinstance(batch, KVEventBatch):
        raise TypeError(f"encode_batch(batch=...) got {type(batch).__name__}; expected a "
                        "KVEventBatch")
    events = []
    for event in batch.events:
        wire: dict[str, Any] = {"type": type(event).__name__}
        for f in fields(event):
            value = getattr(event, f.name)
            if value is not None or f.name in event.WIRE_REQUIRED:
                wire[f.name] = value
        events.append(wire)
    # NOTE: an array_like struct drops only its trailing defaults: the rank goes when unset.
    wire_batch: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        wire_batch.append(batch.data_parallel_rank)
    try:
        return msgpack.packb(wire_batch, use_bin_type=True)
    except OverflowError as e:
        raise ValueError(f"a KV event holds an int that msgpack cannot carry ({e}); expected "
                         "ints within 64 bits") from e


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read a batch payload (from corekv or vLLM 0.32); raises :class:`KVEventDecodeError`."""
    import msgpack

    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_batch(payload=...) got {type(payload).__name__}; expected bytes "
                        "(the third frame of a KV event message)")
    try:
        # NOTE: msgpack bounds nesting and lengths by the payload's size, and map keys to str or
        # bytes, so a hostile payload fails here instead of exhausting memory or the stack.
        raw = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise KVEventDecodeError(f"payload of {len(payload)} bytes is not valid msgpack ({e})") from e
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventDecodeError(f"payload decodes to {describe_value(raw)}; expected a batch "
                                 "[ts, [event, ...], data_parallel_rank]")
    try:
        return KVEventBatch(raw[0], [_decode_event(e) for e in raw[1]],
                            raw[2] if len(raw) > 2 else None)
    except (TypeError, ValueError) as e:
        raise KVEventDecodeError(f"malformed KV event batch: {e}") from e


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, list):
        raise KVEventDecodeError(f"event {describe_value(raw)} is an array (the layout of vLLM "
                                 "before 0.32); expected a map tagged with \"type\"")
    if not isinstance(raw, dict):
        raise KVEventDecodeError(f"event {describe_value(raw)} is not a map; expected "
                                 "{\"type\": ..., fields...}")
    tag = raw.get("type")
    cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise KVEventDecodeError(f"event has type {describe_value(tag)}; expected one of "
                                 f"{', '.join(_EVENT_TYPES)}")
    missing = [name for name in cls.WIRE_REQUIRED if name not in raw]
    if missing:
        raise KVEventDecodeError(f"{tag} event lacks {', '.join(missing)}; vLLM sends these "
                                 "fields always (nil when unset)")
    return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


def _set_tuple(obj: Any, name: str, values: Any, check: Any) -> None:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{type(obj).__name__}({name}=...) got {describe_value(values)}; expected a list")
    values = tuple(values)
    for v in values:
        check(name, v)
    object.__setattr__(obj, name, values)


def _check_optional(obj: Any, kind: type, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value.__class__ is not kind:   # NOTE: a bool is no int here
            raise TypeError(f"{name} got {describe_value(value)}; expected {kind.__name__} or None")


def _check_hash(name: str, value: Any) -> None:
    if value.__class__ is bytes and value:
        return
    if value.__class__ is not int or not _INT64_MIN <= value < _UINT64_END:
        raise TypeError(f"{name} holds {describe_value(value)}; expected block hashes as 64-bit "
                        "ints or non-empty bytes")


def _check_int(name: str, value: Any) -> None:
    if value.__class__ is not int:
        raise TypeError(f"{name} holds {describe_value(value)}; expected an int")


def _check_extra_keys(name: str, value: Any) -> None:
    """One block's extra keys: None, or a list of keys, each a scalar or a flat list of scalars
    (vLLM's ``[mm identifier, offset]``). NOTE: consumers compare and hash keys (a router keys its
    tree by them), so maps and deeper nesting, which vLLM never sends, are refused."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} holds {describe_value(value)}; expected a list of a block's "
                        "extra hash keys, or None")
    for key in value:
        if isinstance(key, (list, tuple)):
            if all(isinstance(part, _SCALARS) for part in key):
                continue
        elif isinstance(key, _SCALARS):
            continue
        raise TypeError(f"{name} holds the key {describe_value(key)}; expected a str, bytes, "
                        "number or a flat list of them")


def _frozen(key: Any) -> Any:
    """``key`` hashable: a list (msgpack reads tuples back as lists) becomes a tuple."""
    return tuple(key) if isinstance(key, list) else key


def _check_event(name: str, value: Any) -> None:
    if not isinstance(value, tuple(_EVENT_TYPES.values())):
        raise TypeError(f"{name} holds {describe_value(value)}; expected BlockStored, BlockRemoved or "
                        "AllBlocksCleared")
