"""Per-tenant keys (issue 37): a tenant's API key, not a field it chooses, sets its salt, so one
tenant never hits (or learns of) another's prefixes; ``/admin/*`` and ``/metrics`` (usage per
tenant, the KV-event endpoint) need the admin key. Real HTTP through the real app and engine (the
tiny model), tried as a hostile tenant would."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from server_helpers import MODEL_ID, tiny_config

from corekv.engine.llm_engine import Engine
from corekv.server import BackgroundServer, build_app
from corekv.server.tenants import TenantKeys

ADMIN_KEY, KEY_A, KEY_B = "admin-key-Zq8", "tenant-a-key-P3x", "tenant-b-key-L7w"
PROMPT = "a shared system prompt that is long enough to fill a few blocks of sixteen tokens each"


@pytest.fixture(scope="module")
def server(tiny_model_folder):
    keys = TenantKeys(ADMIN_KEY, {"tenant-a": KEY_A, "tenant-b": KEY_B})
    with Engine.from_config(tiny_config(tiny_model_folder)) as engine, \
            BackgroundServer(build_app(engine, served_model_name=MODEL_ID, api_keys=keys)) as server:
        yield server


def call(server, method: str, path: str, key: str | None, **kwargs) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)


def complete(server, key: str, **body) -> httpx.Response:
    return call(server, "POST", "/v1/completions", key,
                json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body})


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenants_prefix_is_its_own(server):
    assert cached(complete(server, KEY_A)) == 0
    assert cached(complete(server, KEY_A)) > 0  # its own prefix hits
    assert cached(complete(server, KEY_B)) == 0  # the same prompt under another key does not
    # the admin key is unscoped: it may name a tenant's salt (to warm it, say)
    assert cached(complete(server, ADMIN_KEY, cache_salt="tenant-a")) > 0


@pytest.mark.parametrize("salt", ["tenant-a", "anything-else"])
def test_a_tenant_cannot_choose_another_salt(server, salt):
    response = complete(server, KEY_B, cache_salt=salt)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["param"] == "cache_salt" and "set by its API key" in error["message"]
    assert cached(complete(server, KEY_B, cache_salt="tenant-b")) >= 0  # its own name is fine


@pytest.mark.parametrize("method, path", [("GET", "/admin/stats"), ("GET", "/admin/info"),
                                          ("GET", "/metrics"), ("POST", "/admin/warm"),
                                          ("POST", "/admin/unpin")])
def test_admin_paths_need_the_admin_key(server, method, path):
    response = call(server, method, path, KEY_A, json={"prompt": PROMPT})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "admin_only"
    assert "kv_events" not in response.text and "tenant-b" not in response.text


@pytest.mark.parametrize("key", [None, "not-a-key", KEY_A + "x", KEY_A[:-1]])
def test_an_unknown_key_is_a_401_that_quotes_nothing(server, key):
    response = call(server, "GET", "/v1/models", key)
    assert response.status_code == 401
    assert (key or "\0") not in response.text
    assert call(server, "GET", "/health", key).status_code == 200


def test_the_admin_reads_usage_per_tenant(server):
    complete(server, KEY_A)
    stats = call(server, "GET", "/admin/stats", ADMIN_KEY).json()
    tenants = stats["tenants"]
    assert set(tenants) == {"tenant-a", "tenant-b"}
    assert tenants["tenant-a"]["requests"] >= 1 and tenants["tenant-a"]["prompt_tokens"] > 0
    metrics = call(server, "GET", "/metrics", ADMIN_KEY)
    assert metrics.status_code == 200
    assert f'corekv_tenant_requests_total{{tenant="tenant-a"}} {tenants["tenant-a"]["requests"]}' \
        in metrics.text
    assert call(server, "GET", "/admin/info", ADMIN_KEY).status_code == 200


def test_streamed_requests_count_too(server):
    before = call(server, "GET", "/admin/stats", ADMIN_KEY).json()["tenants"]["tenant-b"]["requests"]
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY_B}"},
                      json={"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        list(response.iter_lines())
    after = call(server, "GET", "/admin/stats", ADMIN_KEY).json()["tenants"]["tenant-b"]["requests"]
    assert after == before + 1


@pytest.mark.parametrize("content, says", [
    ("admin: k1\ntenants: {a: k1}\n", "same key as another tenant or the admin"),
    ("admin: k1\ntenants: {'bad name!': k2}\n", "must be 1-64 letters"),
    ("admin: k1\n", "exactly the keys admin"),
    ("admin: k1\ntenants: {a: 'has space'}\n", "visible ASCII"),
    ("admin: [\n", "exactly the keys admin"),
])
def test_a_bad_key_file_names_the_field_and_never_a_key(tmp_path, content, says):
    path = tmp_path / "keys.yaml"
    path.write_text(content)
    with pytest.raises(ValueError) as caught:
        TenantKeys.from_file(path)
    assert says in str(caught.value)
    assert "k1" not in str(caught.value) and "k2" not in str(caught.value)


def test_serve_refuses_both_kinds_of_key(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"admin: {ADMIN_KEY}\ntenants: {{a: {KEY_A}}}\n")
    result = subprocess.run([sys.executable, "-m", "corekv.cli", "serve", "--api-key", "x",
                             "--api-keys", str(keys)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--api-key and --api-keys exclude each other" in result.stderr
