"""The plugin manager: entry points, autoload switch, import failures, rejected plugins.

Third-party plugins are real distributions: a ``.dist-info`` folder with ``entry_points.txt`` and a
module, written into ``tmp_path`` and put on ``sys.path``, which ``importlib.metadata`` finds like
any installed package.
"""
from __future__ import annotations

import json
import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import corekv
from corekv.config import load_config
from corekv.plugin import (
    AUTOLOAD_ENV, BackendSpec, Option, TierSpec, available_plugins, hook_signature, hookimpl,
    make_plugin_manager,
)

ROOT = Path(__file__).resolve().parents[1]


def make_distribution(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
    """Write an installed-looking distribution ``dist`` into ``root``."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[corekv]\n{lines}")
    (info / "RECORD").write_text("")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A temporary site directory on ``sys.path``; modules imported from it are forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
            del sys.modules[name]


TOY_BACKEND_MODULE = """
from corekv import hookimpl
from corekv.plugin import BackendSpec, Option

@hookimpl
def corekv_register_backends():
    return [BackendSpec("thirdparty_lru", factory=dict, description="a third-party backend",
                        options={"ways": Option("int", default=4, minimum=1)})]
"""


@pytest.fixture
def thirdparty(site):
    make_distribution(site, "corekv-thirdparty", {"corekv_thirdparty_mod": TOY_BACKEND_MODULE},
                      {"thirdparty": "corekv_thirdparty_mod"})
    return site


# -- builtins and autoload -------------------------------------------------------------------------
def builtin_entry_points() -> dict[str, str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["entry-points"]["corekv"]


def test_builtin_plugins_come_from_corekvs_own_distribution():
    manager = make_plugin_manager()
    names = manager.plugin_names()
    for name in builtin_entry_points():
        assert names.get(name) == "corekv", f"builtin plugin {name!r} not loaded from corekv"
    for spec in [*manager.backends().values(), *manager.tiers().values()]:
        assert spec.distribution == "corekv" and spec.plugin in builtin_entry_points()


def test_builtin_backends_and_tiers_are_registered():
    info = available_plugins()
    assert {"hash_blocks", "radix"} <= set(info["backends"])
    assert {"host", "lmdb", "fsspec", "redis"} <= set(info["tiers"])
    assert "pinned" in info["plugins"]


def test_autoload_switch_skips_third_party_entry_points(thirdparty, monkeypatch):
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    manager = make_plugin_manager()
    assert "thirdparty" not in manager.plugin_names()
    assert "thirdparty_lru" not in manager.backends()
    assert set(builtin_entry_points()) <= set(manager.plugin_names())

    monkeypatch.delenv(AUTOLOAD_ENV)
    manager = make_plugin_manager()
    assert manager.plugin_names()["thirdparty"] == "corekv-thirdparty"
    spec = manager.backends()["thirdparty_lru"]
    assert (spec.plugin, spec.distribution) == ("thirdparty", "corekv-thirdparty")


def test_autoload_argument_overrides_the_environment(thirdparty, monkeypatch):
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    assert "thirdparty_lru" in make_plugin_manager(autoload=True).backends()
    monkeypatch.delenv(AUTOLOAD_ENV)
    assert "thirdparty_lru" not in make_plugin_manager(autoload=False).backends()


def test_a_third_party_backend_is_usable_from_the_config(thirdparty, monkeypatch):
    monkeypatch.delenv(AUTOLOAD_ENV)
    cfg = load_config({"cache": {"backend": "thirdparty_lru", "backend_options": {"ways": 8}}}, env={})
    assert cfg.cache.backend_options == {"ways": 8}


def test_entry_points_may_name_an_object(site, monkeypatch):
    make_distribution(site, "corekv-objplugin", {"corekv_objplugin_mod": """
        from corekv import hookimpl
        from corekv.plugin import TierSpec

        class Plugin:
            @hookimpl
            def corekv_register_tiers(self):
                return [TierSpec("objplugin_tier", factory=dict)]

        plugin = Plugin()
    """}, {"objplugin": "corekv_objplugin_mod:plugin"})
    monkeypatch.delenv(AUTOLOAD_ENV)
    assert make_plugin_manager().tiers()["objplugin_tier"].distribution == "corekv-objplugin"


def test_a_plugin_that_fails_to_import_is_named_with_its_entry_point(site, monkeypatch):
    make_distribution(site, "corekv-broken", {"corekv_broken_mod": """
        raise ImportError("needs libfrobnicate")
    """}, {"broken": "corekv_broken_mod"})
    monkeypatch.delenv(AUTOLOAD_ENV)
    with pytest.raises(corekv.PluginError) as info:
        make_plugin_manager()
    assert str(info.value) == (
        "plugin 'broken' (entry point broken = corekv_broken_mod in group 'corekv' of distribution "
        "'corekv-broken') failed to import (ImportError: needs libfrobnicate); fix or uninstall "
        "the package that provides it")
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    make_plugin_manager()  # autoload off: the broken third-party plugin is never imported


def test_a_config_plugin_that_fails_to_import_is_named(site):
    (site / "corekv_cfg_broken.py").write_text("1 / 0\n")
    with pytest.raises(corekv.PluginError, match=re.escape(
            "plugin 'corekv_cfg_broken' (listed in plugins:) failed to import (ZeroDivisionError: "
            "division by zero)")):
        make_plugin_manager(["corekv_cfg_broken"])


def test_plugins_listed_by_module_name_are_loaded(site):
    (site / "corekv_local_plugin.py").write_text(textwrap.dedent(TOY_BACKEND_MODULE))
    cfg = load_config({"plugins": ["corekv_local_plugin"], "cache": {"backend": "thirdparty_lru"}}, env={})
    assert cfg.cache.backend == "thirdparty_lru"
    manager = make_plugin_manager(["corekv_local_plugin"])
    assert manager.plugin_names()["corekv_local_plugin"] == ""  # not from any distribution


# -- rejected plugins ------------------------------------------------------------------------------
def test_a_misspelled_hook_implementation_is_rejected():
    class Typo:
        @hookimpl
        def corekv_register_backend(self):  # missing "s"
            return []

    with pytest.raises(corekv.PluginError, match=r"^plugin 'Typo' is invalid: .*corekv_register_backend"):
        make_plugin_manager([Typo()])


def test_an_unmarked_corekv_function_counts_as_a_hook_implementation(site):
    (site / "corekv_unmarked_typo.py").write_text("def corekv_on_block_stored(events):\n    pass\n")
    with pytest.raises(corekv.PluginError, match=r"corekv_on_block_stored"):
        make_plugin_manager(["corekv_unmarked_typo"])
    (site / "corekv_unmarked_ok.py").write_text(textwrap.dedent("""
        from corekv.plugin import TierSpec

        def corekv_register_tiers():
            return [TierSpec("unmarked_tier", factory=dict)]
    """))
    assert "unmarked_tier" in make_plugin_manager(["corekv_unmarked_ok"]).tiers()


def test_a_hook_implementation_with_an_unknown_argument_is_rejected():
    class ExtraArgument:
        @hookimpl
        def corekv_resolve_model(self, name, revision):
            return None

    with pytest.raises(corekv.PluginError, match=r"^plugin 'ExtraArgument' is invalid: .*revision"):
        make_plugin_manager([ExtraArgument()])


def _backends(*names):
    class Plugin:
        @hookimpl
        def corekv_register_backends(self):
            return [BackendSpec(n, factory=dict) for n in names]
    return Plugin


def test_duplicate_backend_names_are_rejected_naming_both_plugins():
    first, second = _backends("dup_backend"), _backends("dup_backend")
    first.__name__, second.__name__ = "First", "Second"
    manager = make_plugin_manager([first(), second()])
    with pytest.raises(corekv.PluginError) as info:
        manager.backends()
    assert str(info.value) == (
        "backend 'dup_backend' is registered twice: by plugin 'First' and by plugin 'Second'; "
        "uninstall or rename one of them")


def test_a_builtin_name_cannot_be_taken_by_another_plugin():
    with pytest.raises(corekv.PluginError, match=r"^tier 'host' is registered twice: by plugin 'host'"):
        class Impostor:
            @hookimpl
            def corekv_register_tiers(self):
                return [TierSpec("host", factory=dict)]

        make_plugin_manager([Impostor()]).tiers()


def test_duplicate_plugin_names_are_rejected():
    plugin = _backends("a_backend")
    with pytest.raises(corekv.PluginError, match=r"^two plugins are named 'Plugin'"):
        make_plugin_manager([plugin(), plugin()])


@pytest.mark.parametrize("returned, message", [
    ("spec", "returned 'spec'; expected a list of BackendSpec"),
    (["spec"], "returned 'spec' in its list; expected BackendSpec objects"),
    ([TierSpec("t", factory=dict)], "expected BackendSpec objects"),
    ([BackendSpec("", factory=dict)], "returned a BackendSpec named ''; expected a non-empty string"),
    ([BackendSpec("b", factory=42)], "'b' has factory 42; expected a callable"),
    ([BackendSpec("b", factory=dict, options={"x": 1})],
     "'b' has options {'x': 1}; expected a mapping of str to corekv.plugin.Option"),
])
def test_malformed_registrations_are_rejected(returned, message):
    class Bad:
        @hookimpl
        def corekv_register_backends(self):
            return returned

    with pytest.raises(corekv.PluginError) as info:
        make_plugin_manager([Bad()]).backends()
    assert str(info.value).startswith("plugin 'Bad': corekv_register_backends()")
    assert message in str(info.value)


def test_a_registration_hook_that_raises_is_named():
    class Crashing:
        @hookimpl
        def corekv_register_tiers(self):
            raise RuntimeError("no config")

    with pytest.raises(corekv.PluginError, match=re.escape(
            "plugin 'Crashing' failed in corekv_register_tiers() (RuntimeError: no config)")):
        make_plugin_manager([Crashing()]).tiers()


def test_plugins_must_be_a_list():
    with pytest.raises(TypeError, match=r"make_plugin_manager\(plugins=...\) got 'my_plugin'"):
        make_plugin_manager("my_plugin")


def test_option_kinds_are_checked():
    with pytest.raises(ValueError, match="Option kind 'bytes'"):
        Option("bytes")


# -- hooks through the manager ---------------------------------------------------------------------
def test_corekv_resolve_model_is_firstresult():
    class Aliases:
        def __init__(self, mapping):
            self.mapping = mapping
            self.__name__ = "Aliases" + "".join(mapping)

        @hookimpl
        def corekv_resolve_model(self, name):
            return self.mapping.get(name)

    manager = make_plugin_manager([Aliases({"a": "/models/a"}), Aliases({"b": "/models/b"})])
    assert manager.resolve_model("a") == "/models/a"
    assert manager.hook.corekv_resolve_model(name="b") == "/models/b"  # one answer, not a list
    assert manager.resolve_model("no-such-alias") is None


def test_registered_specs_carry_their_plugin_and_options():
    manager = make_plugin_manager([_backends("carry_backend")()])
    spec = manager.backends()["carry_backend"]
    assert (spec.plugin, spec.distribution, spec.factory) == ("Plugin", "", dict)


def test_available_plugins_is_json_ready_with_option_schemas():
    info = available_plugins()
    assert json.loads(json.dumps(info)) == info
    lmdb = info["tiers"]["lmdb"]
    assert lmdb["distribution"] == "corekv"
    assert lmdb["options"]["path"]["required"] is True
    assert lmdb["options"]["size"]["kind"] == "size"


def test_hook_signature_reads_like_the_source():
    def corekv_example(tier: str, block_hashes: list[bytes]) -> None:  # postponed: strings
        pass

    assert hook_signature(corekv_example) == "corekv_example(tier: str, block_hashes: list[bytes]) -> None"


# -- the plugin guide's examples run -----------------------------------------------------------------
def guide_code_block(containing: str) -> str:
    """The python block of docs/plugins.md that contains ``containing`` (there is exactly one)."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if containing in b]
    assert len(blocks) == 1, f"docs/plugins.md has {len(blocks)} python blocks with {containing!r}"
    return blocks[0]


def test_the_guides_example_tier_works(site, tmp_path):
    from corekv.tier_factory import make_tier

    (site / "kv_memo.py").write_text(guide_code_block("class MemoTier(Tier)"))
    cfg = load_config({"plugins": ["kv_memo"], "cache": {"tiers": [{"type": "memo", "max_entries": 2}]}}, env={})
    tier_config = cfg.cache.tiers[0]
    assert tier_config.options == {"max_entries": 2}
    spec = make_plugin_manager(cfg.plugins).tiers()["memo"]
    with make_tier(spec, tier_config.options, block_bytes=8, fingerprint=b"f" * 16, name=tier_config.name) as tier:
        keys = [bytes([i]) * 16 for i in range(3)]
        assert tier.put([(k, bytes([i]) * 8) for i, k in enumerate(keys)]) == 3
        assert tier.get(keys[:1]) == [None]  # the oldest was dropped past max_entries
        assert [bytes(p) for p in tier.get(keys[1:])] == [b"\x01" * 8, b"\x02" * 8]
        assert tier.stats()["evictions"] == 1


def test_the_guides_hook_testing_example_works():
    exec(compile(guide_code_block("class Recorder"), "docs/plugins.md", "exec"), {})


def test_the_guides_config_section_example_works(site):
    """docs/plugins.md's log_shipper (corekv_register_config_sections): validated by load_config,
    read as given by the plugin."""
    (site / "log_shipper.py").write_text(guide_code_block("def corekv_register_config_sections"))
    with pytest.raises(corekv.ConfigError, match=r"^log_shipper.url: got none with enabled: true"):
        load_config({"plugins": ["log_shipper"], "log_shipper": {"enabled": True}}, env={})
    with pytest.raises(corekv.ConfigError, match=r"^log_shipper.url: got 'tcp://x:1'; expected a udp:// address"):
        load_config({"plugins": ["log_shipper"], "log_shipper": {"url": "tcp://x:1"}}, env={})
    cfg = load_config({"plugins": ["log_shipper"]},
                      env={"COREKV_LOG_SHIPPER__ENABLED": "true", "COREKV_LOG_SHIPPER__URL": "udp://127.0.0.1:514",
                           "COREKV_LOG_SHIPPER__BUFFER": "4MiB"})
    assert cfg.log_shipper == {"enabled": True, "url": "udp://127.0.0.1:514", "buffer": 4 * 2**20}
    import log_shipper

    class FakeEngine:
        config = cfg

    log_shipper.corekv_on_engine_started(FakeEngine())
    assert log_shipper.SHIPPED == [("udp://127.0.0.1:514", 4 * 2**20)]
    assert available_plugins(["log_shipper"])["config_sections"]["log_shipper"]["options"]["buffer"] == {
        "kind": "size", "required": False, "default": "1MiB", "choices": [], "minimum": 1,
        "help": "bytes kept before sending"}


def test_an_entry_point_named_like_a_builtin_plugin_is_rejected(site, monkeypatch):
    make_distribution(site, "corekv-clash", {"corekv_clash_mod": TOY_BACKEND_MODULE},
                      {"radix": "corekv_clash_mod"})
    monkeypatch.delenv(AUTOLOAD_ENV)
    with pytest.raises(corekv.PluginError, match=r"^two plugins are named 'radix' \(.*; rename one of them"):
        make_plugin_manager()
