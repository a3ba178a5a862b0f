"""``redis``: KV blocks in a Redis server or a Redis Cluster (Valkey too) shared by engines on many
machines.

redis-py is imported only when a ``RedisTier`` or its admin view is built, so loading this
plugin (which every plugin manager does) costs nothing for an engine without a redis tier.
Install it with ``pip install 'corekv[redis]'``.

The layout is written once, here, for the tier (one model's keys) and its admin view (every
model's, for ``corekv store``): one string per block under ``corekv:<fp12>:<hexhash>``. Which
node holds a key is :mod:`corekv.tiers.redis_nodes`'s business (one server, or a cluster's slot
map).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence

from corekv.errors import ConfigError, CoreKVError, describe_exception
from corekv.plugin import Option, TierSpec, hookimpl
from corekv.tier import BlockHash, Tier
from corekv.tier_admin import EntryUse, StoreAdmin, StoredEntry
from corekv.tier_faults import Cooldowns
from corekv.tiers.redis_nodes import RedisNodes, import_redis, open_nodes, without_password

logger = logging.getLogger(__name__)
_NAMESPACE = "corekv:"
_REDIS_KEY = re.compile(re.escape(_NAMESPACE.encode()) + rb"([0-9a-f]{12}):((?:[0-9a-f]{2})+)")
_GET_BATCH = 64  # keys per pipeline when listing a whole store (blocks are up to ~1 MB)


def _parse_redis_key(redis_key: bytes) -> tuple[str, BlockHash] | None:
    """``(fp12, block hash)`` of a block's Redis key; ``None`` for any other key."""
    match = _REDIS_KEY.fullmatch(redis_key)
    return (match.group(1).decode(), bytes.fromhex(match.group(2).decode())) if match else None


def _check_numbers(**values) -> None:
    for option, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{option} must be a number >= 0, got {value!r}", path=option)
    if values["socket_timeout"] <= 0:
        raise ConfigError(f"socket_timeout must be > 0 seconds (the deadline of every call to the "
                          f"server), got {values['socket_timeout']!r}", path="socket_timeout")


