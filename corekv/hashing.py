"""Chained block hashing: the keys under which every tier and backend knows a block.

``h_i = H(h_{i-1} || tokens of block i)`` and ``h_{-1} = H(model fingerprint, block size,
cache_salt, extra keys)``. Equal hashes therefore mean the same whole prefix, for the same model
and tenant, in every process and on every machine: nothing here uses Python's ``hash()`` or a
per-process seed.

Token ids are packed once per prompt as little-endian uint32 (one vectorised conversion), and the
chain then hashes fixed-size slices of that one buffer.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import xxhash

BlockHash = bytes
HASH_ALGORITHMS = ("xxh3_128", "sha256")

# NOTE: array("I") is native-endian; every platform corekv runs on is little-endian, and the check
# below turns a big-endian machine into a loud error instead of silently different keys.
if array("I", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover - no such machine here
    raise ImportError("corekv.hashing assumes a little-endian machine for portable block keys")


_DIGESTS = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest(),
}


def _digest_function(algorithm: str):
    digest = _DIGESTS.get(algorithm)
    if digest is None:
        raise ValueError(f"hash algorithm {algorithm!r} is not supported; expected one of "
                         f"{HASH_ALGORITHMS} (cache.hash in the config)")
    return digest


def check_cache_salt(cache_salt: object, *, allow_empty: bool = True) -> str | None:
    """The one check of a tenant salt, made where it enters corekv: the engine's public calls,
    the server's request bodies, and :func:`chain_seed` for code that builds keys itself.
    What it lets through is trusted from there on (:class:`PrefixKey`, block events).

    :param allow_empty: ``""`` is the same as ``None`` (no salt); the server passes False, since
        a JSON client sending ``""`` more likely lost its salt than meant none.
    :returns: the salt, ``""`` read as ``None``.
    :raises TypeError: for anything but a str or None (and ``""`` when not ``allow_empty``).
    """
    if cache_salt is None or (cache_salt.__class__ is str and (cache_salt or allow_empty)):
        return cache_salt or None
    text = repr(cache_salt)
    raise TypeError(f"cache_salt: got {text if len(text) <= 80 else text[:77] + '...'}; expected "
                    f"{'a' if allow_empty else 'a non-empty'} string (the tenant's salt: prefixes are "
                    "shared only within one salt) or None (null in JSON) for no salt")


def chain_seed(
    model_fingerprint: str,
    block_size: int,
    cache_salt: str | None = None,
    extra_keys: Sequence[str] = (),
    algorithm: str = "xxh3_128",
) -> BlockHash:
    """Return ``h_{-1}``, the root of a request's hash chain.

    :param model_fingerprint: identity of the weights, config, KV dtype and layout.
    :param block_size: tokens per block; different block sizes never share keys.
    :param cache_salt: the request's tenant salt; ``None`` and ``""`` are the same (no salt).
    :param extra_keys: further namespaces, e.g. a LoRA adapter id.
    :returns: a digest of the hash algorithm's size (16 bytes for xxh3_128, 32 for sha256).
    """
    if not isinstance(model_fingerprint, str):
        raise TypeError(f"model_fingerprint must be a str, got {type(model_fingerprint).__name__}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    cache_salt = check_cache_salt(cache_salt)
    if isinstance(extra_keys, (str, bytes)):
        raise TypeError(f"extra_keys must be a sequence of keys, got the single string "
                        f"{extra_keys!r}; wrap it in a list: [{extra_keys!r}]")
    parts = ["corekv-chain-v1", algorithm, model_fingerprint, str(block_size), cache_salt or ""]
    parts.extend(str(k) for k in extra_keys)
    # NOTE: length-prefixing every part keeps ("ab", "c") and ("a", "bc") apart.
    payload = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
    return _digest_function(algorithm)(payload)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32 in one pass (raises OverflowError on ids >= 2**32)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    packed = array("I")
    # NOTE: fromlist() converts a list faster than array("I", list) does (no per-item iterator).
    if isinstance(token_ids, list):
        packed.fromlist(token_ids)
    else:
        packed.extend(token_ids)
    return packed.tobytes()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: BlockHash,
    algorithm: str = "xxh3_128",
    start: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    :param seed: ``chain_seed(...)`` for block 0, or the hash of block ``start - 1`` to extend a chain.
    :param start: index of the first block to hash; earlier blocks are taken as already hashed.
    """
    digest = _DIGESTS.get(algorithm) or _digest_function(algorithm)
    stride = 4 * block_size
    tokens = token_ids[start * block_size:] if start else token_ids
    if tokens.__class__ is list:   # the common case, without pack_tokens' dispatch
        words = array("I")
        words.fromlist(tokens)
        packed = words.tobytes()
    else:
        packed = pack_tokens(tokens)
    prev = seed
    # NOTE: a comprehension carrying the chain with := is faster than an append loop.
    return [prev := digest(prev + packed[offset:offset + stride])
            for offset in range(0, len(packed) - stride + 1, stride)]


