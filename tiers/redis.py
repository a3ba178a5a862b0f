"""``redis``: KV blocks in a Redis server shared by engines on many machines.

redis-py is imported only when a ``RedisTier`` or its admin view is built, so loading this
plugin (which every plugin manager does) costs nothing for an engine without a redis tier.
Install it with ``pip install 'corekv[redis]'``.

The layout is written once, here, for the tier (one model's keys) and its admin view (every
model's, for ``corekv store``): one string per block under ``corekv:<fp12>:<hexhash>``.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence

from corekv.errors import ConfigError, CoreKVError, describe_exception
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier
from corekv.tier_admin import StoreAdmin, StoredEntry

logger = logging.getLogger(__name__)
_SOCKET_READ_SIZE = 1 << 20
_NAMESPACE = "corekv:"
_REDIS_KEY = re.compile(re.escape(_NAMESPACE.encode()) + rb"([0-9a-f]{12}):((?:[0-9a-f]{2})+)")
_GET_BATCH = 64  # keys per MGET when listing a whole server (blocks are up to ~1 MB)


def _parse_redis_key(redis_key: bytes) -> tuple[str, BlockHash] | None:
    """``(fp12, block hash)`` of a block's Redis key; ``None`` for any other key."""
    match = _REDIS_KEY.fullmatch(redis_key)
    return (match.group(1).decode(), bytes.fromhex(match.group(2).decode())) if match else None


def _without_password(url: str) -> str:
    """``url`` without its credentials, for messages and logs (which must never show a password)."""
    scheme, separator, rest = url.partition("://")
    return scheme + separator + rest.rsplit("@", 1)[-1]


