"""The offload planner (write policy, offload_min_hits, writes in flight) and the completion
reports its in-flight rule relies on: every block handed to the writer is reported exactly once,
stored, skipped or failed, with real tiers (host, LMDB) and a real KV pool."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from corekv.backend import EvictedBlock
from corekv.offload import Offload
from corekv.admission import AdmissionPolicy, AdmitAll, MinHits
from corekv.plugin import AdmissionPolicySpec, hookimpl, make_plugin_manager
from corekv.offload.planner import OffloadPlanner
from corekv.tiers.host import HostTier
from corekv.tiers.lmdb import LMDBTier
from test_offload import make_key, make_pool, tier_kwargs


class Reports:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: list[tuple[bytes, str]] = []

    def __call__(self, hashes, outcome):
        with self.lock:
            self.outcomes += [(h, outcome) for h in hashes]

    def of(self, hashes):
        return [o for h in hashes for k, o in self.outcomes if k == h]


def test_every_offloaded_block_is_reported_once_as_stored():
    pool = make_pool()
    reports = Reports()
    offload = Offload([HostTier(size=16 * 4096, **tier_kwargs(pool))], pool, on_done=reports)
    key = make_key(3)
    offload.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2])])
    offload.flush()
    assert reports.of(key.block_hashes) == ["stored"] * 3
    offload.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2])])  # held already
    offload.flush()
    assert reports.of(key.block_hashes) == ["stored", "stored"] * 3
    offload.close()


def test_a_full_queue_reports_skipped_and_a_tier_that_takes_nothing_reports_failed():
    """The tier's write primitive is held, then made to store nothing (as a full store skips):
    a stand-in for a store that refuses writes, which a real host tier never does."""
    pool = make_pool(16)
    reports = Reports()
    host = HostTier(size=16 * 4096, **tier_kwargs(pool))
    offload = Offload([host], pool, queue_blocks=2, on_done=reports)
    first, second = make_key(8, salt="a"), make_key(2, salt="b")
    gate = threading.Event()
    host._write_entries = lambda items: (gate.wait(30), 0)[1]
    offload.evicted([EvictedBlock(h, b) for h, b in zip(first.block_hashes, range(8))])
    offload.evicted([EvictedBlock(h, b) for h, b in zip(second.block_hashes, [8, 9])])  # queue full
    assert reports.of(second.block_hashes) == ["skipped", "skipped"]
    assert reports.of(first.block_hashes) == []  # still in flight
    gate.set()
    offload.flush()
    assert reports.of(first.block_hashes) == ["failed"] * 8
    offload.close()


def test_load_blocks_takes_hashes_and_discard_removes_them_from_every_tier(tmp_path):
    pool = make_pool()
    host = HostTier(size=16 * 4096, **tier_kwargs(pool))
    lmdb = LMDBTier(path=str(tmp_path / "kv"), size=1 << 20, **tier_kwargs(pool))
    offload = Offload([host, lmdb], pool)
    key = make_key(3)
    original = pool.read_blocks([0, 1, 2]).clone()
    offload.flush(list(zip(key.block_hashes, [0, 1, 2])))
    assert offload.load_blocks(key.block_hashes[1:], [6, 7]) == {"host": 2}
    assert torch.equal(pool.read_blocks([6, 7]), original[1:])
    offload.discard(key.block_hashes[1:])
    assert host.contains_many(key.block_hashes) == [True, False, False]
    assert lmdb.contains_many(key.block_hashes) == [True, False, False]
    assert offload.load_blocks(key.block_hashes[1:], [6, 7]) == {}
    offload.close()


def test_the_planner_admits_blocks_after_n_device_hits_and_forgets_evicted_ones():
    planner = OffloadPlanner(offload_min_hits=2, max_tracked=4)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert planner.count_hits([a, b]) == []
    assert planner.count_hits([a, c]) == [0]  # a reached 2 with this hit
    assert planner.qualifying([a, b, c]) == [0]
    planner.forget([a])
    assert planner.qualifying([a, b, c]) == []
    assert OffloadPlanner().qualifying([a, b]) == [0, 1] and OffloadPlanner().count_hits([a]) == []


class EveryOtherBlock(AdmissionPolicy):
    """A third-party rule: only even positions of a chain go to the tiers."""

    name = "every_other"

    def admitted(self, hashes):
        return list(range(0, len(hashes), 2))


def test_the_admission_seam_builds_the_builtin_rule_and_takes_any_policy():
    assert isinstance(OffloadPlanner().admission, AdmitAll)
    builtin = OffloadPlanner(offload_min_hits=3).admission
    assert isinstance(builtin, MinHits) and builtin.min_hits == 3
    planner = OffloadPlanner(offload_min_hits=3, admission=EveryOtherBlock())
    hashes = [bytes([i]) * 16 for i in range(5)]
    assert planner.count_hits(hashes) == [] and planner.hit_counts == {}
    assert planner.qualifying(hashes) == [0, 2, 4]
    planner.forget(hashes)
    planner.reset()


def test_an_admission_policy_decides_what_the_offload_facade_writes():
    pool = make_pool()
    host = HostTier(size=8 * 4096, **tier_kwargs(pool))
    manager = Offload([host], pool, admission=EveryOtherBlock())
    key = make_key(4)
    manager.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2, 3])])
    manager.flush()
    assert [host.contains(h) for h in key.block_hashes] == [True, False, True, False]
    manager.close()


class EveryOtherPlugin:
    @hookimpl
    def corekv_register_admission_policies(self):
        return [AdmissionPolicySpec(name="every_other", factory=lambda offload_min_hits, max_tracked: EveryOtherBlock())]


def test_corekv_register_admission_policies_names_the_rule_the_config_chooses():
    import corekv
    from corekv.offload import make_offload

    builtin = make_plugin_manager(autoload=False)
    assert corekv.load_config({}, env={}, plugin_manager=builtin).cache.admission == "min_hits"
    with pytest.raises(corekv.ConfigError, match=r"^cache\.admission: got 'every_other'; expected a "
                       r"registered admission policy \(min_hits\)"):
        corekv.load_config({"cache": {"admission": "every_other"}}, env={}, plugin_manager=builtin)
    manager = make_plugin_manager([EveryOtherPlugin()], autoload=False)
    cfg = corekv.load_config({"cache": {"admission": "every_other", "offload_min_hits": 5,
                                        "tiers": [{"type": "host", "size": "1MiB"}]}},
                             env={}, plugin_manager=manager)
    pool = make_pool()
    offload, _ = make_offload(cfg.cache, manager, fingerprint="ab" * 16, dtype="float32", kv_pool=pool,
                              backend=None)
    try:
        assert isinstance(offload.planner.admission, EveryOtherBlock)
        key = make_key(4)
        offload.evicted([EvictedBlock(h, b) for h, b in zip(key.block_hashes, [0, 1, 2, 3])])
        offload.flush()
        assert [offload.tiers[0].contains(h) for h in key.block_hashes] == [True, False, True, False]
    finally:
        offload.close()
    default, _ = make_offload(corekv.load_config({"cache": {"offload_min_hits": 2, "tiers": [
        {"type": "host", "size": "1MiB"}]}}, env={}, plugin_manager=builtin).cache, builtin,
        fingerprint="ab" * 16, dtype="float32", kv_pool=make_pool(), backend=None)
    try:
        assert isinstance(default.planner.admission, MinHits) and default.planner.admission.min_hits == 2
    finally:
        default.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"write_policy": "later"}, "write_policy must be"),
    ({"offload_min_hits": -1}, "offload_min_hits must be an int >= 0"),
    ({"offload_min_hits": True}, "offload_min_hits must be an int >= 0"),
])
def test_the_planner_checks_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadPlanner(**kwargs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["count", "queue", "done", "forget"]),
                          st.lists(st.integers(0, 9), max_size=5)), max_size=40))
def test_the_planners_bounds_and_in_flight_rule_hold_under_any_sequence(ops):
    planner = OffloadPlanner(offload_min_hits=2, max_tracked=5)
    in_flight: list[bytes] = []  # the model: the most recently queued, unreported, at most 5
    for op, ids in ops:
        hashes = [bytes([i]) * 16 for i in ids]
        if op == "count":
            planner.count_hits(hashes)
        elif op == "queue":
            planner.queued(hashes)
            for h in hashes:
                if h in in_flight:
                    in_flight.remove(h)
                in_flight.append(h)
            in_flight = in_flight[-5:]
        elif op == "done":
            planner.completed(hashes)
            in_flight = [h for h in in_flight if h not in hashes]
        else:
            planner.forget(hashes)
        assert len(planner.hit_counts) <= 5 and len(planner.in_flight) <= 5
        assert all(planner.is_in_flight(bytes([i]) * 16) == (bytes([i]) * 16 in in_flight) for i in range(10))


def test_an_unregistered_admission_policy_names_what_is_registered():
    from corekv.admission import build_admission

    with pytest.raises(ValueError, match=r"cache.admission 'nope' is not a registered admission policy \(min_hits\)"):
        build_admission("nope", make_plugin_manager(autoload=False), offload_min_hits=0, max_tracked=8)
