"""Where the redis tier's keys live: one Redis server, or the primaries of a Redis Cluster.

Both are a set of *nodes* (a name such as ``127.0.0.1:7001`` and a plain redis-py client for that
one server); :meth:`RedisNodes.group` splits a batch of keys by the node that serves them, so
the tier sends each node one pipeline per batch, and a node that fails or stalls costs only its
own keys. A single server is a cluster of one node that serves every key.

In a cluster the slot map comes from redis-py's ``RedisCluster`` (it discovers every node from
the one the URL names); :meth:`ClusterNodes.refresh` reads it again (``CLUSTER SLOTS``), which is
how a failover is followed: the replica that took over a dead primary's slots serves its keys.
redis-py is imported by the functions that connect, never at import time.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from corekv.errors import ConfigError

logger = logging.getLogger(__name__)
#: seconds between two reads of a cluster's slot map while a node is down (to follow a failover)
REFRESH_INTERVAL_S = 1.0
#: bytes per socket read. NOTE: a block is ~0.7 MB; with hiredis a 1 MiB read halves the recv
#: calls of a batch and doubles get bandwidth on loopback (no effect without hiredis).
SOCKET_READ_SIZE = 1 << 20


def without_password(url: str) -> str:
    """``url`` without its credentials, for messages and logs (which must never show a password)."""
    scheme, separator, rest = url.partition("://")
    return scheme + separator + rest.rsplit("@", 1)[-1]


def client_options(socket_timeout: float) -> dict:
    """redis-py options every client of the tier gets: the deadline and no retries.

    NOTE: redis-py's own retries would repeat a dead or stalled server's timeout inside every
    call; the tier's per-node cool-down (:mod:`corekv.tier_faults`) replaces them, so a call costs
    at most one ``socket_timeout`` (connect or read).
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), 0), "socket_read_size": SOCKET_READ_SIZE}


def import_redis():
    try:
        import redis
    except ImportError as e:
        raise ValueError("the redis tier needs redis-py: pip install 'corekv[redis]'") from e
    return redis


