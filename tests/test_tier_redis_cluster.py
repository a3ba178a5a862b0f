"""The redis tier with ``cluster: true`` against a real 6-node Redis Cluster on loopback
(tests/redis_cluster.py): routing per node, faults per node, failover, ``corekv store``."""
import json
import logging
import time

import pytest
import redis
import yaml

from corekv.cli.entry import main as corekv_main
from corekv.errors import ConfigError, CoreKVError
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.testing.tier_admin import StoreAdminTests
from corekv.tiers.redis import RedisAdmin, RedisTier
from redis_cluster import RedisCluster, disposable_redis_cluster, redis_cluster  # noqa: F401 (fixtures)

FINGERPRINT = TierTests.fingerprint
BLOCK = 4096


def flush(cluster) -> None:
    for port in cluster.primary_ports():
        with cluster.client(port) as client:
            client.flushall()


def open_tier(cluster, **kwargs) -> RedisTier:
    return RedisTier(url=cluster.url, cluster=True, block_bytes=BLOCK, fingerprint=FINGERPRINT, **kwargs)


def items(keys):
    return [(k, block_payload(k, BLOCK)) for k in keys]


def port_of_key(tier, key) -> int:
    """The port of the primary that serves ``key`` now, as the cluster itself says."""
    return int(tier._nodes.group([tier._key(key)])[0][0][0].rsplit(":", 1)[1])


class TestRedisClusterTier(TierTests):
    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster):  # noqa: F811
        flush(redis_cluster)
        self.cluster = redis_cluster

    def make_tier(self, tmp_path, block_bytes):
        return RedisTier(url=self.cluster.url, cluster=True, block_bytes=block_bytes,
                         fingerprint=self.fingerprint)


