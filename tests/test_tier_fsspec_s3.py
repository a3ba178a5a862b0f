"""The fsspec tier on s3:// against a real S3 API (moto's server on loopback, tests/s3_server.py)
through s3fs: conformance, machines seeing each other's blocks, one request per object with no
HEAD, bounded concurrency, credentials never in the config, clean errors, and a deadline on a
stalled endpoint (tests/stalled_endpoint.py)."""
import json
import logging
import threading
import time

import pytest
import yaml

from corekv.cli.entry import main as corekv_main
from corekv.errors import ConfigError, CoreKVError
from corekv.plugin import make_plugin_manager
from corekv.testing.tier import TierTests, block_payload, make_keys
from corekv.testing.tier_admin import StoreAdminTests
from corekv.tier_factory import make_tier
from corekv.tiers.fsspec import FsspecAdmin, FsspecTier
from s3_server import s3_bucket, s3_credentials, s3_endpoint  # noqa: F401 (fixtures)
from stalled_endpoint import stalled_endpoint  # noqa: F401 (fixture)

FINGERPRINT = TierTests.fingerprint
BLOCK = 4096


def open_tier(url, endpoint, **kwargs) -> FsspecTier:
    return FsspecTier(url=url, storage_options={"endpoint_url": endpoint}, block_bytes=BLOCK,
                      fingerprint=FINGERPRINT, **kwargs)


def items(keys):
    return [(k, block_payload(k, BLOCK)) for k in keys]


class S3Requests:
    """The S3 operations a tier's client sends (botocore's own events), and most in flight."""

    def __init__(self, tier):
        self.names: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        client = tier.fs.s3
        client.meta.events.register("before-call.s3", self._before)
        client.meta.events.register("after-call.s3", self._after)

    def _before(self, model=None, **_):
        with self._lock:
            self.names.append(model.name)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def _after(self, **_):
        with self._lock:
            self.in_flight -= 1


class TestFsspecTierOnS3(TierTests):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_bucket, s3_endpoint):  # noqa: F811
        self.url, self.endpoint = f"{s3_bucket}/kv", s3_endpoint

    def make_tier(self, tmp_path, block_bytes):
        return FsspecTier(url=self.url, storage_options={"endpoint_url": self.endpoint},
                          block_bytes=block_bytes, fingerprint=self.fingerprint)


class TestFsspecAdminOnS3(StoreAdminTests):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_bucket, s3_endpoint):  # noqa: F811
        self.url, self.endpoint = f"{s3_bucket}/kv", s3_endpoint

    def make_tier(self, tmp_path, block_bytes, fingerprint):
        return FsspecTier(url=self.url, storage_options={"endpoint_url": self.endpoint},
                          block_bytes=block_bytes, fingerprint=fingerprint)

    def make_admin(self, tmp_path):
        return FsspecAdmin(url=self.url, storage_options={"endpoint_url": self.endpoint})


def test_a_machine_sees_blocks_another_stored_after_it_opened(s3_bucket, s3_endpoint):  # noqa: F811
    keys = make_keys(32)
    with open_tier(s3_bucket, s3_endpoint, size=1 << 30) as reader, \
            open_tier(s3_bucket, s3_endpoint) as writer:
        assert reader.exists(keys) == 0
        assert writer.put(items(keys)) == 32
        assert reader.exists(keys) == 32, "a cached listing hid the other machine's blocks"
        assert [bytes(p) for p in reader.get(keys)] == [v for _, v in items(keys)]


def test_one_get_per_block_no_head_and_bounded_concurrency(s3_bucket, s3_endpoint):  # noqa: F811
    keys = make_keys(24)
    with open_tier(s3_bucket, s3_endpoint, concurrency=4) as tier:
        tier.put(items(keys[:20]))
        requests = S3Requests(tier)
        assert [p is not None for p in tier.get(keys)] == [True] * 20 + [False] * 4
        assert requests.names == ["GetObject"] * 24
        requests.names.clear()
        assert tier.contains_many(keys) == [True] * 20 + [False] * 4
        assert requests.names == ["GetObject"] * 24, "membership is one ranged GET per block"
        requests.names.clear()
        assert tier.put(items(make_keys(12, salt="more"))) == 12
        assert requests.names == ["PutObject"] * 12
        assert 1 < requests.most_in_flight <= 4
        assert tier.stats()["errors"] == 0


def test_storage_options_reach_s3fs_and_credentials_are_refused():
    spec = make_plugin_manager().tiers()["fsspec"]
    for options, field in (({"secret": "x"}, "storage_options.secret"),
                           ({"key": "AKIA"}, "storage_options.key"),
                           ({"client_kwargs": {"aws_secret_access_key": "x"}},
                            "storage_options.client_kwargs.aws_secret_access_key"),
                           ({"password": "x"}, "storage_options.password")):
        with pytest.raises(ConfigError, match="credentials do not belong in the config") as caught:
            make_tier(spec, {"url": "s3://bucket/kv", "storage_options": options}, block_bytes=BLOCK,
                      fingerprint=FINGERPRINT, where="cache.tiers[0]")
        assert caught.value.path == f"cache.tiers[0].{field}"
        assert "AKIA" not in str(caught.value)
    with make_tier(spec, {"url": "s3://bucket/kv", "storage_options": {"endpoint_url": "http://127.0.0.1:9",
                                                                       "profile": None}},
                   block_bytes=BLOCK, fingerprint=FINGERPRINT) as tier:
        assert tier.fs.endpoint_url == "http://127.0.0.1:9"
        assert tier.fs.dircache.use_listings_cache is False