class PrefixKey:
    """A request's tokens with the namespace and the chained hashes of their full blocks.

    Backends index by ``block_hashes`` (hash-block style) or by ``(namespace, token_ids)``
    (radix style); tiers store by ``block_hashes``. ``namespace`` is the chain seed, so two
    requests share cache entries only when model, block size, salt and extra keys all agree.
    Hashes are computed lazily on first access of ``block_hashes`` (a radix index that never
    reads them never pays for them) and incrementally as ``token_ids`` grows. ``cache_salt`` is
    the tenant salt ``namespace`` was made from (``None``: no salt), carried so that block events
    can say which tenant a chain belongs to; nothing indexes by it (the namespace already does).
    ``priority`` is the request's eviction priority (higher is kept longer under the ``priority``
    eviction policy, :mod:`corekv.eviction`); it is no part of the key's identity.
    """

    __slots__ = ("token_ids", "block_size", "namespace", "algorithm", "cache_salt", "priority",
                 "_hashes")

    def __init__(self, token_ids: Sequence[int], block_size: int, namespace: BlockHash,
                 algorithm: str = "xxh3_128", *, cache_salt: str | None = None, priority: int = 0):
        if block_size.__class__ is not int or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if namespace.__class__ is not bytes:
            raise TypeError(f"namespace must be bytes (a chain_seed(...) digest), got "
                            f"{type(namespace).__name__}; build it with chain_seed()")
        if algorithm not in _DIGESTS:
            raise ValueError(f"algorithm must be one of {HASH_ALGORITHMS}, got {algorithm!r}")
        self.token_ids = list(token_ids)
        self.block_size = block_size
        self.namespace = namespace
        self.algorithm = algorithm
        if priority.__class__ is not int:
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        self.cache_salt = cache_salt or None
        self.priority = priority
        self._hashes: list[BlockHash] = []

    def __repr__(self) -> str:
        return (f"PrefixKey(num_tokens={len(self.token_ids)}, block_size={self.block_size}, "
                f"namespace={self.namespace.hex()[:12]})")

    @property
    def num_full_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Chained hashes of every full block of ``token_ids`` (computed once each)."""
        hashes = self._hashes
        done = len(hashes)
        if done < len(self.token_ids) // self.block_size:
            hashes += block_hashes(self.token_ids, self.block_size,
                                   hashes[-1] if done else self.namespace, self.algorithm, start=done)
        return hashes

    def partial_hashes(self, block_index: int, max_tokens: int, min_tokens: int = 1) -> list[BlockHash]:
        """Keys of the leading ``n`` tokens of block ``block_index``, for ``n`` from
        ``max_tokens`` down to ``min_tokens`` (``max_tokens`` < ``block_size``): a partial block, chained to
        the full block before it (or the namespace), so it is found only after the same prefix.

        NOTE: a full block hashes its parent and ``block_size`` tokens; a partial one a marker,
        its parent and fewer tokens: the inputs never coincide, so neither key can stand for
        the other.
        """
        if not 0 < max_tokens < self.block_size or block_index * self.block_size + max_tokens > len(self.token_ids):
            raise ValueError(f"a partial block of block {block_index} has 1 to {self.block_size - 1} tokens "
                             f"within the key's {len(self.token_ids)}; got {max_tokens}")
        digest = _DIGESTS[self.algorithm]
        start = block_index * self.block_size
        head = b"corekv-partial" + (self.block_hashes[block_index - 1] if block_index else self.namespace)
        packed = pack_tokens(self.token_ids[start:start + max_tokens])
        return [digest(head + packed[:4 * n]) for n in range(max_tokens, max(min_tokens, 1) - 1, -1)]

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens (e.g. generated ones); their full blocks get hashes on next access."""
        self.token_ids.extend(token_ids)
