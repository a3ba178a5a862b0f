"""What the client sent wrong is an OpenAI-style 4xx body naming the field; a fault of the engine
is a 500 body for the requests it hit, and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import MODEL_ID, logged_errors, tiny_config

from corekv.engine.llm_engine import Engine
from corekv.plugin import hookimpl
from corekv.server import BackgroundServer, build_app


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kwargs)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("top_k", -3, "top_k"),
    ("min_p", 2, "min_p"),
    ("max_tokens", 0, "max_tokens"),
    ("n", 0, "SamplingParams.n"),
    ("seed", "x", "seed"),
    ("stop", [""], "stop"),
    ("stream", "yes", "stream"),
    ("cache_salt", 5, "cache_salt"),
    ("logprobs", 21, "logprobs must be null or an integer in [0, 20]"),
    ("logprobs", True, "logprobs must be null or an integer"),
    ("echo", "yes", "echo must be true or false"),
    ("presence_penalty", 3, "SamplingParams.presence_penalty must be a number in [-2, 2]"),
    ("frequency_penalty", "x", "SamplingParams.frequency_penalty"),
    ("repetition_penalty", 0, "SamplingParams.repetition_penalty must be a number in [0.01, 100]"),
    ("min_tokens", 99, "SamplingParams.min_tokens must be an integer in [0, max_tokens=16]"),
    ("logit_bias", {"x": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {"5": 101}, "biases in [-100, 100], got {5: 101}"),
    ("logit_bias", [1, 2], "logit_bias must be an object"),
    ("stream_options", {"include_usage": True}, "send stream: true with it"),
    ("best_of", 3, "best_of (server-side ranking of several completions; use n) is not supported"),
    ("suffix", "tail", "suffix (text insertion after the completion) is not supported"),
    ("max_token", 3, "did you mean 'max_tokens'"),
])
def test_a_bad_field_is_a_400_naming_it(server, field, value, words):
    response = post(server, "/v1/completions", json={"model": MODEL_ID, "prompt": "hi", field: value})
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert words in error["message"]


def test_the_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt="hi", temperature=-0.5)
    assert info.value.body["param"] == "temperature"


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b"null"])
def test_a_body_that_is_not_a_json_object_is_a_400(server, content):
    response = post(server, "/v1/completions", content=content)
    assert response.status_code == 400
    assert "JSON" in error_of(response)["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [[1, 2], "a"]}, "prompt"),
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({}, "prompt"),
])
def test_a_bad_prompt_is_a_400(server, body, param):
    response = post(server, "/v1/completions", json=body)
    assert response.status_code == 400
    assert error_of(response)["param"] == param


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "no role"}], [{"role": "user", "content": 3}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_chat_messages_are_a_400(server, messages):
    response = post(server, "/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert error_of(response)["param"].startswith("messages")


def test_token_ids_outside_the_vocabulary_are_a_400(server, engine):
    response = post(server, "/v1/completions", json={"prompt": [5, engine.model.vocab_size + 10]})
    assert response.status_code == 400
    assert str(engine.model.vocab_size + 10) in error_of(response)["message"]


def test_a_request_too_long_for_the_pool_is_a_400_before_any_stream(server, engine):
    capacity = engine.backend.num_blocks * engine.block_size
    for stream in (False, True):
        response = post(server, "/v1/completions",
                        json={"prompt": "hi", "max_tokens": capacity + 1, "stream": stream})
        assert response.status_code == 400
        error = error_of(response)
        assert error["code"] == "request_rejected" and "max_tokens" in error["message"]


def test_an_unknown_path_is_an_openai_style_404(server):
    response = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert response.status_code == 404
    error_of(response)


class ExplodesOnBoom:
    """A real plugin whose hook fails for prompts containing 'boom' (an engine fault mid-step)."""

    @hookimpl
    def corekv_on_request_finished(self, output) -> None:
        if "boom" in str(output.prompt):
            raise RuntimeError("plugin exploded")


def test_an_engine_fault_fails_its_request_with_a_500_and_the_server_goes_on(tiny_model_folder):
    with Engine.from_config(tiny_config(tiny_model_folder), plugins=(ExplodesOnBoom(),)) as engine, \
            BackgroundServer(build_app(engine, served_model_name=MODEL_ID)) as server:
        body = {"prompt": "boom", "max_tokens": 3}
        with logged_errors() as errors:
            response = post(server, "/v1/completions", json=body)
        assert response.status_code == 500
        # a fault of the server is logged with its traceback (what a client's mistake never is)
        assert any(r.exc_info and "plugin exploded" in str(r.exc_info[1]) for r in errors), errors
        error = error_of(response)
        assert error["type"] == "server_error" and "plugin exploded" in error["message"]
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"server_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        fine = post(server, "/v1/completions", json={"prompt": "fine", "max_tokens": 3})
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
