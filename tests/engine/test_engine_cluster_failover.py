"""The fleet's failover property, small (benchmarks/fleet.py runs it at size): one engine computes
prefixes into a shared Redis Cluster, a primary is killed, another engine serves the same prompts
through the outage and the failover: no request fails, no output differs from an uncached
engine's, and once the replica has taken over every prefix hits in full again, the keys the dead
primary held included (the replica had them)."""
from __future__ import annotations

from corekv.config import TierConfig
from redis_cluster import disposable_redis_cluster  # noqa: F401 (fixture)
from tier_helpers import BLOCK, GREEDY, evict, make_engine

#: five prompts of 4 full blocks each (byte tokens): 20 keys, spread over the three primaries
PROMPTS = [f"prompt {i}: a shared document about KV caches, tiers and clusters; its question {i}"[:4 * BLOCK + 3]
           for i in range(5)]
#: generous: the node timeout is 1.5 s and a round of five tiny-model requests takes milliseconds
MAX_ROUNDS = 400


def test_a_killed_primary_fails_no_request_changes_no_output_and_hits_resume(tiny_llama, disposable_redis_cluster):  # noqa: F811
    cluster = disposable_redis_cluster
    tier = TierConfig(type="redis", name="cluster", options={
        "url": cluster.url, "cluster": True, "socket_timeout": 0.5, "retry_interval": 0.2})
    with make_engine(tiny_llama, num_blocks=64) as uncached:
        reference = [uncached.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    with make_engine(tiny_llama, [tier], write_policy="write_through") as first:  # machine 1
        assert [first.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == reference
    for port in cluster.primary_ports():  # every write reached the replicas before the crash
        with cluster.client(port) as client:
            assert client.execute_command("WAIT", 1, 5000) == 1
    outputs, full_hit_rounds = [], 0
    with make_engine(tiny_llama, [tier]) as second:  # machine 2: an empty device pool, open already
        # NOTE: not the node the url names (a machine that opens the tier after the crash finds
        # the cluster through that one node, so the url should name a node that stays). The kill
        # comes after the engine opened, so its first request (milliseconds) meets the dead node
        # well inside the node timeout (1.5 s) the replica waits before it takes over.
        victim = next(p for p in cluster.primary_ports() if p != cluster.ports[0])
        cluster.kill(victim)
        for _ in range(MAX_ROUNDS):
            round_outputs = [second.generate(p, GREEDY)[0] for p in PROMPTS]
            outputs += round_outputs
            evict(second)  # the next round must come from the cluster again, not the device
            if all(o.cached_tokens_by_tier.get("cluster") == 4 * BLOCK for o in round_outputs):
                full_hit_rounds += 1
                if full_hit_rounds == 2:
                    break
        stats = second.stats()["tiers"]["cluster"]
    assert victim not in cluster.primary_ports(), "the cluster never replaced the killed primary"
    assert all(o.error is None for o in outputs)
    assert [o.token_ids for o in outputs] == reference * (len(outputs) // len(PROMPTS))
    assert full_hit_rounds == 2, "hits did not resume after the failover"
    assert stats["faults"] == 0
    assert stats["errors"] >= 1, "no request met the dead primary: the test saw no outage"