def test_storage_options_must_be_a_mapping_in_the_config(tmp_path):
    import corekv

    with pytest.raises(ConfigError, match=r"cache\.tiers\[0\]\.storage_options: .*expected a mapping"):
        corekv.load_config({"cache": {"tiers": [{"type": "fsspec", "url": "s3://b/kv",
                                                 "storage_options": "endpoint_url=x"}]}})


def test_missing_credentials_are_one_warning_and_one_clear_store_error(
        s3_bucket, s3_endpoint, monkeypatch, tmp_path, caplog, capsys):  # noqa: F811
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    keys = make_keys(8)
    with open_tier(s3_bucket, s3_endpoint, retry_interval=3600) as tier, \
            caplog.at_level(logging.WARNING, logger="corekv"):
        for _ in range(5):
            assert tier.get(keys) == [None] * 8 and tier.put(items(keys)) == 0
        assert tier.stats()["errors"] == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "NoCredentialsError" in warnings[0].message
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [
        {"type": "fsspec", "url": s3_bucket, "storage_options": {"endpoint_url": s3_endpoint}}]}}))
    assert corekv_main(["store", "stats", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "NoCredentialsError" in err and "AWS_ACCESS_KEY_ID" in err and "Traceback" not in err


def test_corekv_store_on_s3(s3_bucket, s3_endpoint, tmp_path, capsys):  # noqa: F811
    keys = make_keys(10)
    with open_tier(s3_bucket, s3_endpoint) as tier:
        tier.put(items(keys))
        fp12 = tier.fp12
    config = tmp_path / "cache.yaml"
    config.write_text(yaml.safe_dump({"cache": {"tiers": [
        {"type": "fsspec", "url": s3_bucket, "storage_options": {"endpoint_url": s3_endpoint}}]}}))
    assert corekv_main(["store", "verify", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["good"] == 10
    assert corekv_main(["store", "clear", "--config", str(config), "--model", fp12, "--yes"]) == 0
    capsys.readouterr()
    with open_tier(s3_bucket, s3_endpoint) as tier:
        assert tier.num_entries == 0


def test_a_stalled_endpoint_costs_one_deadline_then_its_cool_down_skips_it(
        stalled_endpoint, s3_credentials):  # noqa: F811
    endpoint = f"http://127.0.0.1:{stalled_endpoint.port}"
    keys = make_keys(8)
    with open_tier("s3://bucket/kv", endpoint, timeout=0.5, retry_interval=3600) as tier:
        started = time.monotonic()
        assert tier.get(keys) == [None] * 8
        first = time.monotonic() - started
        assert first < 2.0, f"a stalled endpoint held a batch {first:.1f} s, deadline 0.5 s"
        started = time.monotonic()
        for _ in range(10):
            assert tier.get(keys) == [None] * 8 and tier.exists(keys) == 0
            assert tier.put(items(keys)) == 0
        assert time.monotonic() - started < 0.5, "the cool-down did not skip the stalled endpoint"
        assert tier.stats()["errors"] == 1
    assert stalled_endpoint.num_connections >= 1, "the test never reached the stalled endpoint"
    started = time.monotonic()
    with pytest.raises(CoreKVError, match="list failed .*[Tt]imeout"):
        FsspecAdmin(url="s3://bucket/kv", storage_options={"endpoint_url": endpoint}, timeout=0.5)
    # NOTE: a listing is bounded per request (read timeout, two attempts), not as a whole
    assert time.monotonic() - started < 4.0


def test_the_deadline_is_per_call_so_a_large_batch_on_a_healthy_store_completes(
        s3_bucket, s3_endpoint):  # noqa: F811
    keys = make_keys(160)
    with open_tier(s3_bucket, s3_endpoint, timeout=0.3, concurrency=1) as tier:
        tier.put(items(keys))
        started = time.monotonic()
        payloads = tier.get(keys)
        elapsed = time.monotonic() - started
        assert [bytes(p) for p in payloads] == [v for _, v in items(keys)]
        assert tier.stats()["errors"] == 0
    # NOTE: one call at a time: the batch as a whole outlasts one timeout, each call does not
    assert elapsed > 0.3, f"160 sequential GETs took {elapsed:.2f} s: the test cannot tell the deadlines apart"


def test_a_required_s3_tier_starts_only_when_its_endpoint_answers(
        s3_bucket, s3_endpoint, stalled_endpoint, tmp_path):  # noqa: F811
    """make_tiers with required: true: moto answers (the tier starts), a stalled endpoint does not
    (a ConfigError naming the field)."""
    import corekv
    from corekv.offload import make_tiers

    kwargs = dict(fingerprint="ab" * 16, dtype="uint8", block_bytes=BLOCK, shape=(BLOCK,))
    for endpoint, answers in ((s3_endpoint, True), (f"http://127.0.0.1:{stalled_endpoint.port}", False)):
        cfg = corekv.load_config({"cache": {"tiers": [{"type": "fsspec", "url": f"{s3_bucket}/kv", "required": True,
                                                        "timeout": 0.5, "storage_options": {"endpoint_url": endpoint}}]}},
                                 env={})
        if answers:
            tiers, _ = make_tiers(cfg.cache, make_plugin_manager(), **kwargs)
            assert [t.is_reachable() for t in tiers] == [True]
            for tier in tiers:
                tier.close()
        else:
            with pytest.raises(ConfigError, match=r"required: true, and its store did not answer") as caught:
                make_tiers(cfg.cache, make_plugin_manager(), **kwargs)
            assert caught.value.path == "cache.tiers[0].required"
