"""Property tests: both backends against a brute-force model of what a prefix cache may answer.

Random streams of requests (shared prefixes over a 4-token alphabet, three salts), finishes, pins
and unpins run on pools of random size. After every step:

* every hit block really holds the hit prefix (a model of device memory records what each block
  was last computed with: a wrong or stale hit, or a block handed to two owners, shows up here);
* while nothing was evicted, hit lengths equal the brute-force longest cached prefix; after
  evictions they never exceed it;
* every block's reference count equals the number of running requests and pins holding it
  (so it is never negative and never owned twice); pinned runs stay cached;
* the radix tree's structure holds: every live node hangs below a live parent (only leaves were
  ever evicted), ``lock_ref`` is the sum of ``ref`` over the subtree, and the evictable leaves are
  exactly the unlocked ones;
* every evicted block carries the priority of a request that cached or hit it since it was last
  evicted (the tiers keep it), never more than the highest of them.

Every eviction policy runs the same streams (requests carry random priorities), so no policy's
order can break these invariants.
"""
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corekv.backend import PinLimitError
from corekv.plugins.hash_blocks import HashBlockBackend
from corekv.eviction import LFU, LRU, EvictionPolicy, Priority
from corekv.plugins._radix_tree import Node
from corekv.plugins.radix import RadixBackend
from corekv.testing.backend import make_key

SALTS = (None, "tenant-a", "tenant-b")

def draw_stream(rnd) -> dict:
    """A stream from hypothesis' seeded ``Random``: requests dominate, so small pools fill up and
    evict (a plain ``st.lists`` of ops mostly yields tiny, eviction-free streams)."""
    ops = []
    for _ in range(rnd.randint(8, 60)):
        kind = rnd.choices(["request", "finish", "pin", "unpin"], [11, 5, 2, 2])[0]
        if kind == "request":
            suffix = [rnd.randrange(4) for _ in range(rnd.randint(0, 8))]
            ops.append((kind, rnd.randrange(3), rnd.randrange(3), suffix, rnd.randrange(3)))
        else:
            ops.append((kind, rnd.randrange(10)))
    return {"prefixes": [[rnd.randrange(4) for _ in range(rnd.randint(0, 14))] for _ in range(3)],
            "ops": ops}


streams = st.builds(
    lambda num_blocks, pin_fraction, rnd: {"num_blocks": num_blocks, "pin_fraction": pin_fraction,
                                           **draw_stream(rnd)},
    st.integers(1, 24), st.sampled_from([0.0, 0.2, 0.5]), st.randoms(use_true_random=False))


def oracle_hit_blocks(cached: list[tuple], toks: list[int], bs: int) -> int:
    """Longest whole-block prefix of ``toks[:-1]`` that some cached sequence starts with."""
    limit = (len(toks) - 1) // bs
    best = 0
    for seq in cached:
        n = 0
        while n < limit and (n + 1) * bs <= len(seq) and list(seq[n * bs:(n + 1) * bs]) == toks[n * bs:(n + 1) * bs]:
            n += 1
        best = max(best, n)
    return best


