"""``redis``: KV blocks in a Redis server shared by engines on many machines.

redis-py is imported only when a ``RedisTier`` is built, so loading this plugin (which every
plugin manager does) costs nothing for an engine without a redis tier. Install it with
``pip install 'corekv[redis]'``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

from corekv.errors import ConfigError
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier

logger = logging.getLogger(__name__)
_SOCKET_READ_SIZE = 1 << 20


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
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ValueError("the redis tier needs redis-py: pip install 'corekv[redis]'") from e
        for option, value in (("ttl", ttl), ("retry_interval", retry_interval),
                              ("socket_timeout", socket_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{option} must be a number >= 0, got {value!r}", path=option)
        if not isinstance(ttl, int):
            raise ConfigError(f"ttl must be whole seconds (0: no expiry), got {ttl!r}", path="ttl")
        try:
            # NOTE: redis-py's own retries would repeat a dead server's timeout inside every
            # call; the cool-down below replaces them.
            # NOTE: a block is ~0.7 MB; with hiredis a 1 MiB socket read size halves the recv
            # calls of a batch and doubles get bandwidth on loopback (no effect without it).
            self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout or None,
                                                socket_connect_timeout=socket_timeout or None,
                                                retry=Retry(NoBackoff(), 0),
                                                socket_read_size=_SOCKET_READ_SIZE)
        except ValueError as e:
            raise ConfigError(f"url {url!r} is not a Redis URL ({e}); expected "
                              "redis://[:password@]host:port/db or rediss://... for TLS", path="url") from e
        self._errors = (redis.RedisError, OSError)
        self._prefix = f"corekv:{self.fp12}:"
        self.url_for_logs = url.split("@")[-1]  # never log a password
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
        found = self._call("scan", lambda: [bytes.fromhex(k[len(self._prefix):].decode())
                                            for k in self._scan()]) or []
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


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="redis",
        factory=RedisTier,
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
