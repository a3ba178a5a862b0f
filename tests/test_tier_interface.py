"""corekv.tier: the base class's argument checks and its contract with the primitives a tier
implements (the factory convention, make_tier, is tested in tests/test_tier_factory.py)."""
import pytest

from corekv.errors import PluginError
from corekv.tiers.host import HostTier


@pytest.mark.parametrize("kwargs, message", [
    ({"block_bytes": 0}, "block_bytes must be a positive int, got 0"),
    ({"block_bytes": 64, "dtype": "float32"}, "shape is required for dtype 'float32'"),
    ({"block_bytes": 64, "dtype": "float32", "shape": (32,)}, "block_bytes=64 does not match"),
])
def test_block_description_must_be_consistent(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HostTier(size=10_000, fingerprint=b"m", **kwargs)


def test_put_needs_a_sequence_of_pairs():
    with HostTier(size=10_000, block_bytes=64, fingerprint=b"m") as tier:
        with pytest.raises(TypeError, match="items must be a sequence of"):
            tier.put(b"not pairs")
        with pytest.raises(TypeError, match=r"items\[i\]\[0\] must hold non-empty bytes"):
            tier.put([("text", bytes(64))])


class StopsAtTheFirstMiss(HostTier):
    """A tier still on the old contract of ``_contains_entries``: it answers a leading run only."""

    def _contains_entries(self, keys):
        answers = []
        for key in keys:
            answers.append(key in self.key_to_slot)
            if not answers[-1]:
                break
        return answers


def test_a_tier_whose_membership_skips_keys_is_a_plugin_error_naming_it():
    with StopsAtTheFirstMiss(size=10_000, block_bytes=64, fingerprint=b"m", name="old") as tier:
        tier.put([(b"k" * 16, bytes(64))])
        assert tier.contains_many([b"k" * 16]) == [True]
        with pytest.raises(PluginError, match=r"^tier 'old' \(StopsAtTheFirstMiss\): _contains_entries "
                                              "answered 1 of 2 keys; it must answer every key"):
            tier.contains_many([b"x" * 16, b"k" * 16])
