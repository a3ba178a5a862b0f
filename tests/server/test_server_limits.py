"""A request too big or too odd to be worth reading is refused before the server pays for it: a
body over the limit is a 413 before it is read whole (declared or chunked), a prompt longer than
the model could ever take is a 400 before it is tokenized, a body that is not valid JSON or is
nested too deep is a 400. None of them is a 500 or a traceback in the log, other clients are
served meanwhile, and the server goes on."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import processes
from server_helpers import MODEL_ID, logged_errors, tiny_config

from corekv.engine.llm_engine import Engine
from corekv.server import BackgroundServer, build_app
from corekv.server.limits import DEFAULT_MAX_REQUEST_BYTES
from corekv.server.protocol import MAX_JSON_DEPTH

JSON = {"content-type": "application/json"}


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def still_serving(server) -> None:
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "still there?",
                                                               "max_tokens": 2}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/admin/stats", timeout=30).status_code == 200


def head_only(server, headers: str) -> bytes:
    return processes.head_only(server.host, server.port, headers)


def test_a_50_mb_body_is_a_413_within_seconds_while_another_client_is_served(server, client):
    body = b'{"prompt": "' + b"x" * (50 * 1024 * 1024) + b'"}'
    with logged_errors() as errors, ThreadPoolExecutor(2) as pool:
        # NOTE: the timeout is the liveness bound: a server that reads the body first is far slower
        big = pool.submit(httpx.post, server.url + "/v1/completions", content=body, headers=JSON,
                          timeout=30)
        small = pool.submit(client.completions.create, model=MODEL_ID, prompt="meanwhile",
                            max_tokens=4, extra_body={"ignore_eos": True})
        response = big.result()
        assert small.result().usage.completion_tokens == 4
    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]
    assert errors == []
    still_serving(server)


def test_a_declared_length_over_the_limit_is_refused_before_any_body_byte(server):
    answer = head_only(server, f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n")
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b'"request_too_large"' in answer


def chunked(pieces):
    # NOTE: a generator body has no Content-Length: httpx sends it chunked
    yield from pieces


def test_a_chunked_body_over_the_limit_is_a_413(server):
    piece = b"y" * (64 * 1024)
    pieces = [b'{"prompt": "', *[piece] * (DEFAULT_MAX_REQUEST_BYTES // len(piece) + 1), b'"}']
    response = httpx.post(server.url + "/v1/completions", content=chunked(pieces), headers=JSON,
                          timeout=30)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    still_serving(server)


def test_a_chunked_body_within_the_limit_reaches_the_app_whole(server):
    body = json.dumps({"prompt": "sent in pieces", "max_tokens": 2, "temperature": 0}).encode()
    whole = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=30)
    pieces = [body[i:i + 5] for i in range(0, len(body), 5)]
    response = httpx.post(server.url + "/v1/completions", content=chunked(pieces), headers=JSON,
                          timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == whole.json()["usage"]
    assert response.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]


def test_the_limit_is_the_one_the_app_was_built_with(tiny_model_folder):
    with Engine.from_config(tiny_config(tiny_model_folder)) as engine, \
            BackgroundServer(build_app(engine, served_model_name=MODEL_ID, max_request_bytes=100)) as small:
        fits = httpx.post(small.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        over = httpx.post(small.url + "/v1/completions", json={"prompt": "h" * 100, "max_tokens": 1})
    assert fits.status_code == 200
    assert over.status_code == 413 and "limit of 100 bytes" in error_of(over)["message"]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4MiB"])
def test_a_bad_limit_is_refused_when_the_app_is_built(engine, value):
    with pytest.raises(ValueError, match="max_request_bytes must be an integer number of bytes >= 1"):
        build_app(engine, max_request_bytes=value)


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


def test_json_nested_100000_deep_is_a_400_without_a_traceback(server):
    with logged_errors() as errors:
        for path in ("/v1/completions", "/v1/chat/completions", "/admin/warm"):
            response = httpx.post(server.url + path, content=nested(100_000), headers=JSON, timeout=30)
            assert response.status_code == 400, (path, response.text)
            assert f"more than {MAX_JSON_DEPTH} levels" in error_of(response)["message"]
    assert errors == []
    still_serving(server)


@pytest.mark.parametrize("name, body", [
    # bodies that must get a 400 with nothing in the log: deep nesting, huge numbers, bad text
    ("nested below the recursion limit", nested(900)),
    ("messages nested below the recursion limit", b'{"messages": ' + b"[" * 900 + b"]" * 900 + b"}"),
    ("a lone surrogate in the prompt", b'{"prompt": "\\ud800"}'),
    ("a lone surrogate in a field name", b'{"prompt": "hi", "\\udfff": 1}'),
    ("a lone surrogate in the salt", b'{"prompt": "hi", "cache_salt": "a\\ud800"}'),
    ("an integer of 5000 digits", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}'),
    ("Infinity", b'{"prompt": "hi", "max_tokens": -Infinity}'),
    ("UTF-16", '{"prompt": "hi"}'.encode("utf-16")),
    ("Latin-1", b'{"prompt": "caf\xe9"}'),
    ("not JSON", b"{prompt: hi}"),
    ("empty", b""),
])
def test_a_malformed_body_is_a_400_without_a_traceback(server, name, body):
    with logged_errors() as errors:
        response = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=30)
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] == "invalid_request_error"
    assert errors == []


def test_a_surrogate_pair_is_valid_text(server):
    body = json.dumps({"prompt": "an emoji \U0001F600", "max_tokens": 1}).encode()  # \ud83d\ude00
    assert b"\\ud83d\\ude00" in body
    assert httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=30).status_code == 200


def test_a_body_sent_as_another_content_type_is_read_as_json(server):
    response = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                          headers={"content-type": "text/plain"}, timeout=30)
    assert response.status_code == 200


def test_a_prompt_longer_than_any_that_fits_is_refused_by_its_characters(server, engine):
    max_chars = server.app.state.async_engine.max_prompt_chars
    with logged_errors() as errors:
        for path, body in [("/v1/completions", {"prompt": "z" * (max_chars + 1)}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * (max_chars + 1)}]}),
                           ("/admin/warm", {"prompt": "z" * (max_chars + 1)})]:
            response = httpx.post(server.url + path, json=body, timeout=30)
            assert response.status_code == 400, (path, response.text)
            error = error_of(response)
            assert error["code"] == "request_rejected"
            assert f"a prompt of {max_chars + 1} characters cannot fit" in error["message"]
    assert errors == []
    # one within the bound is tokenized, and then its tokens are what is too long
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "z" * (engine.max_model_len + 1)},
                          timeout=30)
    assert response.status_code == 400
    assert "prompt tokens" in error_of(response)["message"]
