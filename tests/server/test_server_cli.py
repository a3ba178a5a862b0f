"""``corekv serve`` as a user runs it: flag errors, and a graceful SIGTERM that lets the request in
flight finish, exits 0 and leaves the prefix in the lmdb tier for the next process."""
from __future__ import annotations

import json
import signal
import socket

import httpx
import pytest
import yaml
from processes import ServeProcess, free_port, wait_until
from server_helpers import MODEL_ID, tiny_config

from corekv.cli import main
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

PROMPT = "A prefix long enough for several blocks, which the next process reloads from lmdb. " * 2


@pytest.fixture
def lmdb_config(tiny_model_folder, tmp_path):
    config = tiny_config(tiny_model_folder)
    config["cache"]["tiers"] = [{"type": "lmdb", "path": str(tmp_path / "kvstore"), "size": "64MiB"}]
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("args, words", [
    (["--port", "70000"], "--port"), (["--port", "http"], "--port"),
    (["--drain-timeout", "-1"], "--drain-timeout"), (["--drain-timeout", "inf"], "--drain-timeout"),
    (["--log-level", "loud"], "--log-level"), (["--served-model-name", " "], "--served-model-name"),
    (["--host", ""], "--host"),
    (["--api-key", ""], "--api-key: got an empty string"), (["--api-key", "my key"], "--api-key: the key has"),
    (["--max-request-bytes", "0"], "--max-request-bytes: got '0'; expected a size >= 1 byte"),
    (["--max-request-bytes", "lots"], "--max-request-bytes: got 'lots'"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(capsys, args, words):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("corekv: error: ") and "\n" not in err and words in err


@pytest.mark.parametrize("value, words", [("", "got an empty string"), ("tab\tkey", "'\\t'")])
def test_a_bad_key_in_the_environment_exits_2_naming_the_variable(capsys, monkeypatch, value, words):
    monkeypatch.setenv("COREKV_API_KEY", value)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("corekv: error: $COREKV_API_KEY: ") and words in err
    assert value not in err or not value


def test_the_default_body_limit_is_the_servers():
    from corekv.cli.args import DEFAULT_MAX_REQUEST_SIZE, size_arg
    from corekv.server.limits import DEFAULT_MAX_REQUEST_BYTES as SERVER_DEFAULT

    assert size_arg(DEFAULT_MAX_REQUEST_SIZE) == SERVER_DEFAULT


def test_a_taken_port_exits_1_before_loading_the_model(capsys, lmdb_config):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--config", str(lmdb_config), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err


def test_sigterm_drains_the_request_in_flight_then_flushes_to_lmdb(lmdb_config, tmp_path):
    """~9 s: a real ``corekv serve`` process (importing torch and transformers takes ~5 s here)."""
    server = ServeProcess(lmdb_config, free_port(), tmp_path / "serve.log", "--served-model-name", MODEL_ID,
                          "--drain-timeout", "60").start().wait_ready()
    try:
        body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 300, "stream": True,
                "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.process.send_signal(signal.SIGTERM)

            def refused():
                try:
                    httpx.get(server.url + "/health", timeout=1)
                except httpx.TransportError:
                    return True
                return False
            wait_until(refused, what="the server to stop accepting connections")
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == 300, [first, *rest[-3:]]
        assert server.process.wait(timeout=120) == 0
    finally:
        server.stop()
    log = server.output()
    assert "Waiting for connections to close" in log, log  # NOTE: SIGTERM came mid-request
    with Engine.from_config(str(lmdb_config)) as engine:
        out = engine.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.num_cached_tokens > 0
    assert out.cached_tokens_by_tier.get("lmdb", 0) > 0, out.cached_tokens_by_tier
