"""Eviction policies (corekv.eviction): the queues' orders, the registration hook, the config field.

The policies' effect on the backends and tiers is tested by the conformance suites, which every
policy runs (``eviction = "lfu"`` subclasses in tests/test_backend_*.py and tests/test_tier_*.py),
and by the property tests in tests/test_backend_properties.py.
"""
from __future__ import annotations

import pytest

import corekv
from corekv.eviction import LFU, LRU, EntryStats, EvictionPolicy, HeapQueue, Priority, make_policy
from corekv.plugin import EvictionPolicySpec, hookimpl, make_plugin_manager


def drain(queue) -> list:
    return queue.pop_many(len(queue))


@pytest.mark.parametrize("policy", [LRU(), LFU(), Priority()], ids=["lru", "lfu", "priority"])
def test_without_hits_or_priorities_every_builtin_pops_in_release_order(policy):
    queue = policy.make_queue()
    queue.store_many("abc")
    for item in "bca":
        queue.add(item)
    assert len(queue) == 3 and "a" in queue
    assert drain(queue) == ["b", "c", "a"] and len(queue) == 0


@pytest.mark.parametrize("policy", [LRU(), LFU(), Priority()], ids=["lru", "lfu", "priority"])
def test_taking_a_candidate_out_and_putting_it_back_makes_it_the_most_recent(policy):
    queue = policy.make_queue()
    for item in "abc":
        queue.add(item)
    queue.take("a")
    assert "a" not in queue and len(queue) == 2
    queue.add("a")
    assert drain(queue)[-1] == "a"


@pytest.mark.parametrize("policy", [LRU(), LFU(), Priority()], ids=["lru", "lfu", "priority"])
def test_unpop_restores_what_the_last_pop_took(policy):
    queue = policy.make_queue()
    for item in "abcd":
        queue.add(item)
    popped = queue.pop_many(2)
    queue.unpop_many(popped)
    assert drain(queue) == list("abcd")


def test_lfu_pops_the_least_hit_first_and_lru_among_equals():
    queue = LFU().make_queue()
    for item in "abcd":
        queue.add(item)
    for _ in range(3):
        queue.touch("a")
    queue.touch("b")
    assert drain(queue) == ["c", "d", "b", "a"]


def test_lru_touch_moves_a_candidate_to_the_end_and_ignores_others():
    queue = LRU().make_queue()
    for item in "abc":
        queue.add(item)
    queue.touch("a")
    queue.touch("not-there")
    assert drain(queue) == ["b", "c", "a"]


def test_priority_pops_low_first_and_a_higher_store_raises_it():
    queue = Priority().make_queue()
    queue.store_many(["paid"], priority=5)
    queue.store_many(["free-1", "free-2"])
    for item in ("paid", "free-1", "free-2", "shared"):
        queue.add(item)
    queue.store_many(["shared"], priority=2)      # a higher-priority request reuses it
    queue.store_many(["paid"], priority=1)        # a lower one never lowers it
    assert drain(queue) == ["free-1", "free-2", "shared", "paid"]


def test_a_discarded_item_is_forgotten_and_never_popped():
    queue = LFU().make_queue()
    for item in "abc":
        queue.add(item)
    queue.discard("a")
    queue.discard("never-stored")
    assert "a" not in queue and drain(queue) == ["b", "c"]


def test_the_heap_stays_proportional_to_the_candidates_under_many_touches():
    queue = LFU().make_queue()
    for item in range(10):
        queue.add(item)
    for n in range(10_000):
        queue.touch(n % 10)
    assert len(queue._heap) <= 2 * len(queue) + 65
    assert sorted(drain(queue)) == list(range(10))


def test_popping_more_than_the_candidates_raises_and_changes_nothing():
    queue = HeapQueue(LFU())
    queue.add("a")
    with pytest.raises(IndexError):
        queue.pop_many(2)
    assert drain(queue) == ["a"]


