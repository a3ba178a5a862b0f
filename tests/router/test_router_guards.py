"""The router guards itself as a worker does: with a key, a client without it gets a 401 on every
endpoint but ``/health``; a body over its limit is a 413 before it is read. Keys are per hop: the
router sends workers the worker key (health checks and ``/admin/info`` reads too), never the
client's."""
from __future__ import annotations


import httpx
import openai
import pytest
from processes import head_only, wait_until
from router_helpers import CLIENT_KEY, WORKER_KEY


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def workers_state(router, key: str = CLIENT_KEY) -> list[dict]:
    return httpx.get(router.url + "/workers", headers=bearer(key), timeout=30).json()["workers"]


def model_of(worker) -> str:
    return httpx.get(worker.url + "/v1/models", headers=bearer(WORKER_KEY), timeout=30).json()["data"][0]["id"]


@pytest.fixture
def keyed_router(keyed_worker, make_router):
    router = make_router([keyed_worker.url], api_key=CLIENT_KEY, worker_api_key=WORKER_KEY)
    wait_until(lambda: workers_state(router)[0]["model"] is not None, 30, "the worker's /admin/info read")
    return router


def test_a_keyed_worker_is_reached_through_a_router_with_its_key(keyed_worker, keyed_router):
    client = openai.OpenAI(base_url=keyed_router.url + "/v1", api_key=CLIENT_KEY, max_retries=0,
                           timeout=120)
    model = model_of(keyed_worker)
    completion = client.completions.create(model=model, prompt="through the router", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [model]
    state = workers_state(keyed_router)[0]
    # the health checks read /admin/info with the worker key: the model is known
    assert state["healthy"] and state["model"] == model and state["requests"] == 2


def test_a_client_without_the_routers_key_gets_a_401(keyed_worker, keyed_router):
    model = model_of(keyed_worker)
    for key in ("none", WORKER_KEY, CLIENT_KEY + "x"):  # NOTE: the worker's key is not the router's
        client = openai.OpenAI(base_url=keyed_router.url + "/v1", api_key=key, max_retries=0,
                               timeout=60)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=1)
        assert info.value.body["code"] == "invalid_api_key"
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/workers")):
        response = httpx.request(method, keyed_router.url + path, timeout=30)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert workers_state(keyed_router)[0]["requests"] == 0  # nothing reached the worker


def test_health_is_open(keyed_router):
    response = httpx.get(keyed_router.url + "/health", timeout=30)
    assert response.status_code == 200 and response.json()["healthy_workers"] == 1


def test_the_clients_key_is_not_forwarded(keyed_worker, make_router):
    """A router without a worker key in front of a keyed worker: a client sending the worker's key
    still gets the worker's 401, since that header is the router's, and /admin/info is unread."""
    router = make_router([keyed_worker.url])
    wait_until(lambda: httpx.get(router.url + "/health", timeout=30).status_code == 200, 30,
               "the worker healthy (/health needs no key)")
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                          headers=bearer(WORKER_KEY), timeout=60)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert router.workers_state()[0]["model"] is None


def test_a_body_over_the_routers_limit_is_a_413_before_it_is_read(make_router, workers):
    router = make_router([workers[0].url], max_request_bytes=64 * 1024)
    answer = head_only("127.0.0.1", int(router.url.rsplit(":", 1)[1]),
                       "Content-Type: application/json\r\nContent-Length: 50000000\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ") and b"limit of 65536 bytes" in answer, answer

    def chunked():
        yield b'{"prompt": "'
        for _ in range(2):
            yield b"y" * (64 * 1024)
        yield b'"}'
    response = httpx.post(router.url + "/v1/completions", content=chunked(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert router.workers_state()[0]["requests"] == 0  # neither reached the worker
    ok = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_json_nested_100000_deep_is_the_workers_400(make_router, workers):
    router = make_router([workers[0].url])
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(router.url + "/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "nested more than" in response.json()["error"]["message"]
    ok = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_a_prompt_longer_than_any_worker_takes_is_not_tokenized(tokenizer):
    from corekv.router.app import prompt_token_ids

    payload = {"prompt": "abc", "cache_salt": "t"}
    assert prompt_token_ids(tokenizer, payload, chat=False, max_prompt_chars=2) == ([], "t")
    ids, _ = prompt_token_ids(tokenizer, payload, chat=False, max_prompt_chars=3)
    assert ids == list(tokenizer("abc")["input_ids"])
    chat = {"messages": [{"role": "user", "content": "abc"}]}
    assert prompt_token_ids(tokenizer, chat, chat=True, max_prompt_chars=2) == ([], None)
    assert prompt_token_ids(tokenizer, chat, chat=True, max_prompt_chars=3)[0] != []


def test_with_an_admin_key_only_it_reads_the_workers_traffic(make_router):
    """``/workers`` shows each worker's requests: a client's key must not show what the other
    clients send (issue 37)."""
    admin = "router-admin-key-9Xq"
    router = make_router(["http://127.0.0.1:9"], api_key=CLIENT_KEY, admin_key=admin)
    for key, status in ((None, 401), (CLIENT_KEY, 401), (admin + "x", 401), (admin, 200)):
        response = httpx.get(router.url + "/workers", headers=bearer(key) if key else {}, timeout=30)
        assert response.status_code == status, (key, response.text)
    assert "workers" in response.json()
    # the admin key opens /workers only; the API still needs the clients' key
    assert httpx.get(router.url + "/v1/models", headers=bearer(admin), timeout=30).status_code == 401
