"""The reload-or-recompute cost model: measurements injected by hand, so every decision is exact."""
from __future__ import annotations

import pytest

from corekv.offload.cost import ReloadCost
from corekv.offload.prefetch import TierRun

BLOCK = 16
#: recomputing a block costs 16 ms (1 ms a token)
PREFILL_S_PER_TOKEN = 1e-3


def measured(policy="cost", *, host_s=1e-4, lmdb_s=None, remote_s=None, **kwargs) -> ReloadCost:
    """A model over tiers host, lmdb, remote that saw 4 samples of each cost given (s per block)."""
    cost = ReloadCost(["host", "lmdb", "remote"], BLOCK, policy=policy, min_samples=4, **kwargs)
    for _ in range(4):
        cost.observe_step(64, 64 * PREFILL_S_PER_TOKEN)
        for index, seconds in enumerate((host_s, lmdb_s, remote_s)):
            if seconds is not None:
                cost.observe_load(index, 2, 2 * seconds)
    return cost


def test_unmeasured_tiers_and_an_unmeasured_engine_load_everything():
    cost = ReloadCost(["host", "remote"], BLOCK, policy="cost", min_samples=4)
    runs = [TierRun(0, 3), TierRun(1, 5)]
    assert cost.num_blocks_to_load(runs) == 8  # nothing measured: the prior is "reload"
    for _ in range(3):
        cost.observe_step(64, 1.0)
        cost.observe_load(1, 1, 100.0)
    assert cost.num_blocks_to_load(runs) == 8  # 3 samples are not enough yet
    assert cost.stats()["load_s_per_block"] == {"host": None, "remote": None}


def test_a_run_slower_than_recompute_is_cut_with_everything_after_it():
    cost = measured(host_s=1e-4, remote_s=0.05)  # remote: 50 ms a block against 16 ms recompute
    assert cost.num_blocks_to_load([TierRun(0, 3), TierRun(2, 4)]) == 3
    assert cost.num_blocks_to_load([TierRun(2, 4), TierRun(0, 1)]) == 0
    stats = cost.stats()
    assert stats["skipped_blocks"] == 4 + 5
    assert stats["load_s_per_block"]["remote"] == pytest.approx(0.05)
    assert stats["prefill_s_per_token"] == pytest.approx(PREFILL_S_PER_TOKEN)


def test_a_slow_run_is_loaded_when_a_fast_run_behind_it_wins_the_time_back():
    cost = measured(host_s=0.0, remote_s=0.020)  # remote loses 4 ms a block, host saves 16 ms
    assert cost.num_blocks_to_load([TierRun(2, 2), TierRun(0, 1)]) == 3   # -8 ms + 16 ms > 0
    assert cost.num_blocks_to_load([TierRun(2, 5), TierRun(0, 1)]) == 0   # -20 ms + 16 ms < 0


def test_a_tier_faster_than_recompute_loads_and_always_loads_whatever_it_costs():
    assert measured(lmdb_s=0.010).num_blocks_to_load([TierRun(1, 6)]) == 6
    always = measured("always", remote_s=10.0)
    assert always.num_blocks_to_load([TierRun(2, 6)]) == 6
    assert always.stats()["skipped_blocks"] == 0


def test_blocks_in_memory_load_free_and_never_count_as_a_tier_skip():
    """A negative tier index (the vLLM connector's writes in flight) is neither a tier's estimate
    nor a tier's skip: it loads, and a slow run after it is still cut."""
    cost = measured(remote_s=0.05, probe_every=2)
    assert cost.num_blocks_to_load([TierRun(-1, 3), TierRun(2, 2)]) == 3
    assert cost._num_skips == [0, 0, 1]  # remote skipped once; the in-memory run is no tier's
    assert cost.num_blocks_to_load([TierRun(2, 2), TierRun(-1, 4)]) == 0  # 4 x 16 ms < 2 x 34 ms lost
    assert cost.num_blocks_to_load([TierRun(2, 2), TierRun(-1, 5)]) == 7  # 5 x 16 ms win them back
    assert cost._num_skips == [0, 0, 0]