class RedisNodes:
    """The nodes that serve the tier's keys; subclasses route keys to them.

    Invariants: :meth:`group` puts each key's index in exactly one group, or in the returned
    ``unrouted`` list when no node serves its slot now (a miss, not an error); :meth:`primaries`
    are the nodes that hold data (for listing and usage).
    """

    seed: str  #: the node the URL names (``host:port``), for messages
    #: set when a slot was found unserved or moved: the next :meth:`follow_topology` reads the map
    wants_refresh = False
    _pool: ThreadPoolExecutor | None = None
    _pool_pid = 0

    def run_each(self, run, groups: list, errors: tuple[type[BaseException], ...]) -> list:
        """``run(group)`` for each group, concurrently on the nodes' threads when there are
        several (one pipeline per node: the batch costs its slowest node, not their sum); an
        exception of ``errors`` is returned in its group's place."""
        def guarded(group):
            try:
                return run(group)
            except errors as e:
                return e

        if len(groups) <= 1:
            return [guarded(group) for group in groups]
        return list(self._threads().map(guarded, groups))

    def follow_topology(self, is_a_node_down: bool) -> set[str] | None:
        """Read the topology again when it may have changed (a cluster's: see
        :class:`ClusterNodes`); the primaries' names when a new map arrived since the last call,
        else ``None``. A single server has nothing to follow."""
        return None

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():  # NOTE: threads do not survive a fork
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="corekv-redis")
            self._pool_pid = os.getpid()
        return self._pool

    def _shutdown_threads(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def group(self, redis_keys: Sequence[str]) -> tuple[list[tuple[str, object, list[int]]], list[int]]:
        """``([(node name, client, key indexes)], unrouted indexes)`` for ``redis_keys``."""
        raise NotImplementedError

    def primaries(self) -> list[tuple[str, object]]:
        """``[(node name, client)]`` of every node that holds data."""
        raise NotImplementedError

    def refresh(self, failed_node: str | None = None) -> None:
        """Read the topology again (a cluster's slot map); a single server has nothing to read."""

    def close(self) -> None:
        raise NotImplementedError


class SingleServer(RedisNodes):
    """One Redis server at ``url`` (any database): every key is served by it."""

    def __init__(self, url: str, socket_timeout: float):
        redis = import_redis()
        try:
            self.client = redis.Redis.from_url(url, **client_options(socket_timeout))
        except ValueError as e:
            raise ConfigError(f"url {without_password(url)!r} is not a Redis URL ({e}); expected "
                              "redis://[:password@]host:port/db or rediss://... for TLS", path="url") from e
        kwargs = self.client.connection_pool.connection_kwargs
        self.seed = f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"

    def check_not_a_cluster(self) -> None:
        """ConfigError when the server is a Redis Cluster node (its other keys live elsewhere:
        every batch would fail with MOVED or CROSSSLOT)."""
        if self.client.info("cluster").get("cluster_enabled"):
            raise ConfigError(f"redis at {self.seed} is a Redis Cluster node; add `cluster: true` to "
                              "the tier so keys are routed to the node that serves them", path="cluster")

    def group(self, redis_keys):
        return [(self.seed, self.client, list(range(len(redis_keys))))], []

    def primaries(self):
        return [(self.seed, self.client)]

    def close(self) -> None:
        self._shutdown_threads()
        self.client.close()


class ClusterNodes(RedisNodes):
    """The primaries of the Redis Cluster the node at ``url`` belongs to (database 0 only).

    :raises ConfigError: the URL is not a Redis URL, names a database other than 0, or the node
        is not in cluster mode.
    :raises redis.AuthenticationError: the nodes refused the URL's credentials.
    :raises redis.RedisError, OSError: no node can be reached now (the tier retries later).
    """

    def __init__(self, url: str, socket_timeout: float):
        redis = import_redis()
        from redis.cluster import RedisCluster

        self.url_for_logs = without_password(url)
        self._redis = redis
        self._refresh: Future | None = None
        self._last_refresh = 0.0
        try:
            from redis.connection import parse_url

            options = parse_url(url)
        except ValueError as e:
            raise ConfigError(f"url {self.url_for_logs!r} is not a Redis URL ({e}); expected "
                              "redis://[:password@]host:port/0 or rediss://... for TLS", path="url") from e
        if options.get("db", 0) != 0:
            raise ConfigError(f"url {self.url_for_logs!r} names database {options['db']}, but a Redis "
                              "Cluster has only database 0; end the url with /0", path="url")
        self.seed = f"{options.get('host', '?')}:{options.get('port', 6379)}"
        try:
            # NOTE: require_full_coverage=False: while a primary is down and not yet replaced,
            # the slot map has a hole, and the other primaries must keep serving their keys.
            self.client = RedisCluster.from_url(url, require_full_coverage=False,
                                                **client_options(socket_timeout))
        except redis.exceptions.RedisClusterException as e:
            if isinstance(e.__cause__, redis.AuthenticationError):
                raise e.__cause__ from e
            if "not enabled" in str(e):
                raise ConfigError(f"redis at {self.seed} is not in cluster mode; remove `cluster: true` "
                                  "from the tier, or point the url at a cluster node", path="cluster") from e
            raise redis.ConnectionError(str(e)) from e

    def group(self, redis_keys):
        from redis.crc import key_slot

        slots = self.client.nodes_manager.slots_cache
        name_to_group: dict[str, tuple[str, object, list[int]]] = {}
        unrouted = []
        for index, redis_key in enumerate(redis_keys):
            owners = slots.get(key_slot(redis_key.encode()))
            if not owners:
                unrouted.append(index)
                continue
            node = owners[0]
            group = name_to_group.get(node.name)
            if group is None:
                group = name_to_group[node.name] = (node.name, self.client.get_redis_connection(node), [])
            group[2].append(index)
        return list(name_to_group.values()), unrouted

    def primaries(self):
        return [(node.name, self.client.get_redis_connection(node)) for node in self.client.get_primaries()]

    def refresh(self, failed_node: str | None = None) -> None:
        self.client.nodes_manager.initialize(last_failed_node_name=failed_node)

    def follow_topology(self, is_a_node_down: bool) -> set[str] | None:
        """While a node is down or a slot moved, read the slot map again, at most once a second
        and on a node thread (off the request's path), so the replica that took over a dead
        primary's slots gets its keys."""
        primaries = None
        if self._refresh is not None:
            if not self._refresh.done():
                return None
            if self._refresh.result():
                primaries = {name for name, _ in self.primaries()}
            self._refresh = None
        now = time.monotonic()
        if (self.wants_refresh or is_a_node_down) and now - self._last_refresh >= REFRESH_INTERVAL_S:
            self.wants_refresh, self._last_refresh = False, now
            self._refresh = self._threads().submit(self._read_slot_map)
        return primaries

    def close(self) -> None:
        self._shutdown_threads()
        self.client.close()

    def _read_slot_map(self) -> bool:
        try:
            self.refresh()
            return True
        except Exception as e:  # noqa: BLE001 - a failed read keeps the old map; never the caller's error
            logger.debug("reading the slot map of the cluster at %s failed: %s", self.url_for_logs, e)
            return False


def open_nodes(url: str, *, is_cluster: bool, socket_timeout: float) -> RedisNodes:
    """The nodes of the server or cluster at ``url`` (see :class:`ClusterNodes` for errors)."""
    return (ClusterNodes if is_cluster else SingleServer)(url, socket_timeout)
