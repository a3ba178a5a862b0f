"""Engines on "many machines": two engines sharing a Redis Cluster (6 real redis-servers) or an
S3 bucket (moto's server through s3fs): a prefix computed by one is reloaded by the other with
the same tokens; a remote tier whose endpoint accepts connections and never answers costs a
request about its deadline, never a failure or different output."""
from __future__ import annotations

import time

import pytest

from corekv.config import TierConfig
from redis_cluster import redis_cluster  # noqa: F401 (fixture)
from s3_server import s3_bucket, s3_credentials, s3_endpoint  # noqa: F401 (fixtures)
from stalled_endpoint import stalled_endpoint  # noqa: F401 (fixture)
from tier_helpers import BLOCK, GREEDY, PROMPT, make_engine


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with make_engine(tiny_llama, num_blocks=64) as engine:
        return engine.generate(PROMPT, GREEDY)[0].token_ids


def remote_tier(kind, request, **options) -> TierConfig:
    if kind == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return TierConfig(type="redis", name="redis", options={
            "url": cluster.url, "cluster": True, "socket_timeout": 0.5, "retry_interval": 0.5, **options})
    endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
    return TierConfig(type="fsspec", name="s3", options={
        "url": f"{bucket}/kv", "storage_options": {"endpoint_url": endpoint}, **options})


@pytest.mark.parametrize("kind", ["redis-cluster", "s3"])
def test_a_prefix_computed_by_one_engine_is_reloaded_by_another(tiny_llama, reference, kind, request):
    tier = remote_tier(kind, request)
    with make_engine(tiny_llama, [tier], write_policy="write_through") as first:
        assert first.generate(PROMPT, GREEDY)[0].token_ids == reference
    with make_engine(tiny_llama, [tier]) as second:  # another machine: an empty device pool
        output = second.generate(PROMPT, GREEDY)[0]
        stats = second.stats()["tiers"][tier.name]
    assert output.token_ids == reference
    assert output.cached_tokens_by_tier == {"device": 0, tier.name: 4 * BLOCK}
    assert stats["errors"] == 0 and stats["faults"] == 0


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_stalled_remote_tier_costs_a_request_its_deadline_not_the_request(
        tiny_llama, reference, kind, stalled_endpoint, s3_credentials):  # noqa: F811
    endpoint = f"127.0.0.1:{stalled_endpoint.port}"
    if kind == "redis":
        tier = TierConfig(type="redis", name="redis", options={
            "url": f"redis://{endpoint}/0", "socket_timeout": 0.3, "retry_interval": 60})
    else:
        tier = TierConfig(type="fsspec", name="s3", options={
            "url": "s3://bucket/kv", "storage_options": {"endpoint_url": f"http://{endpoint}"},
            "timeout": 0.5, "retry_interval": 60})
    with make_engine(tiny_llama, [tier], write_policy="write_through") as engine:
        started = time.monotonic()
        outputs = [engine.generate(PROMPT, GREEDY)[0] for _ in range(3)]
        elapsed = time.monotonic() - started
        stats = engine.stats()["tiers"][tier.name]
    assert [o.token_ids for o in outputs] == [reference] * 3
    assert stats["errors"] >= 1
    # NOTE: one deadline (<= 0.5 s), then the cool-down skips the endpoint; the tiny model's
    # three requests themselves take well under a second
    assert elapsed < 4.0, f"three requests took {elapsed:.1f} s against a stalled {kind} tier"
