"""Plugin config sections (``corekv_register_config_sections``): a plugin declares a top-level
section with the same ``Option`` schema as backends and tiers, and ``load_config`` validates it
once, fills its defaults, applies environment overrides, runs its cross-field check, and hands
the plugin the result as ``cfg.sections[name]`` / ``cfg.<name>``.

A test plugin (``Shipper``: a ``shipper`` section) keeps these tests apart from the builtin
``kv_events`` plugin, whose own section is tested in tests/test_kv_events_config.py.
"""
from __future__ import annotations

import copy
import dataclasses
import pickle
import textwrap

import pytest
import yaml

import corekv
from corekv.config import Config, Section, config_reference, dump_config, load_config
from corekv.plugin import ConfigSectionSpec, Option, hookimpl, make_plugin_manager

SHIPPER_OPTIONS = {
    "enabled": Option("bool", default=False, help="ship the logs"),
    "url": Option("str", default="udp://127.0.0.1:9", pattern=r"udp://\S+:\d+",
                  pattern_text="a udp:// address such as udp://127.0.0.1:9", help="where to"),
    "fallback_url": Option("str", default=None, pattern=r"udp://\S+:\d+",
                           pattern_text="a udp:// address such as udp://127.0.0.1:9"),
    "level": Option("str", default="info", choices=("debug", "info", "warning")),
    "buffer": Option("size", default="1MiB", minimum=1, help="bytes kept before sending"),
    "prefix": Option("str", default="", allow_empty=True),
}


def no_loop(values):
    """The cross-field rule: the fallback must be another address."""
    if values.fallback_url is not None and values.fallback_url == values.url:
        raise corekv.ConfigError(f"shipper.fallback_url: got {values.fallback_url!r}, the same as "
                                 "shipper.url; expected another address", path="shipper.fallback_url")


class Shipper:
    def __init__(self, check=no_loop):
        self.check = check
        self.checked = []

    @hookimpl
    def corekv_register_config_sections(self):
        def check(values):
            self.checked.append(values)
            if self.check is not None:
                self.check(values)
        return [ConfigSectionSpec("shipper", options=SHIPPER_OPTIONS, check=check,
                                  description="ships logs (a test plugin)")]


@pytest.fixture
def shipper():
    return Shipper()


def load(data, plugin, **env):
    return load_config(data, env=env, plugin_manager=make_plugin_manager([plugin]))


def error_of(data, plugin, **env) -> corekv.ConfigError:
    with pytest.raises(corekv.ConfigError) as info:
        load(data, plugin, **env)
    return info.value


# -- reading -------------------------------------------------------------------------------------
def test_an_absent_section_gets_its_declared_defaults(shipper):
    cfg = load({}, shipper)
    assert cfg.shipper == {"enabled": False, "url": "udp://127.0.0.1:9", "fallback_url": None,
                           "level": "info", "buffer": 2**20, "prefix": ""}
    assert cfg.sections["shipper"] is cfg.shipper and isinstance(cfg.shipper, Section)


def test_values_are_read_by_key_or_by_attribute_and_cannot_change(shipper):
    section = load({"shipper": {"enabled": True, "buffer": "4KiB", "prefix": ""}}, shipper).shipper
    assert (section.enabled, section["buffer"], section.prefix) == (True, 4096, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        section.enabled = False
    with pytest.raises(AttributeError, match=r"config section 'shipper' has no option 'enabeld'; "
                                             r"did you mean 'enabled'\?"):
        section.enabeld


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "shipper.enabled: got 'yes'; expected true or false"),
    ({"url": "tcp://x:1"}, "shipper.url: got 'tcp://x:1'; expected a udp:// address such as udp://127.0.0.1:9"),
    ({"level": "warn"}, "shipper.level: got 'warn'; expected one of debug, info, warning; did you mean 'warning'?"),
    ({"buffer": 0}, "shipper.buffer: got 0; expected a non-zero size such as 512MiB"),
    ({"url": ""}, "shipper.url: got ''; expected a udp:// address"),
    ({"levle": "info"}, "shipper.levle: unknown key (value 'info'); did you mean 'level'? Valid keys: "
                        "enabled, url, fallback_url, level, buffer, prefix"),
    (["enabled"], "shipper: got ['enabled']; expected a mapping with keys enabled, url, fallback_url"),
    ({"fallback_url": "udp://127.0.0.1:9"}, "shipper.fallback_url: got 'udp://127.0.0.1:9', the same as "
                                            "shipper.url; expected another address"),
])
def test_bad_values_name_the_field_the_value_and_what_is_expected(shipper, section, message):
    error = error_of({"shipper": section}, shipper)
    assert str(error).startswith(message)
    assert error.path == message.split(":")[0]


