"""``corekv route``: every flag checked with a one-line error and exit 2, and the real command
(a subprocess) routing a request to a worker; plus the tokenizer-only loader it uses."""
from __future__ import annotations

import httpx
import pytest
from router_helpers import CLIENT_KEY, WORKER_KEY, start_route

from corekv.cli import main

WORKERS = ["--workers", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize("args, message", [
    (["--cache-threshold", "1.5"], "--cache-threshold: got 1.5; expected a number in [0, 1]"),
    (["--cache-threshold", "half"], "--cache-threshold: got 'half'; expected a number in [0, 1]"),
    (["--balance-abs-threshold", "-1"], "--balance-abs-threshold: got -1; expected an integer >= 0"),
    (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold: got 0.5; expected a finite number >= 1"),
    (["--balance-rel-threshold", "inf"], "--balance-rel-threshold: got inf; expected a finite"),
    (["--health-interval", "0"], "--health-interval: got 0.0; expected seconds > 0"),
    (["--max-retries", "-1"], "--max-retries: got -1; expected an integer >= 0"),
    (["--tree-blocks", "0"], "--tree-blocks: got 0; expected an integer >= 1"),
    (["--request-timeout", "nan"], "--request-timeout: got nan; expected seconds > 0"),
    (["--port", "70000"], "--port: got 70000; expected a port number 1-65535"),
    (["--policy", "random"], "--policy: invalid choice: 'random'"),
    (["--api-key", ""], "--api-key: got an empty string; expected a non-empty key"),
    (["--worker-api-key", "a key"], "--worker-api-key: the key has the character ' '"),
    (["--max-request-bytes", "0"], "--max-request-bytes: got '0'; expected a size >= 1 byte"),
])
def test_bad_flags_exit_2_naming_the_flag(args, message, capsys):
    assert main(["route", *WORKERS, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("corekv: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("workers, message", [
    (["ftp://127.0.0.1:8001"], "--workers: got 'ftp://127.0.0.1:8001'; expected a worker's base URL"),
    (["http://127.0.0.1"], "--workers: got 'http://127.0.0.1'; expected"),
    (["http://127.0.0.1:8001/v1"], "without a path"),
    (["http://127.0.0.1:8001", "http://127.0.0.1:8001/"], "more than once"),
])
def test_bad_worker_urls_exit_2(workers, message, capsys):
    assert main(["route", "--workers", *workers]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("events, message", [
    (["http://127.0.0.1:8001"], "--worker-events: got 'http://127.0.0.1:8001'; expected "
                                "URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC] (e.g. http://gpu1:8000="),
    (["http://127.0.0.1:8001="], "expected URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC]"),
    (["127.0.0.1:8001=tcp://127.0.0.1:5557"],
     "--worker-events: got '127.0.0.1:8001'; expected a worker's base URL http://HOST:PORT"),
    (["http://127.0.0.1:8003=tcp://127.0.0.1:5557"],
     "--worker-events: got events for http://127.0.0.1:8003, which is not one of --workers; add it"),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:5557", "http://127.0.0.1:8001/=tcp://127.0.0.1:5559"],
     "--worker-events: got http://127.0.0.1:8001 more than once; name each worker's events once"),
    (["http://127.0.0.1:8001=127.0.0.1:5557"], "--worker-events: got the address '127.0.0.1:5557' for "
     "http://127.0.0.1:8001; expected a ZMQ address the router can connect to, tcp://HOST:PORT or ipc://PATH"),
    (["http://127.0.0.1:8001=inproc://kv"], "got the address 'inproc://kv'"),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:0"], "got the address 'tcp://127.0.0.1:0'"),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:5557,replay=tcp://h"], "got the address 'tcp://h'"),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:5557,replay_endpoint=tcp://127.0.0.1:5558"],
     "--worker-events: got 'replay_endpoint=tcp://127.0.0.1:5558' in 'http://127.0.0.1:8001=tcp://127.0.0.1:5557,"
     "replay_endpoint=tcp://127.0.0.1:5558'; expected replay=ENDPOINT or topic=TOPIC after the endpoint; "
     "did you mean 'replay'?"),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"], "expected replay=ENDPOINT or topic="),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:5557,topic=a,topic=b"], "got topic= twice in"),
    (["http://127.0.0.1:8001=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5557"],
     "got tcp://127.0.0.1:5557 as both the endpoint and the replay endpoint of http://127.0.0.1:8001"),
])
def test_bad_worker_events_exit_2_naming_the_flag_and_the_fix(events, message, capsys):
    flags = [arg for event in events for arg in ("--worker-events", event)]
    assert main(["route", *WORKERS, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("corekv: error: ") and message in err and err.count("\n") == 1


def test_worker_events_name_each_workers_publisher(tiny_model_folder, tmp_path, monkeypatch):
    import uvicorn

    from corekv.router.workers import EventEndpoints

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    path = tmp_path / "route.yaml"
    path.write_text(f"model: {tiny_model_folder}\ndevice: cpu\n")
    assert main(["route", "--config", str(path), *WORKERS,
                 "--worker-events", "http://127.0.0.1:8002/=tcp://*:5557,replay=tcp://*:5558,topic=kv",
                 "--worker-events", "http://127.0.0.1:8001=ipc:///tmp/kv-pub"]) == 0
    workers = apps[0].state.router.pool.workers
    assert [w.named_events for w in workers] == [EventEndpoints("ipc:///tmp/kv-pub"),
                                                 EventEndpoints("tcp://*:5557", "tcp://*:5558", "kv")]


def test_workers_are_required(capsys):
    assert main(["route"]) == 2
    assert "--workers" in capsys.readouterr().err


def test_the_route_command_serves_requests(workers):
    """The real entry point: ``python -m corekv.cli route`` as a user starts it (its config names
    the workers' model, whose tokenizer it loads)."""
    router, url = start_route(["--config", str(workers[0].config_path), "--workers", workers[0].url,
                               workers[1].url])
    try:
        response = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                              timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        state = httpx.get(url + "/workers").json()
        assert state["policy"] == "cache_aware"
        assert sum(w["requests"] for w in state["workers"]) == 1
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_a_bad_worker_key_in_the_environment_exits_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("COREKV_WORKER_API_KEY", "")
    assert main(["route", *WORKERS]) == 2
    assert "$COREKV_WORKER_API_KEY: got an empty string" in capsys.readouterr().err


def test_the_route_command_takes_its_keys_from_flags_and_the_environment(keyed_worker):
    """The real entry point: the clients' key from $COREKV_API_KEY, the worker's from the flag."""
    router, url = start_route(["--config", str(keyed_worker.config_path), "--workers", keyed_worker.url,
                               "--worker-api-key", WORKER_KEY], COREKV_API_KEY=CLIENT_KEY)
    try:
        body = {"prompt": "Hello", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        response = httpx.post(url + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_route_loads_the_tokenizer_with_the_plugin_manager_it_read_the_config_with(
        tiny_model_folder, tmp_path, monkeypatch, capsys):
    import uvicorn

    import corekv.config.reader
    import corekv.plugin

    made, served, real = [], [], corekv.plugin.make_plugin_manager

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(corekv.plugin, "make_plugin_manager", counting)
    monkeypatch.setattr(corekv.config.reader, "make_plugin_manager", counting)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append(kwargs))
    path = tmp_path / "route.yaml"
    path.write_text(f"model: {tiny_model_folder}\ndevice: cpu\n")
    assert main(["route", "--config", str(path), *WORKERS]) == 0
    assert len(made) == 1 and served and "-> 2 workers" in capsys.readouterr().err


def test_load_tokenizer_encodes_like_the_engine(tiny_model_folder):
    from corekv.engine.models import load_model, load_tokenizer
    from corekv.engine.prompts import encode_prompt

    loaded = load_model(str(tiny_model_folder), device="cpu")
    tokenizer = load_tokenizer(str(tiny_model_folder))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for prompt in ("plain text", chat):
        assert encode_prompt(tokenizer, prompt) == loaded.encode_prompt(prompt)


def test_load_tokenizer_names_a_missing_model(tmp_path):
    from corekv.engine.models import load_tokenizer
    from corekv.errors import CoreKVError

    with pytest.raises(CoreKVError, match="neither a known alias"):
        load_tokenizer(str(tmp_path / "nowhere"))
