"""The OpenAI endpoints, driven by the official ``openai`` client against a real uvicorn server:
greedy answers equal ``engine.generate``, streams add up to the whole answer, ``n``, stop strings,
usage with cached tokens, and ``cache_salt`` isolation."""
from __future__ import annotations

import httpx
from server_helpers import MODEL_ID, sse_payloads

from corekv.engine.sampling import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_served_model(client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]


def test_greedy_completion_equals_engine_generate(client, reference):
    prompt = "The key-value cache keeps attention states"
    out = reference.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    response = client.completions.create(model=MODEL_ID, prompt=prompt, **GREEDY)
    assert response.object == "text_completion"
    assert response.choices[0].text == out.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(out.prompt_token_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(out.prompt_token_ids) + 12


def test_a_token_id_prompt_is_the_same_as_its_text(client, reference):
    prompt = "token ids or text"
    ids = reference.encode(prompt)
    by_text = client.completions.create(model=MODEL_ID, prompt=prompt, **GREEDY)
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_equals_engine_generate_on_the_messages(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = reference.generate([messages], SamplingParams(max_tokens=12, temperature=0.0,
                                                        ignore_eos=True))[0]
    response = client.chat.completions.create(model=MODEL_ID, messages=messages, **GREEDY)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == out.text
    assert response.usage.prompt_tokens == len(out.prompt_token_ids)


def test_streamed_deltas_add_up_to_the_whole_completion(client):
    prompt = "Streaming sends the text as it grows"
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_ID, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_streamed_chat_adds_up_and_ends_with_done(client, server):
    messages = [{"role": "user", "content": "Tell me about caches"}]
    whole = client.chat.completions.create(model=MODEL_ID, messages=messages, **GREEDY)
    body = {"model": MODEL_ID, "messages": messages, "stream": True, "temperature": 0,
            "max_tokens": 12, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r.iter_lines())
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads)
    assert text == whole.choices[0].message.content
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_n_completions_are_all_returned_and_streamed(client):
    prompt = "Several samples of one prompt"
    sampled = {"temperature": 1.0, "max_tokens": 10, "seed": 7, "n": 3, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, **sampled)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert whole.usage.completion_tokens == 30
    texts = {c.index: c.text for c in whole.choices}
    assert len(set(texts.values())) > 1, "seed + i per completion must give different samples"
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model=MODEL_ID, prompt=prompt, stream=True, **sampled):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def _stop_string(text: str) -> str:
    """Two characters from the middle of ``text`` whose first occurrence is there."""
    for start in range(3, len(text) - 2):
        candidate = text[start:start + 2]
        if "\ufffd" not in candidate and text.index(candidate) == start:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_cut_the_text_streamed_or_not(client):
    prompt = "Stop strings end a completion early"
    free = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0.0, max_tokens=24,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_string(free)
    kwargs = {"temperature": 0.0, "max_tokens": 24, "stop": [stop], "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, **kwargs)
    assert whole.choices[0].text == free[:free.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_ID, prompt=prompt, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_a_repeated_prompt_reports_cached_tokens_only_within_its_salt(client):
    prompt = "A long shared system prompt that spans several KV blocks of sixteen tokens. " * 2

    def cached(salt):
        response = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2,
                                             temperature=0.0, extra_body={"cache_salt": salt})
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached("tenant-b") > 0