def test_an_unknown_top_level_key_suggests_the_sections_too(shipper):
    assert str(error_of({"shiper": {}}, shipper)) == (
        "shiper: unknown key (value {}); did you mean 'shipper'? Valid keys: model, dtype, device, "
        "engine, cache, kv_events, shipper, plugins")
    assert str(error_of({"sections": {}}, shipper)).startswith("sections: unknown key")


def test_the_check_runs_once_on_the_validated_values(shipper):
    load({"shipper": {"buffer": "2KiB", "url": "udp://h:1"}}, shipper)
    assert shipper.checked == [{"enabled": False, "url": "udp://h:1", "fallback_url": None,
                                "level": "info", "buffer": 2048, "prefix": ""}]


def test_a_check_error_says_where_the_value_came_from(shipper, tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("shipper:\n  fallback_url: udp://127.0.0.1:9\n")
    assert str(error_of(path, shipper)).endswith(f"expected another address (in {path})")
    assert str(error_of({}, shipper, COREKV_SHIPPER__FALLBACK_URL="udp://127.0.0.1:9")).endswith(
        "expected another address (set by COREKV_SHIPPER__FALLBACK_URL)")


def test_a_check_that_crashes_is_a_plugin_error_naming_the_plugin():
    def crash(values):
        raise KeyError("oops")

    with pytest.raises(corekv.PluginError, match=r"^plugin 'Shipper': the check of config section "
                                                 r"'shipper' failed \(KeyError: 'oops'\)"):
        load({}, Shipper(check=crash))


# -- the environment ------------------------------------------------------------------------------
def test_environment_overrides_reach_a_section(shipper):
    cfg = load({"shipper": {"level": "debug"}}, shipper, COREKV_SHIPPER__ENABLED="true",
               COREKV_SHIPPER__BUFFER="2MiB")
    assert (cfg.shipper.enabled, cfg.shipper.buffer, cfg.shipper.level) == (True, 2 * 2**20, "debug")
    cfg = load({}, shipper, COREKV_SHIPPER="{level: warning}")
    assert cfg.shipper.level == "warning"
    assert str(error_of({}, shipper, COREKV_SHIPER__ENABLED="true")).startswith(
        "COREKV_SHIPER__ENABLED: unknown config section 'shiper'; did you mean 'shipper'? Expected "
        "COREKV_<SECTION>__<KEY> with a section among model, dtype, device, engine, cache, kv_events, "
        "shipper, plugins")


def test_corekv_plugins_loads_the_plugin_whose_section_another_variable_sets(tmp_path, monkeypatch):
    (tmp_path / "corekv_shipper_plugin.py").write_text(textwrap.dedent("""
        from corekv.plugin import ConfigSectionSpec, Option, hookimpl

        @hookimpl
        def corekv_register_config_sections():
            return [ConfigSectionSpec("shipper", options={"enabled": Option("bool", default=False)})]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config({}, env={"COREKV_PLUGINS": "[corekv_shipper_plugin]",
                               "COREKV_SHIPPER__ENABLED": "true"})
    assert cfg.plugins == ("corekv_shipper_plugin",) and cfg.shipper.enabled is True


# -- writing: dump and reference ------------------------------------------------------------------
@pytest.mark.parametrize("with_manager", [False, True])
def test_sections_round_trip_through_dump(shipper, with_manager):
    manager = make_plugin_manager([shipper])
    cfg = load_config({"shipper": {"enabled": True, "buffer": "3MiB", "prefix": ""}}, env={},
                      plugin_manager=manager)
    data = dump_config(cfg, plugin_manager=manager if with_manager else None)
    assert data["shipper"]["buffer"] == ("3MiB" if with_manager else 3 * 2**20)
    assert list(data) == ["model", "dtype", "device", "engine", "cache", "kv_events", "shipper", "plugins"]
    assert load_config(yaml.safe_load(yaml.safe_dump(data)), env={}, plugin_manager=manager) == cfg


def test_the_reference_has_the_sections_rows_where_they_sit_in_the_file(shipper):
    lines = config_reference(make_plugin_manager([shipper])).splitlines()
    rows = [line for line in lines if line.startswith("| `shipper.")]
    assert rows[0] == "| `shipper.enabled` | true or false | false | ship the logs |"
    assert "| `shipper.buffer` | a non-zero size such as 512MiB, 20GiB, 1.5GB or a whole number of " \
           "bytes | 1MiB | bytes kept before sending |" in rows
    assert "| `shipper.fallback_url` | a udp:// address such as udp://127.0.0.1:9 | none |  |" in rows
    assert lines.index(rows[-1]) + 1 == next(i for i, line in enumerate(lines) if line.startswith("| `plugins`"))


# -- configs built by hand ------------------------------------------------------------------------
def test_a_config_built_by_hand_has_only_the_sections_it_is_given():
    assert Config().sections == {}
    with pytest.raises(AttributeError, match=r"Config has no field or section 'kv_events'"):
        Config().kv_events
    given = Config(sections={"shipper": Section("shipper", {"enabled": True})})
    assert given.shipper.enabled is True
    assert Config(sections={"shipper": {"enabled": True}}).shipper.enabled is True  # a plain dict too


def test_a_loaded_config_copies_and_pickles_with_its_sections(shipper):
    cfg = load({"shipper": {"enabled": True}}, shipper)
    assert copy.deepcopy(cfg) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
    assert pickle.loads(pickle.dumps(cfg)).shipper.enabled is True


# -- malformed registrations ------------------------------------------------------------------------
def sections_of(*specs):
    class Plugin:
        @hookimpl
        def corekv_register_config_sections(self):
            return list(specs)
    return Plugin()


@pytest.mark.parametrize("spec, message", [
    (ConfigSectionSpec("Shipper"), "returned a ConfigSectionSpec named 'Shipper'; expected lowercase"),
    (ConfigSectionSpec("ship__per"), "returned a ConfigSectionSpec named 'ship__per'; expected lowercase"),
    (ConfigSectionSpec("shipper", check=42), "'shipper' has check 42; expected a callable or None"),
    (ConfigSectionSpec("shipper", options={"on": True}), "'shipper' has options {'on': True}; expected a mapping"),
    (ConfigSectionSpec("shipper", options={"items": Option("int", default=1)}),
     "'shipper' has options named ['items']; expected identifiers that do not start with _ and are not "
     "mapping methods"),
    (42, "returned 42 in its list; expected ConfigSectionSpec objects"),
])
def test_malformed_sections_are_rejected_naming_the_plugin(spec, message):
    with pytest.raises(corekv.PluginError) as info:
        make_plugin_manager([sections_of(spec)]).config_sections()
    assert str(info.value).startswith("plugin 'Plugin': corekv_register_config_sections()")
    assert message in str(info.value)


def test_a_section_may_not_take_a_name_of_corekvs_own_or_another_plugins():
    with pytest.raises(corekv.PluginError, match=r"^plugin 'Plugin' registers the config section "
                                                 r"'engine', which is corekv's own"):
        load_config({}, env={}, plugin_manager=make_plugin_manager([sections_of(ConfigSectionSpec("engine"))]))
    with pytest.raises(corekv.PluginError, match=r"^config section 'kv_events' is registered twice: "
                                                 r"by plugin 'kv_events' and by plugin 'Plugin'"):
        make_plugin_manager([sections_of(ConfigSectionSpec("kv_events"))]).config_sections()


def test_an_option_pattern_needs_its_wording_and_a_string_kind():
    with pytest.raises(ValueError, match="needs a pattern_text"):
        Option("str", pattern=r"udp://.*")
    with pytest.raises(ValueError, match="apply to kind 'str' only"):
        Option("int", allow_empty=True)