class TestRedisClusterAdmin(StoreAdminTests):
    #: an entry's age is the server's idle time, whole seconds read against this machine's clock
    #: (up to a second apart between two listings, and between nodes)
    age_step_s = 3.5

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster):  # noqa: F811
        flush(redis_cluster)
        self.cluster = redis_cluster

    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return RedisTier(url=self.cluster.url, cluster=True, block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return RedisAdmin(url=self.cluster.url, cluster=True)


def test_keys_spread_over_every_primary_and_a_batch_is_one_round_trip_per_node(redis_cluster):  # noqa: F811
    flush(redis_cluster)
    keys = make_keys(48)
    with open_tier(redis_cluster) as tier:
        assert tier.put(items(keys)) == 48, "a batch across slots is stored whole (no CROSSSLOT)"
        ports = {port_of_key(tier, k) for k in keys}
        assert ports == set(redis_cluster.primary_ports())
        clients = {port: redis_cluster.client(port) for port in ports}

        def reads():  # read events each node handled (the INFO call itself is one)
            return {port: client.info("stats")["total_reads_processed"] for port, client in clients.items()}

        before = reads()
        assert tier.contains_many(keys) == [True] * 48
        after = reads()
        # NOTE: one read event is the pipeline, one the second INFO, and a replica's once-a-second
        # REPLCONF ACK may add one; a call per key would show ~16 per node here
        assert all(2 <= after[port] - before[port] <= 3 for port in ports), (before, after)
        assert [bytes(p) for p in tier.get(keys)] == [v for _, v in items(keys)]
        tier.delete(keys)
        assert tier.get(keys) == [None] * 48 and tier.num_entries == 0
        assert tier.stats()["errors"] == 0
        for client in clients.values():
            client.close()


def test_every_primary_is_listed_and_counted(redis_cluster):  # noqa: F811
    flush(redis_cluster)
    keys = make_keys(30)
    with open_tier(redis_cluster) as tier:
        tier.put(items(keys))
        assert tier.num_entries == 30 and sorted(tier.keys()) == sorted(keys)
        assert tier.used_bytes > 30 * BLOCK
    with RedisAdmin(url=redis_cluster.url, cluster=True) as admin:
        assert sorted(e.key for e in admin.entries()) == sorted(keys)


def test_hits_refresh_the_ttl(redis_cluster):  # noqa: F811
    flush(redis_cluster)
    key = make_keys(1)[0]
    with open_tier(redis_cluster, ttl=100) as tier:
        tier.put(items([key]))
        raw = redis.cluster.RedisCluster.from_url(redis_cluster.url)
        raw.expire(tier._key(key), 5)
        assert bytes(tier.get_one(key)) == block_payload(key, BLOCK)
        assert 95 < raw.ttl(tier._key(key)) <= 100
        raw.close()


def test_cluster_urls_and_modes_are_checked(redis_cluster, redis_server):  # noqa: F811
    with pytest.raises(ConfigError, match="has only database 0; end the url with /0") as caught:
        RedisTier(url=redis_cluster.url[:-1] + "1", cluster=True, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    assert caught.value.path == "url"
    with pytest.raises(ConfigError, match="is a Redis Cluster node; add `cluster: true`") as caught:
        RedisTier(url=redis_cluster.url, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    assert caught.value.path == "cluster"
    with pytest.raises(ConfigError, match="is not in cluster mode; remove `cluster: true`"):
        RedisTier(url=redis_server.url, cluster=True, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    with pytest.raises(ConfigError, match="is a Redis Cluster node"):
        RedisAdmin(url=redis_cluster.url)


def test_a_stalled_node_costs_its_keys_once_per_cool_down_and_the_others_keep_hitting(tmp_path):
    # NOTE: a cluster of its own with a long node timeout, so the stall does not start a failover
    cluster = RedisCluster(tmp_path, node_timeout_ms=20_000).start()
    try:
        keys = make_keys(48)
        with open_tier(cluster, socket_timeout=0.3, retry_interval=3600) as tier:
            tier.put(items(keys))
            stalled = port_of_key(tier, keys[0])
            on_stalled = [port_of_key(tier, k) == stalled for k in keys]
            cluster.pause(stalled)
            try:
                started = time.monotonic()
                hits = [p is not None for p in tier.get(keys)]
                first = time.monotonic() - started
                assert hits == [not s for s in on_stalled], "only the stalled node's keys miss"
                assert first < 1.5, f"a stalled node cost {first:.2f} s, expected about one 0.3 s deadline"
                assert tier.stats()["errors"] == 1
                started = time.monotonic()
                for _ in range(5):
                    assert [p is not None for p in tier.get(keys)] == hits
                    assert tier.put(items(keys)) == len(keys) - sum(on_stalled)
                assert time.monotonic() - started < 1.0, "the cool-down did not skip the stalled node"
                assert tier.stats()["errors"] == 1, "the stalled node was called during its cool-down"
            finally:
                cluster.resume(stalled)
    finally:
        cluster.stop()


def test_a_killed_primary_fails_over_and_its_keys_hit_again(disposable_redis_cluster, caplog):  # noqa: F811
    cluster = disposable_redis_cluster
    keys = make_keys(48)
    with open_tier(cluster, socket_timeout=0.5, retry_interval=0.5) as tier:
        tier.put(items(keys))
        for port in cluster.primary_ports():  # every write reached the replicas before the crash
            with cluster.client(port) as client:
                assert client.execute_command("WAIT", 1, 5000) == 1
        dead = port_of_key(tier, keys[0])
        on_dead = [port_of_key(tier, k) == dead for k in keys]
        cluster.kill(dead)
        with caplog.at_level(logging.WARNING):
            assert [p is not None for p in tier.get(keys)] == [not d for d in on_dead]
        assert sum(f"at 127.0.0.1:{dead} failed" in r.message for r in caplog.records) == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the replica takes over after the node timeout
            hits = tier.get(keys)
            if all(p is not None for p in hits):
                break
            assert [p is not None for p, d in zip(hits, on_dead) if not d] == [True] * on_dead.count(False)
            time.sleep(0.2)
        assert [bytes(p) for p in tier.get(keys)] == [v for _, v in items(keys)], "no failover seen"
        assert dead not in {port_of_key(tier, k) for k in keys}
        new = make_keys(8, salt="after")
        assert tier.put(items(new)) == 8 and tier.exists(new) == 8


def test_corekv_store_works_over_every_primary(redis_cluster, tmp_path, capsys):  # noqa: F811
    flush(redis_cluster)
    keys = make_keys(20)
    with open_tier(redis_cluster) as tier:
        tier.put(items(keys))
        fp12 = tier.fp12
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [
        {"type": "redis", "url": redis_cluster.url, "cluster": True}]}}))
    assert corekv_main(["store", "stats", "--config", str(config), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats[0]["entries"] == 20 and stats[0]["models"][fp12]["entries"] == 20
    assert corekv_main(["store", "verify", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["good"] == 20
    assert corekv_main(["store", "clear", "--config", str(config), "--model", fp12, "--yes"]) == 0
    capsys.readouterr()
    with open_tier(redis_cluster) as tier:
        assert tier.num_entries == 0


def test_corekv_store_on_a_dead_cluster_is_one_clear_error(tmp_path, capsys):
    cluster = RedisCluster(tmp_path)  # never started: nothing listens
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [
        {"type": "redis", "url": cluster.url, "cluster": True}]}}))
    assert corekv_main(["store", "stats", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"redis at {cluster.url} cannot be reached" in err and "Traceback" not in err
    with pytest.raises(CoreKVError, match="cannot be reached"):
        RedisAdmin(url=cluster.url, cluster=True)


def test_a_tier_opened_while_the_cluster_is_down_starts_and_connects_later(tmp_path):
    cluster = RedisCluster(tmp_path)
    with open_tier(cluster, retry_interval=0.2, socket_timeout=0.3) as tier:
        key = make_keys(1)[0]
        assert tier.get_one(key) is None and not tier.put_one(key, block_payload(key, BLOCK))
        assert tier.stats()["errors"] == 1
        cluster.start()
        try:
            deadline = time.monotonic() + 10
            while not tier.put_one(key, block_payload(key, BLOCK)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert bytes(tier.get_one(key)) == block_payload(key, BLOCK)
        finally:
            cluster.stop()


def test_a_password_protected_cluster_and_a_wrong_password(tmp_path):
    cluster = RedisCluster(tmp_path, password="s3cret").start()
    try:
        keys = make_keys(12)
        with open_tier(cluster) as tier:
            assert tier.put(items(keys)) == 12 and tier.exists(keys) == 12
        wrong = cluster.url.replace("s3cret", "wrong")
        with pytest.raises(ConfigError, match="refused the credentials") as caught:
            RedisTier(url=wrong, cluster=True, block_bytes=BLOCK, fingerprint=FINGERPRINT)
        assert "s3cret" not in str(caught.value) and "wrong" not in str(caught.value)
        with pytest.raises(CoreKVError, match="refused the credentials"):
            RedisAdmin(url=wrong, cluster=True)
    finally:
        cluster.stop()
