"""An attacker's and an unlucky operator's cases under a running engine: entries moved between
keys, forged with a recomputed checksum, or written without the tiers' secret are misses (counted,
deleted, recomputed: outputs equal a cold run); a tier that cannot start is left out unless it is
required; a missing secret is a clear error at start."""
from __future__ import annotations

import logging
from dataclasses import replace

import lmdb
import pytest
import xxhash

from corekv.block_format import HEADER_SIZE
from corekv.config import IntegrityConfig
from corekv.errors import ConfigError
from tier_helpers import FILLERS, GREEDY, PROMPT, make_config, make_engine, tier_config

from corekv.engine.llm_engine import Engine

PROMPTS = [PROMPT, FILLERS[0]]
SECRET_ENV = "COREKV_TEST_TIER_KEY"


def reference(model, prompts):
    with make_engine(model, num_blocks=64) as engine:
        return [engine.generate(p, GREEDY)[0].token_ids for p in prompts]


def stored_keys(tiny_llama, tier, engine_of=make_engine):
    """Run PROMPTS once (closing the engine offloads their blocks); their LMDB keys per prompt."""
    with engine_of(tiny_llama, [tier]) as engine:
        for prompt in PROMPTS:
            engine.generate(prompt, GREEDY)
        lmdb_tier = engine.offload.tiers[0]
        return [[lmdb_tier.codec.model_digest[:6] + h
                 for h in engine.prefix_key(engine.encode(p)).block_hashes] for p in PROMPTS]


