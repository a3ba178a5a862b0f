"""Faults under a running engine: corrupt, truncated and foreign-model LMDB entries are misses
(counted, never wrong output); a full LMDB map evicts or skips without crashing; a redis-server
killed mid-run lets every request complete, and the tier reconnects when the server returns."""
from __future__ import annotations

import lmdb

from corekv.engine.tiny_model import make_tiny_llama
from tier_helpers import FILLERS, GREEDY, PROMPT, evict, make_engine, tier_config

PROMPTS = [PROMPT, FILLERS[0]]


def reference(model, prompts):
    with make_engine(model, num_blocks=64) as engine:
        return [engine.generate(p, GREEDY)[0].token_ids for p in prompts]


def db_keys(engine, prompt):
    """The LMDB keys of ``prompt``'s full blocks (model digest prefix + block hash)."""
    tier = engine.offload.tiers[0]
    return [tier.codec.model_digest[:6] + h for h in engine.prefix_key(engine.encode(prompt)).block_hashes]


def test_flipped_and_truncated_entries_are_counted_misses(tiny_llama, tmp_path):
    tier = tier_config("lmdb", tmp_path)
    with make_engine(tiny_llama, [tier]) as engine:
        for prompt in PROMPTS:
            engine.generate(prompt, GREEDY)
        keys = [db_keys(engine, p) for p in PROMPTS]
    # tamper through a raw LMDB handle, as another program sharing the file could
    env = lmdb.open(tier.options["path"], map_size=tier.options["size"], max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for key in keys[0]:  # PROMPT: one flipped payload byte per entry
            entry = bytearray(txn.get(key, db=blocks))
            entry[-5] ^= 0x40
            txn.put(key, bytes(entry), db=blocks)
        for key in keys[1]:  # the filler: entries cut in half
            txn.put(key, txn.get(key, db=blocks)[:4000], db=blocks)
    env.close()
    with make_engine(tiny_llama, [tier]) as engine:
        outputs = [engine.generate(p, GREEDY)[0] for p in PROMPTS]
        stats = engine.stats()["tiers"]["lmdb"]
    assert [o.token_ids for o in outputs] == reference(tiny_llama, PROMPTS)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    # every tampered entry the reloads read was rejected (and deleted); none was loaded
    assert stats["faults"] == len(keys[0]) + len(keys[1]) and stats["reloads"] == 0


def test_a_foreign_fingerprint_in_lmdb_is_a_counted_miss(tiny_llama, tmp_path):
    """Another model's entries copied under this model's keys: the header's fingerprint rejects
    them (the keys alone would have let them through)."""
    tier = tier_config("lmdb", tmp_path)
    with make_engine(tiny_llama, [tier]) as engine:
        engine.generate(PROMPT, GREEDY)
        foreign_keys = db_keys(engine, PROMPT)
    other = make_tiny_llama(seed=1)
    with make_engine(other, [tier]) as engine:
        lmdb_tier = engine.offload.tiers[0]
        with lmdb_tier.env.begin(write=True) as txn:
            for foreign, own in zip(foreign_keys, db_keys(engine, PROMPT)):
                txn.put(own, txn.get(foreign, db=lmdb_tier._blocks), db=lmdb_tier._blocks)
        output = engine.generate(PROMPT, GREEDY)[0]
        stats = engine.stats()["tiers"]["lmdb"]
    assert output.token_ids == reference(other, [PROMPT])[0]
    assert output.num_cached_tokens == 0 and stats["faults"] == len(foreign_keys)


def test_a_full_lmdb_map_evicts_or_skips_without_crashing(tiny_llama, tmp_path):
    prompts = [f"prompt {i}: " + "some different words to fill the store " * 2 for i in range(10)]
    tier = tier_config("lmdb", tmp_path, size=160 * 1024)  # about 15 blocks of 8 KiB
    with make_engine(tiny_llama, [tier]) as engine:
        outputs = [engine.generate(p, GREEDY)[0] for p in prompts + prompts]
        engine.offload.flush()
        stats = engine.stats()["tiers"]["lmdb"]
    assert [o.token_ids for o in outputs] == reference(tiny_llama, prompts) * 2
    assert stats["evictions"] + stats["skips"] > 0 and stats["offloads"] > 0


def test_a_killed_redis_server_never_fails_a_request_and_the_tier_reconnects(tiny_llama, redis_server, tmp_path):
    prompts = [PROMPT, *FILLERS]
    expected = reference(tiny_llama, prompts)
    tier = tier_config("redis", tmp_path, redis_server.url)
    with make_engine(tiny_llama, [tier]) as engine:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        outputs, num_steps = {}, 0
        while engine.has_unfinished_requests:
            for output in engine.step():
                outputs[output.request_id] = output.token_ids
            num_steps += 1
            if num_steps == 3:
                redis_server.kill()  # mid-run: offloads and reloads now fail
        assert [outputs[i] for i in ids] == expected
        # while it is down, reloads miss and writes are dropped, but requests still complete
        assert [engine.generate(p, GREEDY)[0].token_ids for p in prompts] == expected
        down = engine.stats()["tiers"]["redis"]
        assert down["errors"] + down["skips"] + down["misses"] > 0
        redis_server.start()
        for _ in range(20):  # the tier retries after its cool-down; no timing is asserted
            engine.generate(PROMPT, GREEDY)
            evict(engine)
            output = engine.generate(PROMPT, GREEDY)[0]
            if output.cached_tokens_by_tier.get("redis"):
                break
        assert output.cached_tokens_by_tier == {"device": 0, "redis": 64}
        assert output.token_ids == expected[0]