def test_estimates_follow_recent_samples():
    cost = measured(remote_s=0.05, weight=0.5)
    assert cost.num_blocks_to_load([TierRun(2, 1)]) == 0
    for _ in range(6):  # the tier recovered
        cost.observe_load(2, 4, 4 * 1e-3)
    assert cost.num_blocks_to_load([TierRun(2, 1)]) == 1


def test_a_skipped_tier_is_probed_again_after_probe_every_skips():
    cost = measured(remote_s=0.05, probe_every=3)
    decisions = [cost.num_blocks_to_load([TierRun(2, 2)]) for _ in range(8)]
    assert decisions == [0, 0, 0, 2, 0, 0, 0, 2]
    assert cost.stats()["probes"] == 2


def test_a_prefetch_look_is_not_counted_and_never_probes():
    cost = measured(remote_s=0.05, probe_every=1)
    cost.num_blocks_to_load([TierRun(2, 2)])
    assert [cost.num_blocks_to_load([TierRun(2, 2)], count=False) for _ in range(3)] == [0, 0, 0]
    assert cost.stats()["skipped_blocks"] == 2


def test_short_steps_are_not_prefill_samples():
    cost = ReloadCost(["host"], BLOCK, policy="cost", min_samples=1)
    cost.observe_step(BLOCK - 1, 1.0)
    assert cost.stats()["prefill_s_per_token"] is None


def test_max_load_tokens_caps_whole_blocks_from_the_start():
    assert ReloadCost(["host"], BLOCK, max_load_tokens=40).limit(3, 100) == 5  # 40 tokens: 2 blocks
    assert ReloadCost(["host"], BLOCK, max_load_tokens=0).limit(3, 100) == 3
    assert ReloadCost(["host"], BLOCK).limit(3, 100) == 100


@pytest.mark.parametrize("kwargs, word", [({"policy": "cheapest"}, "policy"),
                                          ({"max_load_tokens": -1}, "max_load_tokens"),
                                          ({"max_load_tokens": True}, "max_load_tokens"),
                                          ({"min_samples": 0}, "min_samples")])