def tamper(tier, edit) -> None:
    """Edit the store through a raw LMDB handle, as another program sharing the file could."""
    env = lmdb.open(tier.options["path"], map_size=tier.options["size"], max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        edit(txn, blocks)
    env.close()


def rerun(tiny_llama, tier, engine_of=make_engine):
    with engine_of(tiny_llama, [tier]) as engine:
        outputs = [engine.generate(p, GREEDY)[0] for p in PROMPTS]
        return outputs, engine.stats()["tiers"]["lmdb"]


def test_entries_swapped_or_rotated_between_keys_are_counted_misses(tiny_llama, tmp_path):
    """Swap each block of one prompt with the same block of the other, and rotate one prompt's
    values onto its next key: every entry's bytes are intact, only under the wrong key."""
    tier = tier_config("lmdb", tmp_path)
    keys_a, keys_b = stored_keys(tiny_llama, tier)

    def swap_and_rotate(txn, blocks):
        for a, b in zip(keys_a[:2], keys_b[:2]):
            value_a, value_b = txn.get(a, db=blocks), txn.get(b, db=blocks)
            txn.put(a, value_b, db=blocks)
            txn.put(b, value_a, db=blocks)
        rest = keys_a[2:] + keys_b[2:]
        values = [txn.get(k, db=blocks) for k in rest]
        for key, value in zip(rest, values[1:] + values[:1]):
            txn.put(key, value, db=blocks)

    tamper(tier, swap_and_rotate)
    outputs, stats = rerun(tiny_llama, tier)
    assert [o.token_ids for o in outputs] == reference(tiny_llama, PROMPTS)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    assert stats["faults"] == len(keys_a) + len(keys_b) and stats["reloads"] == 0


def test_a_zeroed_payload_under_a_recomputed_keyless_checksum_is_a_counted_miss(tiny_llama, tmp_path):
    """The forgery the key-less checksum let through: zero the KV, recompute the checksum over
    header and payload. Outputs equal a cold run, not the zeroed KV's."""
    tier = tier_config("lmdb", tmp_path)
    keys_a, _ = stored_keys(tiny_llama, tier)

    def zero(txn, blocks):
        for key in keys_a:
            entry = bytearray(txn.get(key, db=blocks))
            entry[HEADER_SIZE:] = bytes(len(entry) - HEADER_SIZE)
            entry[HEADER_SIZE - 16:HEADER_SIZE] = xxhash.xxh3_128_digest(
                bytes(entry[:HEADER_SIZE - 16]) + bytes(entry[HEADER_SIZE:]))
            txn.put(key, bytes(entry), db=blocks)

    tamper(tier, zero)
    outputs, stats = rerun(tiny_llama, tier)
    assert [o.token_ids for o in outputs] == reference(tiny_llama, PROMPTS)
    assert outputs[0].num_cached_tokens == 0 and stats["faults"] == len(keys_a)


def keyed_engine(model, tiers, **kwargs):
    config = make_config(tiers, **kwargs)
    config = replace(config, cache=replace(config.cache, integrity=IntegrityConfig(key_env=SECRET_ENV)))
    return Engine(config, model=model)


def test_with_a_secret_own_entries_reload_and_forged_or_keyless_ones_are_misses(tiny_llama, tmp_path,
                                                                                monkeypatch):
    """A keyed tier reloads what a process with the same secret stored; an entry written with
    a valid key-bound checksum but no MAC (what anyone who can write the store can make) is a
    miss, and so is every entry for an engine holding another secret."""
    monkeypatch.setenv(SECRET_ENV, "0123456789abcdef" * 4)
    tier = tier_config("lmdb", tmp_path)
    keys_a, _ = stored_keys(tiny_llama, tier, keyed_engine)
    outputs, stats = rerun(tiny_llama, tier, keyed_engine)
    assert outputs[0].num_cached_tokens > 0 and stats["faults"] == 0 and stats["reloads"] > 0

    with make_engine(tiny_llama, [tier]) as engine:  # no secret: the MAC entries are misses
        keyless = engine.generate(PROMPTS[0], GREEDY)[0]
        assert keyless.num_cached_tokens == 0 and engine.stats()["tiers"]["lmdb"]["faults"] > 0
        assert keyless.token_ids == reference(tiny_llama, PROMPTS[:1])[0]
        engine.generate(FILLERS[1], GREEDY)  # the keyless engine now stores entries of its own

    monkeypatch.setenv(SECRET_ENV, "fedcba9876543210" * 4)
    with keyed_engine(tiny_llama, [tier]) as engine:
        forged = engine.generate(FILLERS[1], GREEDY)[0]
        stats = engine.stats()["tiers"]["lmdb"]
    assert forged.num_cached_tokens == 0 and stats["faults"] > 0 and stats["reloads"] == 0
    assert forged.token_ids == reference(tiny_llama, [FILLERS[1]])[0]


@pytest.mark.parametrize("value, message", [
    (None, f"cache.integrity.key_env: the environment variable {SECRET_ENV} is not set"),
    ("too short", "integrity secret must be 16 to 64 bytes"),
])
def test_a_missing_or_short_secret_stops_the_engine_naming_the_field(tiny_llama, tmp_path, monkeypatch,
                                                                    value, message):
    if value is None:
        monkeypatch.delenv(SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(SECRET_ENV, value)
    with pytest.raises(ConfigError, match=message) as info:
        keyed_engine(tiny_llama, [tier_config("lmdb", tmp_path)])
    assert info.value.path == "cache.integrity.key_env"


def unusable_lmdb(tmp_path, **fields):
    (tmp_path / "not-a-folder").write_text("a file where the store should be")
    tier = tier_config("lmdb", tmp_path, path=str(tmp_path / "not-a-folder"))
    return replace(tier, **fields)


def test_a_tier_that_cannot_start_is_left_out_with_one_warning(tiny_llama, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="corekv.offload.build"):
        with make_engine(tiny_llama, [unusable_lmdb(tmp_path), tier_config("host", tmp_path)]) as engine:
            output = engine.generate(PROMPT, GREEDY)[0]
            stats = engine.stats()
    assert output.token_ids == reference(tiny_llama, [PROMPT])[0]
    assert list(stats["tiers"]) == ["host"] and list(stats["tiers_not_started"]) == ["lmdb"]
    assert stats["tiers_not_started"]["lmdb"].startswith("cache.tiers[0]")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tier lmdb did not start" in warnings[0]


def test_a_required_tier_that_cannot_start_stops_the_engine_naming_its_path(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match=r"^cache\.tiers\[0\]\.path: ") as info:
        make_engine(tiny_llama, [unusable_lmdb(tmp_path, required=True)])
    assert info.value.path == "cache.tiers[0].path"
