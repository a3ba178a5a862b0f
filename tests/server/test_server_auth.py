"""A server started with an API key answers only clients that send it as ``Authorization: Bearer``
(what the official ``openai`` client sends for its ``api_key``): every other request, to any
endpoint but ``/health``, is a 401 in OpenAI's error shape, refused before its body is read."""
from __future__ import annotations


import httpx
import openai
import pytest
from processes import head_only
from server_helpers import MODEL_ID

from corekv.server import BackgroundServer, build_app

KEY = "sk-corekv-test-0123456789"
PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("POST", "/admin/warm"), ("POST", "/admin/unpin"), ("GET", "/admin/stats"),
             ("GET", "/admin/info"), ("GET", "/metrics"), ("GET", "/v1/nothing")]


@pytest.fixture(scope="module")
def keyed(engine):
    with BackgroundServer(build_app(engine, served_model_name=MODEL_ID, api_key=KEY)) as server:
        yield server


def openai_client(server, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_the_openai_client_with_the_key_is_served(keyed):
    client = openai_client(keyed, KEY)
    completion = client.completions.create(model=MODEL_ID, prompt="hello", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL_ID, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant"
    assert [m.id for m in client.models.list()] == [MODEL_ID]


def test_the_openai_client_with_a_wrong_key_gets_a_401(keyed):
    with pytest.raises(openai.AuthenticationError) as info:
        openai_client(keyed, KEY + "x").completions.create(model=MODEL_ID, prompt="hello", max_tokens=1)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert KEY not in info.value.body["message"]


@pytest.mark.parametrize("method, path", PROTECTED)
@pytest.mark.parametrize("authorization", [None, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}",
                                           KEY, "Bearer", ""])
def test_every_endpoint_but_health_needs_the_key(keyed, method, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    response = httpx.request(method, keyed.url + path, headers=headers, json={"prompt": "hi"},
                             timeout=30)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]


@pytest.mark.parametrize("method, path, body", [("POST", "/admin/warm", {"prompt": "a shared prefix, a block long"}),
                                                ("POST", "/admin/unpin", {"prompt": "a shared prefix"}),
                                                ("GET", "/admin/stats", None), ("GET", "/admin/info", None)])
def test_the_admin_endpoints_answer_with_the_key(keyed, method, path, body):
    for scheme in ("Bearer", "bearer"):  # NOTE: the scheme's case does not matter (RFC 7235)
        response = httpx.request(method, keyed.url + path, json=body, timeout=30,
                                 headers={"Authorization": f"{scheme} {KEY}"})
        assert response.status_code == 200, response.text


def test_health_is_open(keyed):
    assert httpx.get(keyed.url + "/health", timeout=30).json() == {"status": "ok"}


def test_a_client_without_the_key_is_refused_before_its_body_is_read(keyed):
    answer = head_only(keyed.host, keyed.port, "Content-Type: application/json\r\nContent-Length: 1000000000\r\n")
    assert answer.startswith(b"HTTP/1.1 401 "), answer


@pytest.mark.parametrize("key, words", [("", "got an empty string"), ("two words", "' '"),
                                        ("caf\u00e9", "'\u00e9'"), (42, "got int")])
def test_a_key_that_cannot_be_sent_is_refused_when_the_app_is_built(engine, key, words):
    with pytest.raises(ValueError, match="api_key") as info:
        build_app(engine, api_key=key)
    assert words in str(info.value)
    if isinstance(key, str) and key:
        assert key not in str(info.value)  # NOTE: a key is a secret: errors never quote it
