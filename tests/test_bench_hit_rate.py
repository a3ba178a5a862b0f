"""Index-only simulation: the seed chapter's table, and what a bounded pool costs."""
import random
import subprocess
import sys

import pytest

from corekv import bench
from corekv.plugins.hash_blocks import HashBlockBackend

# The seed chapter's published table (percent, one decimal): the specification, not our output.
SEED_TABLE = {
    "shared_system": (89.5, 88.8, 86.0),
    "multi_turn": (79.2, 78.6, 76.8),
    "few_shot": (89.6, 87.8, 81.1),
    "parallel": (87.1, 84.2, 73.3),
}


@pytest.fixture(scope="module")
def workloads():
    return bench.seed_workloads()


def test_the_seed_table_is_reproduced_exactly(workloads):
    rows = bench.hit_rate_table(workloads)
    got = {r["workload"]: tuple(round(100 * r[c], 1) for c in ("radix", "blocks 16", "blocks 64"))
           for r in rows}
    assert got == SEED_TABLE


def test_workloads_have_the_seed_shapes_and_leave_random_alone(workloads):
    random.seed(42)
    expected_next = random.random()
    random.seed(42)
    again = bench.seed_workloads()
    assert random.random() == expected_next
    assert again == workloads
    assert [len(workloads[w]) for w in bench.WORKLOAD_NAMES] == [100, 160, 100, 240]
    assert all(r[:1000] == workloads["shared_system"][0][:1000] for r in workloads["shared_system"])


@pytest.mark.parametrize("backend,block_size", [("radix", 1), ("radix", 16), ("hash_blocks", 16)])
def test_a_bounded_pool_never_hits_more_and_a_small_one_hits_less(workloads, backend, block_size):
    reqs = workloads["multi_turn"]
    unbounded = bench.hit_rate(reqs, backend, block_size)
    assert bench.hit_rate(reqs, backend, block_size, capacity=32768) <= unbounded
    # a turn only reuses its own conversation: LRU keeps it until requests outgrow the pool
    assert bench.hit_rate(reqs, backend, block_size, capacity=2048) == unbounded
    assert bench.hit_rate(reqs, backend, block_size, capacity=1024) < unbounded


def test_radix_at_page_16_hits_as_many_whole_blocks_as_hash_blocks(workloads):
    for reqs in workloads.values():
        assert bench.hit_rate(reqs, "radix", 16) == bench.hit_rate(reqs, "hash_blocks", 16)


def test_any_backend_factory_can_be_simulated(workloads):
    reqs = workloads["parallel"]
    assert bench.hit_rate(reqs, HashBlockBackend, 16) == bench.hit_rate(reqs, "hash_blocks", 16)


def test_format_table_prints_one_line_per_workload():
    text = bench.format_table([{"workload": "parallel", "radix": 0.871, "blocks 16": 0.842}])
    assert text.splitlines() == [
        "workload      radix  blocks 16",
        "parallel      87.1%      84.2%",
    ]


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="capacity"):
        bench.hit_rate([[1, 2, 3]], "radix", 16, capacity=8)
    with pytest.raises(ValueError, match="block_size"):
        bench.hit_rate([[1, 2, 3]], "radix", 0)
    with pytest.raises(ValueError, match=r"requests\[1\]"):
        bench.hit_rate([[1, 2], []], "radix", 1)
    with pytest.raises(TypeError, match="requests"):
        bench.hit_rate("1 2 3")
    with pytest.raises(ValueError, match="'nope' is not registered"):
        bench.hit_rate([[1, 2]], "nope", 1)


def test_importing_bench_and_testing_needs_no_torch():
    code = ("import sys, corekv.bench, corekv.testing\n"
            "corekv.bench.hit_rate([[1, 2, 3], [1, 2, 4]], 'radix', 1)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_eviction_policy_changes_what_a_bounded_pool_keeps():
    """few_shot at 1024 tokens: LFU keeps the shared header and examples that a long one-off
    question pushes out under LRU (BENCHMARKS.md, "Eviction policies")."""
    reqs = bench.seed_workloads()["few_shot"]
    lru = bench.hit_rate(reqs, "radix", 1, capacity=1024, eviction="lru")
    assert lru == bench.hit_rate(reqs, "radix", 1, capacity=1024)   # LRU is the default
    assert bench.hit_rate(reqs, "radix", 1, capacity=1024, eviction="lfu") > lru
    # no request carries a priority here, so priority orders as LRU does
    assert bench.hit_rate(reqs, "hash_blocks", 16, capacity=1024, eviction="priority") == \
        bench.hit_rate(reqs, "hash_blocks", 16, capacity=1024)
    rows = bench.hit_rate_table({"few_shot": reqs}, capacity=1024, eviction="lfu")
    assert rows[0]["eviction"] == "lfu" and bench.format_table(rows).splitlines()[1].startswith("few_shot (lfu)")


def test_the_cli_runs_one_row_per_workload_and_policy_and_names_a_bad_policy():
    import json
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "corekv.cli", "bench", "hit-rate", *args],
                              capture_output=True, text=True, timeout=300)

    result = run("--workloads", "parallel", "--capacity", "2048", "--eviction", "lru,lfu", "--json")
    assert result.returncode == 0, result.stderr
    assert [(r["workload"], r["eviction"]) for r in json.loads(result.stdout)] == [
        ("parallel", "lru"), ("parallel", "lfu")]
    bad = run("--eviction", "lfru")
    assert bad.returncode == 2
    assert "--eviction: got 'lfru'; expected a comma-separated list of registered eviction policies" in bad.stderr
