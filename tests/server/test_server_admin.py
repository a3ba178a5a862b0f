"""The admin endpoints (warm, pin, unpin, stats, info), /health and /metrics, in the exact shapes
the router and operators rely on."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import MODEL_ID, tiny_config

from corekv.engine.llm_engine import Engine
from corekv.server import BackgroundServer, build_app

SYSTEM = "You are the assistant of a cache framework; answer in one line, politely. " * 2


def get(server, path: str) -> httpx.Response:
    return httpx.get(server.url + path, timeout=60)


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_warm_pins_a_prefix_that_later_requests_hit_and_unpin_releases_it(server, client, engine):
    num_pinned = engine.backend.num_pinned_blocks
    warmed = post(server, "/admin/warm", {"prompt": SYSTEM, "cache_salt": "t1"})
    assert warmed.status_code == 200
    cached = warmed.json()["cached_tokens"]
    assert cached == len(engine.encode(SYSTEM)) // engine.block_size * engine.block_size > 0
    assert get(server, "/admin/stats").json()["kv_num_pinned_blocks"] == num_pinned + cached // 16
    response = client.completions.create(model=MODEL_ID, prompt=SYSTEM + "Question?", max_tokens=2,
                                         extra_body={"cache_salt": "t1"})
    assert response.usage.prompt_tokens_details.cached_tokens == cached
    unpinned = post(server, "/admin/unpin", {"prompt": SYSTEM, "cache_salt": "t1"})
    assert unpinned.json() == {"unpinned_tokens": cached}
    assert get(server, "/admin/stats").json()["kv_num_pinned_blocks"] == num_pinned


def test_warm_without_pin_keeps_nothing_pinned(server, engine):
    before = engine.backend.num_pinned_blocks
    warmed = post(server, "/admin/warm", {"messages": [{"role": "system", "content": SYSTEM}],
                                          "pin": False})
    assert warmed.status_code == 200 and warmed.json()["cached_tokens"] > 0
    assert get(server, "/admin/stats").json()["kv_num_pinned_blocks"] == before


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ({"prompt": 3}, "prompt"), ({"prompt": "a", "pin": "yes"}, "pin"),
    ({"prompt": "a", "cache_salt": ""}, "cache_salt"), ({"prompt": "a", "pinned": True}, "pinned"),
])
def test_a_bad_warm_body_is_a_400(server, body, param):
    response = post(server, "/admin/warm", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": "too short"}, "prompt"), ({"prompt": list(range(100, 115))}, "prompt"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
])
def test_warming_less_than_one_block_is_a_400_that_says_the_minimum(server, engine, body, param):
    num_pinned = engine.backend.num_pinned_blocks
    response = post(server, "/admin/warm", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(f"{param}: ")
    assert f"at least {engine.block_size} tokens" in error["message"]
    assert engine.backend.num_pinned_blocks == num_pinned


def test_warming_exactly_one_block_caches_it(server, engine):
    warmed = post(server, "/admin/warm", {"prompt": list(range(100, 100 + engine.block_size)),
                                          "pin": False})
    assert warmed.status_code == 200 and warmed.json() == {"cached_tokens": engine.block_size}


def test_unpin_takes_no_pin_field(server):
    response = post(server, "/admin/unpin", {"prompt": "a", "pin": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "pin"


def test_stats_is_engine_stats_as_json(server, client, engine):
    before = get(server, "/admin/stats").json()
    client.completions.create(model=MODEL_ID, prompt="count my tokens", max_tokens=4,
                              extra_body={"ignore_eos": True})
    after = get(server, "/admin/stats").json()
    assert set(after) == set(engine.stats())
    assert after["output_tokens"] == before["output_tokens"] + 4
    assert after["kv_block_size"] == engine.block_size


def test_info_names_the_model_block_size_prompt_bound_and_no_kv_events(server, engine):
    max_prompt_chars = server.app.state.async_engine.max_prompt_chars
    assert get(server, "/admin/info").json() == {"model": MODEL_ID, "block_size": engine.block_size,
                                                 "max_prompt_chars": max_prompt_chars,
                                                 "kv_events": None}
    assert max_prompt_chars >= engine.max_model_len  # a byte tokenizer: a token per character


def test_info_reports_the_kv_event_sockets_the_publisher_bound(tiny_model_folder):
    pytest.importorskip("zmq")
    config = tiny_config(tiny_model_folder)
    config["kv_events"] = {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                           "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}
    with Engine.from_config(config) as engine, \
            BackgroundServer(build_app(engine, served_model_name=MODEL_ID)) as server:
        info = get(server, "/admin/info").json()["kv_events"]
    assert info["topic"] == "kv"
    for key in ("endpoint", "replay_endpoint"):
        host, _, port = info[key].rpartition(":")
        assert host == "tcp://127.0.0.1" and int(port) > 0, info  # NOTE: port 0 became a real one
    assert info["endpoint"] != info["replay_endpoint"]


def test_health_is_ok_while_the_engine_thread_runs(server):
    assert get(server, "/health").json() == {"status": "ok"}


def test_metrics_are_the_engines_prometheus_text(server, client):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    def finished_stop_and_length() -> float:
        families = {f.name: f for f in text_string_to_metric_families(get(server, "/metrics").text)}
        return sum(s.value for s in families["corekv_requests_finished"].samples
                   if s.name.endswith("_total"))

    before = finished_stop_and_length()
    client.completions.create(model=MODEL_ID, prompt="metrics", max_tokens=2)
    assert finished_stop_and_length() == before + 1


class ServingPlugin:
    """A third-party plugin answering the server's hooks: the server names no plugin, it asks."""

    def corekv_collect_metrics(self, engine):
        return f"serving_plugin_block_size {engine.block_size}\n".encode()

    def corekv_describe_kv_events(self, engine):
        return {"endpoint": "tcp://broker:5557", "replay_endpoint": None, "topic": "elsewhere"}


def test_metrics_and_kv_events_come_from_the_plugins_hooks(tiny_model_folder):
    with Engine.from_config(tiny_config(tiny_model_folder), plugins=(ServingPlugin(),)) as engine, \
            BackgroundServer(build_app(engine, served_model_name=MODEL_ID)) as server:
        metrics = get(server, "/metrics")
        info = get(server, "/admin/info").json()
    assert metrics.status_code == 200
    assert f"serving_plugin_block_size {engine.block_size}\n" in metrics.text
    assert info["kv_events"] == {"endpoint": "tcp://broker:5557", "replay_endpoint": None,
                                 "topic": "elsewhere"}