def test_the_keys_read_the_four_fields():
    old_hot = EntryStats(last_access=1, num_hits=9, priority=0, created=1)
    new_cold = EntryStats(last_access=5, num_hits=0, priority=3, created=5)
    assert LRU().key(old_hot) < LRU().key(new_cold)
    assert LFU().key(new_cold) < LFU().key(old_hot)
    assert Priority().key(old_hot) < Priority().key(new_cold)


# -- the registration hook and the config field ----------------------------------------------
class NewestFirst(EvictionPolicy):
    name = "newest_first"

    def key(self, entry):
        return -entry.last_access


class NewestFirstPlugin:
    @hookimpl
    def corekv_register_eviction_policies(self):
        return [EvictionPolicySpec(name="newest_first", factory=NewestFirst, description="MRU")]


def test_corekv_register_eviction_policies_registers_the_builtins_and_a_plugins_policy():
    builtins = make_plugin_manager(autoload=False).eviction_policies()
    assert {"lru", "lfu", "priority"} <= set(builtins)
    assert builtins["lru"].plugin == "eviction" and builtins["lru"].distribution == "corekv"
    manager = make_plugin_manager([NewestFirstPlugin()], autoload=False)
    assert isinstance(make_policy("newest_first", manager), NewestFirst)
    assert "newest_first" in corekv.available_plugins([NewestFirstPlugin()])["eviction_policies"]


def test_a_policy_named_in_the_config_reaches_backend_and_tier_as_a_fresh_object():
    from corekv.eviction import resolve_policy_options

    manager = make_plugin_manager([NewestFirstPlugin()], autoload=False)
    cfg = corekv.load_config({"cache": {"backend": "radix", "backend_options": {"eviction": "newest_first"},
                                        "tiers": [{"type": "host", "size": "1MiB", "eviction": "lfu"}]}},
                             env={}, plugin_manager=manager)
    assert cfg.cache.backend_options["eviction"] == "newest_first"   # the config keeps the name
    spec = manager.backends()["radix"]
    first = resolve_policy_options(spec.options, cfg.cache.backend_options, manager)["eviction"]
    second = resolve_policy_options(spec.options, cfg.cache.backend_options, manager)["eviction"]
    assert isinstance(first, NewestFirst) and first is not second
    assert cfg.cache.tiers[0].options["eviction"] == "lfu"


@pytest.mark.parametrize("where, raw", [
    ("cache.backend_options.eviction", {"backend_options": {"eviction": "lfru"}}),
    ("cache.tiers[0].eviction", {"tiers": [{"type": "lmdb", "path": "/tmp/x", "eviction": "fifo"}]}),
])
def test_an_unknown_policy_is_an_error_naming_the_field_and_the_registered_policies(where, raw):
    with pytest.raises(corekv.ConfigError) as e:
        corekv.load_config({"cache": raw}, env={}, plugin_manager=make_plugin_manager(autoload=False))
    assert str(e.value).startswith(f"{where}: got ")
    assert "expected one of lfu, lru, priority" in str(e.value)
    assert e.value.path == where


def test_the_default_is_lru_everywhere():
    cfg = corekv.load_config({"cache": {"tiers": [{"type": "host", "size": "1MiB"}]}}, env={},
                             plugin_manager=make_plugin_manager(autoload=False))
    assert cfg.cache.backend_options["eviction"] == "lru"
    assert cfg.cache.tiers[0].options["eviction"] == "lru"
    assert isinstance(make_policy(None), LRU)


def test_make_policy_rejects_what_is_neither_a_name_nor_a_policy():
    with pytest.raises(TypeError, match="eviction must be a policy name or an EvictionPolicy"):
        make_policy(3)
    with pytest.raises(ValueError, match="'nope' is not a registered eviction policy; expected one of"):
        make_policy("nope", make_plugin_manager(autoload=False))


def test_an_install_without_corekvs_own_policies_says_to_reinstall():
    class NoPolicies:
        def eviction_policies(self):
            return {}

    with pytest.raises(ValueError, match="no eviction policy is registered.*reinstall"):
        make_policy("lru", NoPolicies())
