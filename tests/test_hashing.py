"""Chained block hashing: stable keys across processes, namespaces that never collide."""
import hashlib
import os
import struct
import subprocess
import sys

import pytest
import xxhash

from corekv.hashing import PrefixKey, block_hashes, chain_seed, check_cache_salt, pack_tokens

TOKENS = list(range(1000, 1000 + 50))


def test_tokens_pack_as_little_endian_uint32():
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert pack_tokens((1, 256)) == pack_tokens([1, 256])


def test_the_chain_is_h_of_previous_hash_and_block_tokens():
    seed = chain_seed("model", 4)
    h0, h1 = block_hashes(TOKENS[:9], 4, seed)[:2]   # the 9th token is a partial block: no hash
    assert h0 == xxhash.xxh3_128_digest(seed + struct.pack("<4I", *TOKENS[:4]))
    assert h1 == xxhash.xxh3_128_digest(h0 + struct.pack("<4I", *TOKENS[4:8]))
    assert len(block_hashes(TOKENS[:9], 4, seed)) == 2


def test_sha256_is_the_same_chain_with_another_digest():
    seed = chain_seed("model", 4, algorithm="sha256")
    (h0,) = block_hashes(TOKENS[:4], 4, seed, algorithm="sha256")
    assert len(seed) == len(h0) == 32
    assert h0 == hashlib.sha256(seed + struct.pack("<4I", *TOKENS[:4])).digest()


def test_a_block_hash_covers_its_whole_prefix():
    seed = chain_seed("model", 4)
    base = block_hashes(TOKENS, 4, seed)
    changed = block_hashes(TOKENS[:5] + [7] + TOKENS[6:], 4, seed)   # a token of block 1
    assert changed[0] == base[0] and all(a != b for a, b in zip(changed[1:], base[1:]))


@pytest.mark.parametrize("other", [
    dict(model_fingerprint="other-model"),
    dict(block_size=8),
    dict(cache_salt="tenant-a"),
    dict(extra_keys=["lora-7"]),
    dict(algorithm="sha256"),
])
def test_every_namespace_part_changes_the_seed(other):
    args = dict(model_fingerprint="model", block_size=4, cache_salt=None, extra_keys=(),
                algorithm="xxh3_128")
    assert chain_seed(**args) != chain_seed(**{**args, **other})


def test_no_salt_and_empty_salt_are_the_same_and_parts_do_not_run_together():
    assert chain_seed("m", 4, None) == chain_seed("m", 4, "")
    assert chain_seed("m", 4, "ab", ["c"]) != chain_seed("m", 4, "a", ["bc"])


def test_incremental_hashing_equals_one_pass():
    seed = chain_seed("model", 4)
    key = PrefixKey(TOKENS[:10], 4, seed)
    assert key.block_hashes == block_hashes(TOKENS[:10], 4, seed)
    key.extend(TOKENS[10:])
    assert key.block_hashes == block_hashes(TOKENS, 4, seed)
    tail = block_hashes(TOKENS, 4, key.block_hashes[1], start=2)
    assert key.block_hashes[2:] == tail


def test_hashes_are_identical_in_another_process_with_another_hash_seed():
    code = ("from corekv.hashing import chain_seed, block_hashes\n"
            "seed = chain_seed('model', 4, 'salt', ['lora'])\n"
            f"print(','.join(h.hex() for h in block_hashes({TOKENS!r}, 4, seed)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    mine = block_hashes(TOKENS, 4, chain_seed("model", 4, "salt", ["lora"]))
    assert out.split(",") == [h.hex() for h in mine]


def test_check_cache_salt_is_the_one_rule_for_salts():
    assert [check_cache_salt(s) for s in (None, "", "tenant-a")] == [None, None, "tenant-a"]
    with pytest.raises(TypeError, match=r"^cache_salt: got 7; expected a string \(the tenant's salt"):
        check_cache_salt(7)
    with pytest.raises(TypeError, match=r"^cache_salt: got ''; expected a non-empty string"):
        check_cache_salt("", allow_empty=False)
    with pytest.raises(TypeError, match=r"^cache_salt: got b'x'"):
        chain_seed("model", 4, cache_salt=b"x")  # where code builds keys itself, the same check
    assert chain_seed("model", 4, cache_salt="") == chain_seed("model", 4)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="hash algorithm 'md5' is not supported"):
        chain_seed("model", 4, algorithm="md5")
    with pytest.raises(ValueError, match="block_size"):
        chain_seed("model", 0)
    with pytest.raises(TypeError, match=r"extra_keys.*wrap it in a list"):
        chain_seed("model", 4, extra_keys="lora-7")
    with pytest.raises(TypeError, match="cache_salt"):
        chain_seed("model", 4, cache_salt=7)
    with pytest.raises(OverflowError):
        pack_tokens([2**32])
    with pytest.raises(OverflowError):
        pack_tokens([-1])
    with pytest.raises(TypeError, match="namespace must be bytes"):
        PrefixKey(TOKENS, 4, "not-bytes")
    with pytest.raises(ValueError, match="block_size"):
        PrefixKey(TOKENS, 0, chain_seed("model", 4))
    with pytest.raises(ValueError, match="algorithm"):
        PrefixKey(TOKENS, 4, chain_seed("model", 4), algorithm="md5")


def test_partial_block_keys_bind_the_parent_and_exactly_their_tokens():
    """A partial block's key is found only after the same whole blocks and with the same tokens,
    n of them; it is never a whole block's key, nor another length's."""
    from corekv.hashing import PrefixKey, chain_seed

    seed = chain_seed("model", 4)
    key = PrefixKey(TOKENS[:11], 4, seed)  # two whole blocks, then 3 tokens
    longest_first = key.partial_hashes(2, 3)
    assert len(longest_first) == 3 == len(set(longest_first))
    assert longest_first[1:] == key.partial_hashes(2, 2)  # the same keys, whichever length asked
    assert key.partial_hashes(2, 3, 3) == longest_first[:1] and key.partial_hashes(2, 3, 2) == longest_first[:2]
    longer = PrefixKey(TOKENS[:11] + [7, 7, 7], 4, seed)  # a prompt that continues it
    assert longer.partial_hashes(2, 3) == longest_first
    assert not set(longest_first) & set(longer.block_hashes)  # never a whole block's key
    other_parent = PrefixKey(TOKENS[:3] + [99] + TOKENS[4:11], 4, seed)
    assert not set(other_parent.partial_hashes(2, 3)) & set(longest_first)
    other_tokens = PrefixKey(TOKENS[:9] + [99, TOKENS[10]], 4, seed)
    assert other_tokens.partial_hashes(2, 3)[:2] != longest_first[:2]
    assert other_tokens.partial_hashes(2, 3)[2] == longest_first[2]  # the first token alone still matches
    assert PrefixKey(TOKENS[:11], 4, chain_seed("model", 4, "tenant")).partial_hashes(2, 3)[2] != longest_first[2]
    assert key.partial_hashes(0, 3) != PrefixKey(TOKENS[:11], 4, chain_seed("other", 4)).partial_hashes(0, 3)
    for block, size in ((2, 4), (2, 0), (2, 4 + 1), (3, 1)):
        with pytest.raises(ValueError, match="partial block"):
            key.partial_hashes(block, size)
