"""corekv.tier_factory: the factory convention (make_tier): defaults filled, the block described,
option errors named by their config field, and a failing or odd factory named by its plugin."""
import pytest

from corekv.errors import ConfigError, PluginError
from corekv.plugin import Option, TierSpec
from corekv.tier_factory import make_tier
from corekv.tiers.host import HostTier

HOST_SPEC = TierSpec(name="host", factory=HostTier, plugin="host",
                     options={"size": Option("size"), "pin_memory": Option("bool", default=False)})


def test_make_tier_fills_defaults_and_passes_the_block_description():
    seen = {}

    def factory(**kwargs):
        seen.update(kwargs)
        return HostTier(size=kwargs["size"], block_bytes=kwargs["block_bytes"],
                        fingerprint=kwargs["fingerprint"], dtype=kwargs["dtype"], shape=kwargs["shape"])

    spec = TierSpec(name="t", factory=factory, options={"size": Option("size"),
                                                         "color": Option("str", default="red")})
    make_tier(spec, {"size": 4096}, block_bytes=64, fingerprint=b"m", dtype="float16", shape=[2, 16])
    assert seen == {"size": 4096, "color": "red", "block_bytes": 64, "fingerprint": b"m",
                    "dtype": "float16", "shape": (2, 16)}


def test_unknown_and_missing_options_are_config_errors():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['sise'\]"):
        make_tier(HOST_SPEC, {"size": 4096, "sise": 1}, block_bytes=64, fingerprint=b"m")
    with pytest.raises(ConfigError, match="option 'size' is required"):
        make_tier(HOST_SPEC, {}, block_bytes=64, fingerprint=b"m")


def test_a_failing_factory_is_a_plugin_error_naming_the_plugin():
    def factory(**kwargs):
        raise OSError("the device is gone")

    spec = TierSpec(name="flaky", factory=factory, plugin="thirdparty")
    with pytest.raises(PluginError, match=r"^cache\.tiers\[2\]: tier 'flaky' \(plugin 'thirdparty'\) "
                                          "failed to start: OSError: the device is gone"):
        make_tier(spec, {}, block_bytes=64, fingerprint=b"m", where="cache.tiers[2]")


def test_an_option_a_factory_rejects_is_a_config_error_naming_its_field():
    with pytest.raises(ConfigError, match=r"^cache\.tiers\[1\]\.size: size must be at least one block") as info:
        make_tier(HOST_SPEC, {"size": 1}, block_bytes=64, fingerprint=b"m", where="cache.tiers[1]")
    assert info.value.path == "cache.tiers[1].size"


def test_a_factory_must_return_a_tier():
    spec = TierSpec(name="odd", factory=lambda **kw: object(), plugin="thirdparty")
    with pytest.raises(PluginError, match="returned object, expected a corekv.tier.Tier"):
        make_tier(spec, {}, block_bytes=64, fingerprint=b"m")


def test_a_required_redis_tier_whose_server_is_down_refuses_to_start(tmp_path):
    """A real closed loopback port (nothing listens): required refuses, not required starts without it."""
    import socket

    import corekv
    from corekv.offload import make_tiers
    from corekv.plugin import make_plugin_manager

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    down = {"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "socket_timeout": 0.2}
    for required in (True, False):
        cfg = corekv.load_config({"cache": {"tiers": [{"type": "lmdb", "path": str(tmp_path / f"kv{required}"),
                                                      "size": "1MiB"}, {**down, "required": required}]}}, env={})
        kwargs = dict(fingerprint="ab" * 16, dtype="uint8", block_bytes=4096, shape=(4096,))
        if required:
            with pytest.raises(ConfigError, match=r"cache.tiers\[1\] \(redis\): required: true, and its store did "
                                                  "not answer") as caught:
                make_tiers(cfg.cache, make_plugin_manager(), **kwargs)
            assert caught.value.path == "cache.tiers[1].required"
        else:
            tiers, _ = make_tiers(cfg.cache, make_plugin_manager(), **kwargs)
            assert [t.name for t in tiers] == ["lmdb", "redis"] and not tiers[1].is_reachable()
            for tier in tiers:
                tier.close()