class RedisTier(Tier):
    """One Redis string per block under ``corekv:<fp12>:<hexhash>`` (value = header + payload).

    Invariants: a batch is one pipeline per node that serves its keys (one node for a single
    server), sent to the nodes concurrently; no Redis or socket error leaves this class: a node
    that fails or outlives ``socket_timeout`` makes its keys misses (get/exists) or skips (put),
    counts one ``errors`` and cools down for ``retry_interval`` seconds, during which calls skip
    it without touching the network, while the other nodes keep serving. A cluster's slot map is
    read again while a node is down, so the replica that replaces a dead primary is used. Reads
    refresh the TTL of their hits when ``ttl`` is set. A full server (``maxmemory`` reached under
    ``noeviction``) skips writes, with one warning, and keeps serving reads. Capacity and eviction
    are the server's (``maxmemory``, ``maxmemory-policy allkeys-lru``).
    """

    is_persistent = True
    is_shared = True
    supports_ttl = True
    supports_listing = True

    def __init__(self, *, url: str = "redis://127.0.0.1:6379/0", cluster: bool = False, ttl: int = 0,
                 retry_interval: float = 5.0, socket_timeout: float = 1.0, block_bytes: int,
                 fingerprint: bytes, dtype: str = "uint8", shape: Sequence[int] | None = None,
                 name: str | None = None):
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint, dtype=dtype, shape=shape,
                         name=name or "redis")
        _check_numbers(ttl=ttl, retry_interval=retry_interval, socket_timeout=socket_timeout)
        if not isinstance(ttl, int):
            raise ConfigError(f"ttl must be whole seconds (0: no expiry), got {ttl!r}", path="ttl")
        redis = import_redis()
        self._redis = redis
        self._errors = (redis.RedisError, OSError)
        self._prefix = f"{_NAMESPACE}{self.fp12}:"
        self.url, self.url_for_logs, self.is_cluster = url, without_password(url), bool(cluster)
        self.ttl, self.retry_interval, self.socket_timeout = ttl, retry_interval, socket_timeout
        self._cooldowns = Cooldowns(self.name, retry_interval, self._stats, kind="redis")
        self._nodes: RedisNodes | None = None
        self._is_full_logged = False
        self._command_errors_logged: set[str] = set()
        self._connect(is_opening=True)

    # ---------------------------------------------------------------- usage (server-wide)
    def is_reachable(self) -> bool:
        # the server answered at open (a cluster: its slot map, and every primary)
        return self._nodes is not None and not self._cooldowns.any_down()

    @property
    def capacity_bytes(self) -> int | None:
        infos = self._on_primaries("info", lambda client: client.info("memory"))
        limits = [info.get("maxmemory", 0) for info in infos]
        return sum(limits) if limits and all(limits) else None

    @property
    def used_bytes(self) -> int:
        return sum(info.get("used_memory", 0)
                   for info in self._on_primaries("info", lambda client: client.info("memory")))

    @property
    def num_entries(self) -> int:
        """Entries of this model (a SCAN of every primary: O(keys), for tools, not steps)."""
        return sum(len(keys) for keys in self._on_primaries("scan", self._scan))

    def keys(self) -> Iterator[BlockHash]:
        found = [_parse_redis_key(k) for keys in self._on_primaries("scan", self._scan) for k in keys]
        return iter([parsed[1] for parsed in found if parsed is not None])

    # ---------------------------------------------------------------- primitives
    def _read_entries(self, keys: list[BlockHash]) -> list[bytes | None]:
        ttl = self.ttl

        def get(pipe, redis_key: str) -> None:
            # NOTE: GETEX reads and pushes the expiry back in one command: a block that keeps
            # hitting stays, one nobody reads expires.
            pipe.getex(redis_key, ex=ttl) if ttl else pipe.get(redis_key)

        results = self._per_node("get", keys, get)
        return [self._value(results.get(index), "get") for index in range(len(keys))]

    def _write_entries(self, items) -> int:
        values = [b"".join(parts) for _, parts in items]
        ex = self.ttl or None
        value_of = dict(zip((self._key(key) for key, _ in items), values))
        results = self._per_node("put", [key for key, _ in items],
                                 lambda pipe, redis_key: pipe.set(redis_key, value_of[redis_key], ex=ex))
        num_stored = 0
        for index in range(len(items)):
            outcome = results.get(index)
            if isinstance(outcome, self._redis.exceptions.OutOfMemoryError):
                self._warn_full(outcome)
            elif isinstance(outcome, Exception):
                self._command_failed("put", outcome)
            elif outcome:
                num_stored += 1
        self._stats["puts"] += num_stored
        self._stats["bytes_written"] += num_stored * self.codec.entry_bytes
        return num_stored

    def _contains_entries(self, keys: list[BlockHash]) -> list[bool]:
        results = self._per_node("exists", keys, lambda pipe, redis_key: pipe.exists(redis_key))
        return [bool(self._value(results.get(index), "exists")) for index in range(len(keys))]

    def _delete_entries(self, keys: list[BlockHash]) -> None:
        results = self._per_node("delete", keys, lambda pipe, redis_key: pipe.delete(redis_key))
        for outcome in results.values():
            self._value(outcome, "delete")

    def _close(self) -> None:
        if self._nodes is not None:
            self._nodes.close()

    # ---------------------------------------------------------------- helpers
    def _key(self, key: BlockHash) -> str:
        return self._prefix + key.hex()

    def _scan(self, client) -> list[bytes]:
        return list(client.scan_iter(match=self._prefix + "*", count=1000))

    def _connect(self, is_opening: bool = False) -> bool:
        """Open the nodes (a cluster: read its slot map); False while no node answers. Refused
        credentials or a server of the wrong mode raise ConfigError when the tier opens; later
        (the cluster was down at open) they are a failure like any other."""
        try:
            return self._open_nodes()
        except ConfigError as e:
            if is_opening:
                raise
            self._cooldowns.failed(self.url_for_logs, "connect", str(e))
            return False

    def _open_nodes(self) -> bool:
        try:
            nodes = open_nodes(self.url, is_cluster=self.is_cluster, socket_timeout=self.socket_timeout)
        except self._redis.AuthenticationError as e:
            raise self._refused(e) from e
        except self._errors as e:
            self._cooldowns.failed(self.url_for_logs, "connect", e)
            return False
        try:
            if not self.is_cluster:
                nodes.check_not_a_cluster()
        except self._redis.AuthenticationError as e:
            nodes.close()
            raise self._refused(e) from e
        except ConfigError:
            nodes.close()
            raise
        except self._errors as e:
            # NOTE: the client reconnects by itself once the server is back; a cluster's nodes
            # are each pinged below, so a down primary cools down alone.
            self._cooldowns.failed(nodes.seed, "connect", e)
        if self.is_cluster:
            for node, client in nodes.primaries():
                try:
                    client.ping()
                except self._errors as e:
                    self._cooldowns.failed(node, "connect", e)
        self._cooldowns.succeeded(self.url_for_logs)
        self._nodes = nodes
        return True

    def _refused(self, error: Exception) -> ConfigError:
        return ConfigError(f"redis at {self.url_for_logs} refused the credentials ({error}); fix the "
                           "password in the url (redis://:PASSWORD@host:port/db)", path="url")

    def _per_node(self, what: str, keys: list[BlockHash], command) -> dict[int, object]:
        """``{key index: reply}``: ``command(pipeline, redis_key)`` for every key, one pipeline per
        node, the nodes concurrently. Keys of a node that is down or fails now, or of a slot no
        node serves, are absent; a reply may be an exception (that command failed alone)."""
        if self._nodes is None and (self._cooldowns.is_down(self.url_for_logs) or not self._connect()):
            return {}
        primaries = self._nodes.follow_topology(self._cooldowns.any_down())
        if primaries is not None:  # a new slot map: a node that serves nothing now is not down
            for endpoint in self._cooldowns.down_endpoints():
                if endpoint not in primaries:
                    self._cooldowns.forget(endpoint)
        redis_keys = [self._key(key) for key in keys]
        groups, unrouted = self._nodes.group(redis_keys)
        self._nodes.wants_refresh |= bool(unrouted)
        groups = [group for group in groups if not self._cooldowns.is_down(group[0])]

        def run(group) -> list:
            _, client, indexes = group
            pipe = client.pipeline(transaction=False)
            for index in indexes:
                command(pipe, redis_keys[index])
            return pipe.execute(raise_on_error=False)

        outcomes = self._nodes.run_each(run, groups, self._errors)
        replies: dict[int, object] = {}
        for (node, _, indexes), outcome in zip(groups, outcomes):
            if isinstance(outcome, BaseException):
                self._cooldowns.failed(node, what, outcome)
            else:
                self._cooldowns.succeeded(node)
                replies.update(zip(indexes, outcome))
        return replies

    def _value(self, reply, what: str):
        """A command's reply, or ``None`` when that command failed (counted)."""
        if isinstance(reply, Exception):
            self._command_failed(what, reply)
            return None
        return reply

    def _command_failed(self, what: str, error: Exception) -> None:
        """One command of a pipeline failed (a moved slot, a cluster that is down): a miss."""
        self._stats["errors"] += 1
        if isinstance(error, (self._redis.exceptions.AskError, self._redis.exceptions.ClusterDownError)):
            self._nodes.wants_refresh = True
        kind = type(error).__name__
        level = logging.DEBUG if kind in self._command_errors_logged else logging.WARNING
        self._command_errors_logged.add(kind)
        logger.log(level, "tier %s: redis %s failed (%s); treated as a miss/skip",
                   self.name, what, describe_exception(error))

    def _warn_full(self, error: Exception) -> None:
        self._stats["errors"] += 1
        if not self._is_full_logged:  # NOTE: once: a full server refuses every write until evicting
            self._is_full_logged = True
            logger.warning("tier %s: redis at %s is full (%s); writes are skipped, reads go on. Run it "
                           "with maxmemory-policy allkeys-lru so old blocks make room for new ones",
                           self.name, self.url_for_logs, describe_exception(error))

    def _on_primaries(self, what: str, fn) -> list:
        """``fn(client)`` on every primary that answers and is not cooling down (for usage and
        listing; not on steps)."""
        with self._lock:
            if self._nodes is None and (self._cooldowns.is_down(self.url_for_logs) or not self._connect()):
                return []
            primaries = self._nodes.primaries()
        results = []
        for node, client in primaries:
            with self._lock:
                if self._cooldowns.is_down(node):
                    continue
            try:
                results.append(fn(client))
            except self._errors as e:
                with self._lock:
                    self._cooldowns.failed(node, what, e)
                continue
            with self._lock:
                self._cooldowns.succeeded(node)
        return results


