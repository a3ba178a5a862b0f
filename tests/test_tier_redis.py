"""The redis tier against a real redis-server on loopback (tests/redis_server.py)."""
import logging
import subprocess
import sys
import threading
import time

import pytest
import redis

from corekv.errors import CoreKVError
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.testing.tier_admin import StoreAdminTests
from corekv.tier_factory import make_tier
from corekv.tiers.redis import RedisAdmin, RedisTier
from redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from stalled_endpoint import stalled_endpoint  # noqa: F401 (fixture)

FINGERPRINT = TierTests.fingerprint


class TestRedisTier(TierTests):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server):  # noqa: F811
        self.server = redis_server

    def make_tier(self, tmp_path, block_bytes):
        return RedisTier(url=self.server.url, block_bytes=block_bytes, fingerprint=self.fingerprint)


class TestRedisAdmin(StoreAdminTests):
    #: an entry's age is the server's idle time, whole seconds read against this machine's clock
    #: (up to a second apart between two listings, and between nodes)
    age_step_s = 3.5

    @pytest.fixture(autouse=True)
    def _server(self, redis_server):  # noqa: F811
        self.server = redis_server

    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return RedisTier(url=self.server.url, block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return RedisAdmin(url=self.server.url)


def open_tier(server, **kwargs):
    return RedisTier(url=server.url, block_bytes=4096, fingerprint=FINGERPRINT, **kwargs)


def test_keys_are_namespaced_by_model_fingerprint(redis_server):  # noqa: F811
    key = make_keys(1)[0]
    with open_tier(redis_server) as tier, open_tier(redis_server) as same, \
            RedisTier(url=redis_server.url, block_bytes=4096, fingerprint=b"other") as other:
        tier.put_one(key, block_payload(key, 4096))
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.keys("*") == [f"corekv:{tier.fp12}:{key.hex()}".encode()]
        assert other.get_one(key) is None and other.num_entries == 0
        assert bytes(same.get_one(key)) == block_payload(key, 4096), "a second engine shares it"


def test_the_admin_view_lists_only_block_keys(redis_server):  # noqa: F811
    key = make_keys(1)[0]
    with open_tier(redis_server) as tier:
        tier.put_one(key, block_payload(key, 4096))
        fp12 = tier.fp12
    raw = redis.Redis.from_url(redis_server.url)
    raw.set("corekv:not-a-block", b"x")
    raw.set(f"corekv:{fp12}:xyz", b"x")
    raw.set("someone-else:key", b"x")
    raw.close()
    with RedisAdmin(url=redis_server.url) as admin:
        assert [(e.model, e.key) for e in admin.entries()] == [(fp12, key)]


def test_the_admin_view_of_an_unreachable_server_is_an_error_without_the_password(tmp_path):
    server = RedisServer(tmp_path, password="s3cret")  # never started: nothing listens on its port
    with pytest.raises(CoreKVError, match=f"redis at redis://127.0.0.1:{server.port}/0 cannot be reached") as caught:
        RedisAdmin(url=server.url)
    assert "s3cret" not in str(caught.value)


def test_ttl_is_set_on_every_block(redis_server):  # noqa: F811
    keys = make_keys(3)
    with open_tier(redis_server, ttl=100) as tier:
        tier.put([(k, block_payload(k, 4096)) for k in keys])
        raw = redis.Redis.from_url(redis_server.url)
        ttls = [raw.ttl(f"corekv:{tier.fp12}:{k.hex()}") for k in keys]
        assert all(0 < t <= 100 for t in ttls), ttls


def test_hits_refresh_the_ttl_and_misses_do_not_create_keys(redis_server):  # noqa: F811
    keys = make_keys(2)
    with open_tier(redis_server, ttl=100) as tier:
        tier.put([(keys[0], block_payload(keys[0], 4096))])
        raw = redis.Redis.from_url(redis_server.url)
        raw.expire(f"corekv:{tier.fp12}:{keys[0].hex()}", 5)
        assert [p is not None for p in tier.get(keys)] == [True, False]
        assert 95 < raw.ttl(f"corekv:{tier.fp12}:{keys[0].hex()}") <= 100, "the hit did not refresh it"
        assert raw.exists(f"corekv:{tier.fp12}:{keys[1].hex()}") == 0
        raw.close()


def test_a_full_noeviction_server_skips_writes_warns_once_and_keeps_serving_reads(tmp_path, caplog):
    server = RedisServer(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    try:
        keys = make_keys(200)
        with RedisTier(url=server.url, block_bytes=64 * 1024, fingerprint=FINGERPRINT) as tier:
            with caplog.at_level(logging.WARNING, logger="corekv"):
                stored = [tier.put_one(k, block_payload(k, 64 * 1024)) for k in keys]
            assert True in stored and False in stored, "the server never filled up"
            full = [r for r in caplog.records if "is full" in r.message]
            assert len(full) == 1 and "maxmemory-policy allkeys-lru" in full[0].message
            first_kept = keys[stored.index(True)]
            assert bytes(tier.get_one(first_kept)) == block_payload(first_kept, 64 * 1024)
            assert tier.exists([first_kept]) == 1, "a full server must keep serving reads"
    finally:
        server.stop()


def test_a_server_under_an_lfu_policy_has_no_ages_to_prune_and_says_so(tmp_path):
    from corekv.store import StoreView, prune

    server = RedisServer(tmp_path, "--maxmemory-policy", "allkeys-lfu").start()
    try:
        keys = make_keys(2)
        with RedisTier(url=server.url, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
            tier.put([(k, block_payload(k, 4096)) for k in keys])
        with RedisAdmin(url=server.url) as admin:
            with pytest.raises(CoreKVError, match=r"tier 'redis': .*LFU.*so its entries have no age"):
                prune(StoreView("redis", "redis", admin), older_than_s=60)
            assert len(list(admin.entries())) == 2  # nothing deleted
    finally:
        server.stop()


def test_a_stalled_server_costs_one_deadline_then_its_cool_down_skips_it(stalled_endpoint):  # noqa: F811
    url = f"redis://127.0.0.1:{stalled_endpoint.port}/0"
    keys = make_keys(4)
    started = time.monotonic()
    with RedisTier(url=url, socket_timeout=0.3, retry_interval=3600, block_bytes=4096,
                   fingerprint=FINGERPRINT) as tier:
        assert time.monotonic() - started < 1.0, "opening waited on the stalled server"
        started = time.monotonic()
        for _ in range(10):
            assert tier.get(keys) == [None] * 4 and tier.exists(keys) == 0
            assert tier.put([(k, block_payload(k, 4096)) for k in keys]) == 0
        assert time.monotonic() - started < 0.5
        assert tier.stats()["errors"] == 1
    assert stalled_endpoint.num_connections >= 1, "the test never reached the stalled endpoint"
    started = time.monotonic()
    with pytest.raises(CoreKVError, match="cannot be reached.*TimeoutError"):
        RedisAdmin(url=url, socket_timeout=0.3)
    assert time.monotonic() - started < 1.0


def test_socket_timeout_must_be_a_deadline():
    with pytest.raises(ValueError, match="socket_timeout must be > 0 seconds"):
        RedisTier(url="redis://127.0.0.1:1/0", socket_timeout=0, block_bytes=4096, fingerprint=FINGERPRINT)


def test_a_killed_server_gives_misses_and_the_tier_reconnects_on_restart(redis_server):  # noqa: F811
    keys = make_keys(8)
    with open_tier(redis_server, retry_interval=0.1, socket_timeout=0.5) as tier:
        assert tier.put([(k, block_payload(k, 4096)) for k in keys]) == 8
        failures, rounds, stop = [], [0], threading.Event()

        def traffic():  # an engine's offload/reload loop running while the server dies
            try:
                while not stop.is_set():
                    tier.get(keys)
                    tier.put([(keys[0], block_payload(keys[0], 4096))])
                    tier.exists(keys)
                    rounds[0] += 1
            except Exception as e:  # pragma: no cover - reported below
                failures.append(e)

        thread = threading.Thread(target=traffic)
        thread.start()
        while rounds[0] < 5 and thread.is_alive():
            time.sleep(0.01)
        redis_server.kill()
        killed_at = rounds[0]
        while rounds[0] < killed_at + 20 and thread.is_alive():
            time.sleep(0.01)
        stop.set()
        thread.join()
        assert failures == []
        assert tier.get(keys) == [None] * 8
        assert tier.put([(keys[0], block_payload(keys[0], 4096))]) == 0
        assert tier.exists(keys) == 0
        stats = tier.stats()
        assert stats["errors"] >= 1 and stats["skips"] >= 1 and stats["misses"] >= 8

        redis_server.start()  # same port, empty (no persistence)
        for _ in range(100):  # bounded wait for the cool-down to pass
            if tier.put([(keys[0], block_payload(keys[0], 4096))]) == 1:
                break
            time.sleep(0.05)
        assert bytes(tier.get_one(keys[0])) == block_payload(keys[0], 4096)


def test_a_down_server_is_not_retried_during_the_cool_down(redis_server):  # noqa: F811
    with open_tier(redis_server, retry_interval=3600) as tier:
        redis_server.kill()
        key = make_keys(1)[0]
        tier.get_one(key)
        errors = tier.stats()["errors"]
        assert errors == 1
        for _ in range(20):
            assert tier.get_one(key) is None
            assert not tier.put_one(key, block_payload(key, 4096))
        assert tier.stats()["errors"] == errors, "each call went to the network again"


def test_a_tier_built_while_the_server_is_down_starts_and_counts(tmp_path):
    server = RedisServer(tmp_path)  # never started: nothing listens on its port
    with open_tier(server, retry_interval=3600) as tier:
        key = make_keys(1)[0]
        assert tier.get_one(key) is None and not tier.put_one(key, block_payload(key, 4096))
        assert tier.stats()["errors"] == 1


def test_password_in_the_url(tmp_path):
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        key = make_keys(1)[0]
        with open_tier(server) as tier:
            assert tier.put_one(key, block_payload(key, 4096))
            assert bytes(tier.get_one(key)) == block_payload(key, 4096)
        with pytest.raises(ValueError, match="refused the credentials"):
            RedisTier(url=server.url.replace("s3cret", "wrong"), block_bytes=4096, fingerprint=FINGERPRINT)
    finally:
        server.stop()


def make_certificates(folder):
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=corekv-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.ext", "-out", "server.crt")


def test_tls_with_rediss_url(tmp_path):
    make_certificates(tmp_path)
    server = RedisServer(tmp_path, "--tls-cert-file", str(tmp_path / "server.crt"),
                         "--tls-key-file", str(tmp_path / "server.key"),
                         "--tls-ca-cert-file", str(tmp_path / "ca.crt"), "--tls-auth-clients", "no",
                         tls_port=True).start()
    try:
        key = make_keys(1)[0]
        url = f"{server.url}?ssl_ca_certs={tmp_path / 'ca.crt'}"
        with RedisTier(url=url, block_bytes=4096, fingerprint=FINGERPRINT) as tier:
            assert tier.put_one(key, block_payload(key, 4096))
            assert bytes(tier.get_one(key)) == block_payload(key, 4096)
            assert tier.stats()["errors"] == 0
    finally:
        server.stop()


def test_registered_as_a_plugin_without_importing_redis_at_load(redis_server):  # noqa: F811
    code = ("import sys, corekv; m = corekv.make_plugin_manager(); assert 'redis' in m.tiers(); "
            "print('redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    spec = make_plugin_manager().tiers()["redis"]
    with make_tier(spec, {"url": redis_server.url, "ttl": 5}, block_bytes=4096,
                   fingerprint=FINGERPRINT) as tier:
        assert isinstance(tier, RedisTier) and tier.ttl == 5 and tier.supports_ttl
    assert spec.admin is RedisAdmin


def test_bad_url_names_the_expected_form():
    with pytest.raises(ValueError, match="is not a Redis URL"):
        RedisTier(url="http://127.0.0.1", block_bytes=4096, fingerprint=FINGERPRINT)