def test_bad_arguments_are_refused_by_name(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ReloadCost(["host"], BLOCK, **kwargs)


@pytest.mark.parametrize("cache, message", [
    ({"reload_policy": "cheap"}, "cache.reload_policy: got 'cheap'; expected one of always, cost"),
    ({"max_load_tokens": -3}, "cache.max_load_tokens: got -3; expected an integer >= 0"),
    ({"max_load_token": 3}, "did you mean 'max_load_tokens'"),
])
def test_the_config_fields_are_checked_by_name(cache, message):
    import corekv

    with pytest.raises(corekv.ConfigError) as e:
        corekv.load_config({"cache": cache})
    assert message in str(e.value)


def test_the_default_loads_every_hit_without_a_cap():
    import corekv

    cache = corekv.load_config({}).cache
    assert (cache.reload_policy, cache.max_load_tokens) == ("always", None)


# -- the seed (a tier measured when it opens) and why blocks were skipped --------------------------
def seeded(*, latency_s: float, s_per_block: float) -> ReloadCost:
    """host unseeded, remote seeded; prefill measured at PREFILL_S_PER_TOKEN (16 ms a block)."""
    cost = ReloadCost(["host", "remote"], BLOCK, policy="cost", min_samples=4)
    for _ in range(4):
        cost.observe_step(64, 64 * PREFILL_S_PER_TOKEN)
    cost.seed(1, latency_s=latency_s, s_per_block=s_per_block)
    return cost


def test_a_seed_decides_at_once_and_its_latency_is_paid_once_per_run():
    cost = seeded(latency_s=0.100, s_per_block=0.001)  # 100 ms a call, then 1 ms a block
    assert cost.num_blocks_to_load([TierRun(1, 6)]) == 0    # 6 x 15 ms saved < 100 ms
    assert cost.num_blocks_to_load([TierRun(1, 7)]) == 7    # 7 x 15 ms saved > 100 ms
    stats = cost.stats()
    assert stats["seeded"] == ["remote"] and stats["load_latency_s"] == {"host": 0.0, "remote": 0.1}
    assert stats["load_s_per_block"] == {"host": None, "remote": pytest.approx(0.001)}


def test_real_loads_take_over_from_the_seed_less_its_latency():
    cost = seeded(latency_s=0.010, s_per_block=0.0)
    for _ in range(30):  # the tier turns out slower: 10 ms a call, then 30 ms a block
        cost.observe_load(1, 4, 0.010 + 4 * 0.030)
    assert cost.stats()["load_s_per_block"]["remote"] == pytest.approx(0.030, rel=0.01)
    assert cost.num_blocks_to_load([TierRun(1, 50)]) == 0


def test_skipped_blocks_are_counted_by_tier_and_by_reason():
    cost = seeded(latency_s=0.0, s_per_block=0.050)
    for _ in range(4):
        cost.observe_load(0, 1, 1e-4)
    assert cost.num_blocks_to_load([TierRun(0, 2), TierRun(1, 3), TierRun(0, 1)]) == 2
    stats = cost.stats()
    assert stats["skipped_blocks"] == 4
    assert stats["skipped_blocks_by_tier"] == {"host": 1, "remote": 3}
    assert stats["skipped_by_reason"] == {"slower_than_recompute": 3, "after_a_skipped_run": 1}


def test_the_prefill_rate_is_a_steps_marginal_cost_not_its_fixed_one():
    """Steps cost 100 ms plus 0.1 ms a token: a 1K-token prefix costs 0.1 s to recompute, not
    the 6 ms a token that 16-token steps take on average."""
    cost = ReloadCost(["remote"], BLOCK, policy="cost", min_samples=4)
    for num_tokens in (16, 1040, 16, 16, 1040, 16):
        cost.observe_step(num_tokens, 0.100 + num_tokens * 1e-4)
    assert cost.stats()["prefill_s_per_token"] == pytest.approx(1e-4)
    for _ in range(4):
        cost.observe_load(0, 64, 64 * 0.005)  # 5 ms a block against 1.6 ms to recompute one
    assert cost.num_blocks_to_load([TierRun(0, 64)]) == 0


def test_a_tier_that_cannot_beat_recompute_even_on_a_full_hit_is_not_asked():
    """worth_asking: a lookup is a round trip; a tier whose n hits would not save its latency
    is left out (counted, and towards its probe); unmeasured tiers and ``always`` are asked."""
    cost = measured(host_s=1e-4, remote_s=0.05, probe_every=2)
    assert cost.worth_asking(0, 1) and cost.worth_asking(1, 8)  # host: fast; lmdb: unmeasured
    assert not cost.worth_asking(2, 8)  # remote: 50 ms a block against 16 ms recompute
    assert not cost.worth_asking(2, 8, count=False)  # a prefetch's look: not counted
    assert cost.stats()["skipped_lookups"] == 1
    assert not cost.worth_asking(2, 8)
    assert cost.worth_asking(2, 8)  # probe_every skips: asked again, so its estimate can follow
    seeded = ReloadCost(["host", "s3"], BLOCK, policy="cost", min_samples=4)
    for _ in range(4):
        seeded.observe_step(64, 64 * PREFILL_S_PER_TOKEN)
        seeded.observe_step(128, 128 * PREFILL_S_PER_TOKEN)
    seeded.seed(1, latency_s=0.1, s_per_block=1e-3)  # 15 ms saved a block, 100 ms a call
    assert not seeded.worth_asking(1, 6) and seeded.worth_asking(1, 7)
    assert measured("always", remote_s=10.0).worth_asking(2, 1)