class RedisAdmin(StoreAdmin):
    """Every model's blocks on the Redis server or cluster at ``url`` (``corekv store``): every
    primary is scanned.

    Takes the tier's options; ``socket_timeout`` bounds each call as for the tier, the others
    (``ttl``, ``retry_interval``) are accepted and unused. Unlike the tier, a failing node is an
    error here (a :class:`CoreKVError` naming it): a tool must not report an unreachable store as
    an empty one.
    """

    def __init__(self, *, url: str = "redis://127.0.0.1:6379/0", cluster: bool = False, ttl: int = 0,
                 retry_interval: float = 5.0, socket_timeout: float = 1.0):
        _check_numbers(ttl=ttl, retry_interval=retry_interval, socket_timeout=socket_timeout)
        self._redis = import_redis()
        self.url_for_logs, self._is_cluster = without_password(url), cluster
        try:
            self._nodes = open_nodes(url, is_cluster=cluster, socket_timeout=socket_timeout)
        except self._redis.AuthenticationError as e:
            raise self._error("refused the credentials", e, "fix the password in the url") from e
        except (self._redis.RedisError, OSError) as e:
            raise self._error("cannot be reached", e, "start it, or fix the url") from e
        try:
            for node, client in self._nodes.primaries():
                self._guarded(node, "ping", client.ping)
            if not cluster:
                self._nodes.check_not_a_cluster()
        except BaseException:
            self._nodes.close()
            raise

    #: NOTE: the server's LRU clock (OBJECT IDLETIME), which reads and writes reset and which
    #: this view reads without resetting; a server under an LFU maxmemory-policy keeps none
    age_basis = "last read or write"

    def entries(self) -> Iterator[StoredEntry]:
        for node, client, batch in self._scan():
            yield from self._fetch(node, client, batch)

    def usage(self) -> Iterator[EntryUse]:
        """Every block's idle time and memory (OBJECT IDLETIME, MEMORY USAGE: neither touches it)."""
        for node, client, batch in self._scan():
            pipe = client.pipeline(transaction=False)
            for redis_key in batch:
                pipe.execute_command("OBJECT", "IDLETIME", redis_key)
                pipe.execute_command("MEMORY", "USAGE", redis_key)
            try:
                replies = self._guarded(node, "idletime", pipe.execute)
            except CoreKVError as e:
                if "LFU" in str(e):
                    raise CoreKVError(f"redis at {self.url_for_logs} keeps no idle times (its "
                                      "maxmemory-policy is an LFU one), so its entries have no age; "
                                      "prune it with a volatile-lru/allkeys-lru policy, or set the "
                                      "tier's ttl") from e
                raise
            now = time.time()
            for i, redis_key in enumerate(batch):
                idle_s, num_bytes = replies[2 * i], replies[2 * i + 1]
                if idle_s is None or num_bytes is None:  # expired or evicted since the scan
                    continue
                yield EntryUse(redis_key, _parse_redis_key(redis_key)[0], int(num_bytes), now - int(idle_s))

    def delete(self, refs: Sequence[bytes]) -> None:
        for start in range(0, len(refs), _GET_BATCH):
            chunk = [ref.decode() if isinstance(ref, bytes) else ref for ref in refs[start:start + _GET_BATCH]]
            groups, _ = self._nodes.group(chunk)
            for node, client, indexes in groups:
                pipe = client.pipeline(transaction=False)
                for index in indexes:
                    pipe.delete(chunk[index])
                self._guarded(node, "delete", pipe.execute)

    def close(self) -> None:
        self._nodes.close()

    def _scan(self) -> Iterator[tuple[str, object, list[bytes]]]:
        """Every primary's block keys, ``_GET_BATCH`` at a time: ``(node, client, keys)``."""
        for node, client in self._nodes.primaries():
            scan = client.scan_iter(match=f"{_NAMESPACE}*", count=1000)
            batch = []
            while True:
                redis_key = self._guarded(node, "scan", lambda: next(scan, None))
                if redis_key is not None and _parse_redis_key(redis_key) is not None:
                    batch.append(redis_key)
                if len(batch) == _GET_BATCH or (redis_key is None and batch):
                    yield node, client, batch
                    batch = []
                if redis_key is None:
                    break

    def _fetch(self, node: str, client, redis_keys: list[bytes]) -> Iterator[StoredEntry]:
        pipe = client.pipeline(transaction=False)
        for redis_key in redis_keys:
            pipe.get(redis_key)
        values = self._guarded(node, "get", pipe.execute)
        for redis_key, data in zip(redis_keys, values):
            if data is not None:  # expired or evicted since the scan
                model, key = _parse_redis_key(redis_key)
                yield StoredEntry(redis_key, key, model, data)

    def _guarded(self, node: str, what: str, fn):
        try:
            return fn()
        except (self._redis.RedisError, OSError) as e:
            if isinstance(e, self._redis.AuthenticationError):
                raise self._error("refused the credentials", e, "fix the password in the url") from e
            where = f"node {node} " if self._is_cluster else ""
            failure = "cannot be reached" if what == "ping" else f"failed ({what})"
            if self._is_cluster:
                fix = "start it, or wait until its replica has taken over its slots"
            else:
                fix = "start it, or fix the url" if what == "ping" else "check that the server is up"
            raise self._error(f"{where}{failure}", e, fix) from e

    def _error(self, what: str, error: BaseException, fix: str) -> CoreKVError:
        return CoreKVError(f"redis at {self.url_for_logs} {what} ({describe_exception(error)}); {fix}")


@hookimpl
def corekv_register_tiers() -> list[TierSpec]:
    return [TierSpec(
        name="redis",
        factory=RedisTier,
        admin=RedisAdmin,
        options={
            "url": Option("str", default="redis://127.0.0.1:6379/0",
                          help="redis://[:password@]host:port/db, or rediss://... for TLS; with "
                          "cluster: any one node of the cluster, database 0"),
            "cluster": Option("bool", default=False,
                              help="the url names a node of a Redis Cluster (or Valkey cluster): keys "
                              "are routed to the node that serves their slot"),
            "ttl": Option("int", default=0, minimum=0,
                          help="seconds each block lives after its last write or hit (0: no expiry)"),
            "retry_interval": Option("float", default=5.0, minimum=0,
                                     help="seconds to treat a failed server or node as down before "
                                     "retrying"),
            "socket_timeout": Option("float", default=1.0, minimum=0.001,
                                     help="seconds before a connect or a call to a server gives up "
                                     "(the deadline of every remote call)"),
        },
        description="KV blocks in a Redis server or Redis Cluster shared by engines on many "
                    "machines (pipelined per node, TTL)",
    )]
