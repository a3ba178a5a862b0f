"""The ``kv_events`` config section: declared by the kv_events plugin (not by corekv's own config),
its defaults, validation with field paths, environment overrides, the reference."""
from __future__ import annotations

import dataclasses
import re

import pytest

from corekv.config import Config, config_reference, dump_config, load_config
from corekv.errors import ConfigError
from corekv.plugin import make_plugin_manager

DEFAULTS = dict(enabled=False, endpoint="tcp://127.0.0.1:5557", replay_endpoint=None, topic="",
                buffer_steps=10000, hwm=100000, include_token_ids=False)


def load(section, **env):
    return load_config({"kv_events": section}, env=env)


def test_the_section_is_the_plugins_own():
    """corekv's config knows no kv_events field: the plugin registers the section."""
    assert "kv_events" not in [f.name for f in dataclasses.fields(Config)]
    spec = make_plugin_manager().config_sections()["kv_events"]
    assert (spec.plugin, spec.distribution) == ("kv_events", "corekv")
    assert list(spec.options) == list(DEFAULTS)


def test_defaults_are_off_and_listen_on_loopback_only():
    """vLLM's defaults, except the endpoint: vLLM binds tcp://*:5557, every interface."""
    cfg = load_config({}, env={})
    assert cfg.kv_events == DEFAULTS and cfg.sections["kv_events"] is cfg.kv_events
    assert (cfg.kv_events.enabled, cfg.kv_events.endpoint) == (False, "tcp://127.0.0.1:5557")


def test_a_full_section_loads_and_round_trips_through_dump():
    section = {"enabled": True, "endpoint": "tcp://*:5557", "replay_endpoint": "ipc:///tmp/kv",
               "topic": "kv@a", "buffer_steps": 5, "hwm": 10, "include_token_ids": False}
    cfg = load(section)
    assert cfg.kv_events == section
    assert dump_config(cfg)["kv_events"] == section
    assert load_config(dump_config(cfg), env={}).kv_events == cfg.kv_events
    empty_topic = load({"enabled": True, "topic": ""})  # "" is a real value (the empty topic)
    assert load_config(dump_config(empty_topic), env={}).kv_events.topic == ""


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "kv_events.enabled: got 'yes'; expected true or false"),
    ({"endpoint": "localhost:5557"}, "kv_events.endpoint: got 'localhost:5557'; expected a ZMQ "
                                     "address such as tcp://*:5557"),
    ({"replay_endpoint": "5558"}, "kv_events.replay_endpoint: got '5558'; expected a ZMQ address"),
    ({"replay_endpoint": "tcp://127.0.0.1:5557"}, "kv_events.replay_endpoint: got "
     "'tcp://127.0.0.1:5557', the same address as kv_events.endpoint; expected another port"),
    ({"include_token_ids": "no"}, "kv_events.include_token_ids: got 'no'; expected true or false"),
    ({"buffer_steps": 0}, "kv_events.buffer_steps: got 0; expected an integer >= 1"),
    ({"hwm": 2.5}, "kv_events.hwm: got 2.5; expected an integer >= 1"),
    ({"topic": 7}, "kv_events.topic: got 7; expected a string; quote it in YAML"),
    ({"endpiont": "tcp://*:1"}, "kv_events.endpiont: unknown key (value 'tcp://*:1'); did you mean "
                                "'endpoint'?"),
    ("on", "kv_events: got 'on'; expected a mapping with keys enabled, endpoint, replay_endpoint"),
])
def test_bad_values_name_the_field_the_value_and_what_is_expected(section, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as info:
        load(section)
    assert info.value.path == message.split(":")[0]


def test_port_zero_asks_for_free_ports_so_both_sockets_may_say_it():
    cfg = load({"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"})
    assert cfg.kv_events.replay_endpoint == "tcp://127.0.0.1:0"


def test_environment_overrides_reach_the_section():
    cfg = load_config({}, env={"COREKV_KV_EVENTS__ENABLED": "true", "COREKV_KV_EVENTS__HWM": "64",
                               "COREKV_KV_EVENTS__INCLUDE_TOKEN_IDS": "true"})
    assert cfg.kv_events.enabled and cfg.kv_events.hwm == 64 and cfg.kv_events.include_token_ids
    with pytest.raises(ConfigError, match=r"kv_events.buffer_steps: got -1.*\(set by COREKV_KV_EVENTS__BUFFER_STEPS\)"):
        load_config({}, env={"COREKV_KV_EVENTS__BUFFER_STEPS": "-1"})


def test_a_whole_section_can_come_from_one_variable():
    cfg = load_config({}, env={"COREKV_KV_EVENTS": "{enabled: true, topic: t}"})
    assert cfg.kv_events == {**DEFAULTS, "enabled": True, "topic": "t"}
    with pytest.raises(ConfigError, match=r"^kv_events.replay_endpoint: got 'tcp://127.0.0.1:5557', "
                                          r".*\(set by COREKV_KV_EVENTS__REPLAY_ENDPOINT\)$"):
        load_config({}, env={"COREKV_KV_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:5557"})


def test_the_reference_has_the_sections_rows():
    text = config_reference(make_plugin_manager())
    assert ("| `kv_events.endpoint` | a ZMQ address such as tcp://*:5557, ipc:///tmp/kv-events or "
            "inproc://kv-events | tcp://127.0.0.1:5557 |") in text
    assert "| `kv_events.replay_endpoint` | a ZMQ address such as tcp://*:5557, ipc:///tmp/kv-events " \
           "or inproc://kv-events | none |" in text
    assert "| `kv_events.topic` | a string |  |" in text