def _connect(url: str, socket_timeout: float):
    """A redis-py client for ``url``; a URL redis-py cannot parse is a ConfigError for it."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as e:
        raise ValueError("the redis tier needs redis-py: pip install 'corekv[redis]'") from e
    try:
        # NOTE: redis-py's own retries would repeat a dead server's timeout inside every call;
        # the tier's cool-down replaces them, and for the admin view a failure is an error.
        # NOTE: a block is ~0.7 MB; with hiredis a 1 MiB socket read size halves the recv
        # calls of a batch and doubles get bandwidth on loopback (no effect without it).
        return redis.Redis.from_url(url, socket_timeout=socket_timeout or None,
                                    socket_connect_timeout=socket_timeout or None,
                                    retry=Retry(NoBackoff(), 0), socket_read_size=_SOCKET_READ_SIZE)
    except ValueError as e:
        raise ConfigError(f"url {url!r} is not a Redis URL ({e}); expected "
                          "redis://[:password@]host:port/db or rediss://... for TLS", path="url") from e


class RedisTier(Tier):
    """One Redis string per block under ``corekv:<fp12>:<hexhash>`` (value = header + payload).

    Invariants: every batch is one round trip (MGET, or one non-transactional pipeline); no
    Redis or socket error leaves this class: a failed call is a miss (get/exists) or a skip
    (put), counted in ``errors``, and starts a cool-down of ``retry_interval`` seconds during
    which calls return at once without touching the network, so a dead server costs one timeout
    per interval, not one per step. After the cool-down the connection pool reconnects by itself.
    Capacity and eviction are the server's (``maxmemory`` and ``maxmemory-policy allkeys-lru``).
    """

    is_persistent = True
    is_shared = True
    supports_ttl = True
    supports_listing = True

    def __init__(self, *, url: str = "redis://127.0.0.1:6379/0", ttl: int = 0,
                 retry_interval: float = 5.0, socket_timeout: float = 1.0, block_bytes: int,
                 fingerprint: bytes, dtype: str = "uint8", shape: Sequence[int] | None = None,
                 name: str | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "redis")
        for option, value in (("ttl", ttl), ("retry_interval", retry_interval),
                              ("socket_timeout", socket_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{option} must be a number >= 0, got {value!r}", path=option)
        if not isinstance(ttl, int):
            raise ConfigError(f"ttl must be whole seconds (0: no expiry), got {ttl!r}", path="ttl")
        self._client = _connect(url, socket_timeout)
        import redis

        self._errors = (redis.RedisError, OSError)
        self._prefix = f"{_NAMESPACE}{self.fp12}:"
        self.url_for_logs = _without_password(url)
        self.ttl, self.retry_interval = ttl, retry_interval
        self._down_until = 0.0
        try:
            self._client.ping()
        except redis.AuthenticationError as e:
            raise ConfigError(f"redis at {self.url_for_logs} refused the credentials ({e}); fix the "
                              "password in the url (redis://:PASSWORD@host:port/db)", path="url") from e
        except self._errors as e:
            self._fail("connect", e)

    # ---------------------------------------------------------------- usage (server-wide)
    @property
    def capacity_bytes(self) -> int | None:
        info = self._call("info", lambda: self._client.info("memory"))
        return (info or {}).get("maxmemory") or None

    @property
    def used_bytes(self) -> int:
        info = self._call("info", lambda: self._client.info("memory"))
        return (info or {}).get("used_memory", 0)

    @property
    def num_entries(self) -> int:
        """Entries of this model (a SCAN over the server's keys: O(keys), for tools, not steps)."""
        return self._call("scan", lambda: sum(1 for _ in self._scan())) or 0

    def keys(self) -> Iterator[BlockHash]:
        found = self._call("scan", lambda: [parsed[1] for parsed in map(_parse_redis_key, self._scan())
                                            if parsed is not None]) or []
        return iter(found)

    # ---------------------------------------------------------------- primitives
    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        entries = self._call("get", lambda: self._client.mget([self._key(k) for k in keys]))
        return entries if entries is not None else [None] * len(keys)

    def _write_entries(self, items) -> int:
        def write() -> int:
            pipe = self._client.pipeline(transaction=False)
            for key, parts in items:
                pipe.set(self._key(key), b"".join(parts), ex=self.ttl or None)
            return sum(1 for ok in pipe.execute() if ok)

        num_stored = self._call("put", write) or 0
        self._stats["puts"] += num_stored
        self._stats["bytes_written"] += num_stored * self.codec.entry_bytes
        return num_stored

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", exists) or [False] * len(keys)

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        self._call("delete", lambda: self._client.delete(*[self._key(k) for k in keys]))

    def _close(self) -> None:
        self._client.close()

    # ---------------------------------------------------------------- helpers
    def _key(self, key: BlockHash) -> str:
        return self._prefix + key.hex()

    def _scan(self):
        return self._client.scan_iter(match=self._prefix + "*", count=1000)

    def _call(self, what: str, fn):
        """``fn()``, or ``None`` when the server is cooling down or the call fails."""
        if time.monotonic() < self._down_until:
            return None
        try:
            result = fn()
        except self._errors as e:
            self._fail(what, e)
            return None
        if self._down_until:
            logger.warning("tier %s: redis at %s is reachable again", self.name, self.url_for_logs)
            self._down_until = 0.0
        return result

    def _fail(self, what: str, error: Exception) -> None:
        self._stats["errors"] += 1
        if not self._down_until:  # NOTE: one warning per outage, not one per call
            logger.warning("tier %s: redis %s at %s failed (%s: %s); treating calls as misses and "
                           "retrying every %ss", self.name, what, self.url_for_logs,
                           type(error).__name__, error, self.retry_interval)
        self._down_until = time.monotonic() + self.retry_interval


class RedisAdmin(StoreAdmin):
    """Every model's blocks on the Redis server at ``url`` (``corekv store``).

    Takes the tier's options; ``socket_timeout`` bounds each call as for the tier, the others
    (``ttl``, ``retry_interval``) are accepted and unused. Unlike the tier, a failing server is
    an error here: a tool must not report an unreachable store as an empty one.
    """

    def __init__(self, *, url: str = "redis://127.0.0.1:6379/0", ttl: int = 0,
                 retry_interval: float = 5.0, socket_timeout: float = 1.0):
        self._client = _connect(url, socket_timeout)
        import redis

        try:
            self._client.ping()
        except (redis.RedisError, OSError) as e:
            self._client.close()
            raise CoreKVError(f"redis at {_without_password(url)} cannot be reached "
                              f"({describe_exception(e)}); start it, or fix the url") from e

    def entries(self) -> Iterator[StoredEntry]:
        batch = []
        for redis_key in self._client.scan_iter(match=f"{_NAMESPACE}*", count=1000):
            if _parse_redis_key(redis_key) is not None:
                batch.append(redis_key)
            if len(batch) == _GET_BATCH:
                yield from self._fetch(batch)
                batch = []
        yield from self._fetch(batch)

    def delete(self, refs: Sequence[bytes]) -> None:
        if refs:
            self._client.delete(*refs)

    def close(self) -> None:
        self._client.close()

    def _fetch(self, redis_keys: list[bytes]) -> Iterator[StoredEntry]:
        values = self._client.mget(redis_keys) if redis_keys else []
        for redis_key, data in zip(redis_keys, values):
            if data is not None:  # expired or evicted since the scan
                model, key = _parse_redis_key(redis_key)
                yield StoredEntry(redis_key, key, model, data)


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="redis",
        factory=RedisTier,
        admin=RedisAdmin,
        options={
            "url": Option("str", default="redis://127.0.0.1:6379/0",
                          help="redis://[:password@]host:port/db, or rediss://... for TLS"),
            "ttl": Option("int", default=0, help="seconds each block lives (0: no expiry)", minimum=0),
            "retry_interval": Option("float", default=5.0, minimum=0,
                                     help="seconds to treat a failed server as down before retrying"),
            "socket_timeout": Option("float", default=1.0, minimum=0,
                                     help="seconds before a call to the server gives up"),
        },
        description="KV blocks in a Redis server shared by engines on many machines (pipelined, TTL)",
    )]