class Model:
    def __init__(self, backend):
        self.b, self.bs = backend, backend.block_size
        self.memory: dict[int, object] = {}       # block id -> what it was last computed with
        self.cached: dict[object, list[tuple]] = {s: [] for s in SALTS}
        self.running: list[list[int]] = []
        self.pins: list[tuple] = []               # (identity, key, run)
        self.serial = 0
        #: block hash -> priorities of the requests that cached or hit it since it was last evicted
        self.priorities: dict[bytes, set[int]] = {}
        backend.on_evict = self.evicted

    def evicted(self, blocks):
        for e in blocks:
            assert e.priority in self.priorities.pop(e.block_hash), \
                "an evicted block carries a priority no request that used it had"

    def request(self, salt, toks, priority=0):
        b, bs = self.b, self.bs
        key = make_key(toks, bs, salt, priority)
        hit = b.match(key, (len(toks) - 1) // bs)
        for j, block in enumerate(hit):
            assert self.memory[block] == (salt, tuple(toks[:(j + 1) * bs])), "a hit holds other KV"
        expected = oracle_hit_blocks(self.cached[salt], toks, bs)
        if b.stats()["num_evicted_blocks"] == 0:
            assert len(hit) == expected
        else:
            assert len(hit) <= expected
        b.acquire(hit)
        need = -(-len(toks) // bs) - len(hit)
        room = b.num_free_blocks
        fresh = b.allocate(need)
        if fresh is None:
            assert need > room
            b.free(hit)
            return
        held = {blk for table in self.running for blk in table} | {blk for *_, run in self.pins for blk in run}
        assert len(set(fresh)) == need and not set(fresh) & held, "a held block was handed out again"
        for j, block in enumerate(fresh, start=len(hit)):
            self.serial += 1
            full = (j + 1) * bs <= len(toks)
            self.memory[block] = (salt, tuple(toks[:(j + 1) * bs])) if full else ("partial", self.serial)
        table = hit + fresh
        b.cache(key, table[:key.num_full_blocks])
        for h in key.block_hashes:
            self.priorities.setdefault(h, set()).add(priority)
        self.cached[salt].append(tuple(toks))
        self.running.append(table)

    def pin(self, salt, toks):
        key = make_key(toks, self.bs, salt)
        run = self.b.match(key)
        before = self.b.num_pinned_blocks
        try:
            assert self.b.pin(key) == len(run)
        except PinLimitError:
            pinned = {blk for *_, r in self.pins for blk in r}
            assert len(pinned | set(run)) > self.b.max_pinned_blocks
            assert self.b.num_pinned_blocks == before
            return
        self.pins.append(((salt, tuple(toks[:key.num_full_blocks * self.bs])), key, run))

    def unpin(self, i):
        identity, key, _ = self.pins[i]
        last = max(j for j, p in enumerate(self.pins) if p[0] == identity)
        assert self.b.unpin(key) == len(self.pins.pop(last)[2])

    def check(self):
        b = self.b
        holders = Counter(blk for table in self.running for blk in table)
        holders.update(blk for *_, run in self.pins for blk in run)
        assert [b.ref_count(i) for i in range(b.num_blocks)] == [holders[i] for i in range(b.num_blocks)]
        assert b.num_free_blocks <= b.num_blocks - len(holders)
        if isinstance(b, HashBlockBackend):
            assert b.num_free_blocks == b.num_blocks - len(holders)
        assert b.num_pinned_blocks == len({blk for *_, run in self.pins for blk in run})
        assert b.num_pinned_blocks <= b.max_pinned_blocks
        for _, key, run in self.pins:
            assert b.match(key)[:len(run)] == run, "a pinned block was evicted"
        if isinstance(b, RadixBackend):
            check_radix_tree(b)


def check_radix_tree(b: RadixBackend) -> None:
    live = {x for x in b._state if isinstance(x, Node) and x.parent is not None}
    for node in live:
        parent = node.parent
        assert parent.children.get(b._child_key(node.key, 0)) is node
        assert parent.parent is None or parent in live, "an inner node was evicted below a live one"
        assert node.lock_ref == node.ref + sum(c.lock_ref for c in node.children.values())
    leaves = {n for n in live if not n.children and n.lock_ref == 0}
    assert b._evictable_leaves == leaves, "the evictable leaves are not exactly the unlocked leaves"


def run_stream(backend, stream):
    model = Model(backend)
    prefixes = stream["prefixes"]
    for op in stream["ops"]:
        if op[0] == "request":
            _, salt, prefix, suffix, priority = op
            toks = prefixes[prefix % len(prefixes)] + suffix
            if toks and len(model.running) < 4:
                model.request(SALTS[salt], toks, priority)
        elif op[0] == "finish" and model.running:
            backend.free(model.running.pop(op[1] % len(model.running)))
        elif op[0] == "pin":
            seqs = [(s, list(t)) for s in SALTS for t in model.cached[s]]
            if seqs:
                model.pin(*seqs[op[1] % len(seqs)])
        elif op[0] == "unpin" and model.pins:
            model.unpin(op[1] % len(model.pins))
        model.check()
    for table in model.running:
        backend.free(table)
    while model.pins:
        model.unpin(0)
    model.running.clear()
    model.check()
    assert backend.num_free_blocks == backend.num_blocks


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


#: every builtin policy, plus one keyed on creation order (what a third-party FIFO would be)
POLICIES = {"lru": LRU, "lfu": LFU, "priority": Priority, "fifo-like": lambda: CreationOrder()}


class CreationOrder(EvictionPolicy):
    name = "creation-order"

    def key(self, entry):
        return entry.created


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("block_size", [1, 2, 3])
@PROPERTY_SETTINGS
@given(stream=streams)
def test_hash_blocks_against_the_model(block_size, eviction, stream):
    run_stream(HashBlockBackend(stream["num_blocks"], block_size, eviction=POLICIES[eviction](),
                                max_pinned_fraction=stream["pin_fraction"]), stream)


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("block_size", [1, 2, 3])
@PROPERTY_SETTINGS
@given(stream=streams)
def test_radix_against_the_model(block_size, eviction, stream):
    run_stream(RadixBackend(stream["num_blocks"], block_size, eviction=POLICIES[eviction](),
                            max_pinned_fraction=stream["pin_fraction"]), stream)
