"""Every OpenAI request shape through the official ``openai`` client against a real uvicorn server:
logprobs in the chat and the completions shape (whole and streamed, equal to the engine's), the
penalties and logit_bias, batches of prompts, echo, ``n`` with streaming and the usage chunk, and
a clear 400 naming the field for what the server cannot do (tools, structured outputs, ...)."""
from __future__ import annotations

import httpx
import openai
import pytest
import yaml
from processes import ServeProcess, free_port
from server_helpers import MODEL_ID, sse_payloads, tiny_config

from corekv.engine.sampling import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "What does a KV cache keep?"}]
PROMPT = "The key-value cache keeps attention states"


def reference_logprobs(reference, prompt, num_top, **params):
    out = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                      logprobs=num_top, **params))[0]
    return out.outputs[0]


def texts(reference):
    from corekv.server.logprobs import TokenTexts

    return TokenTexts(reference.model.tokenizer)


# -- logprobs ------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_engines_in_openais_chat_shape(client, reference):
    expected = reference_logprobs(reference, MESSAGES, 3)
    tokens = texts(reference)
    response = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, logprobs=True,
                                              top_logprobs=3, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 8
    for entry, want in zip(content, expected.logprobs):
        assert entry.token == tokens.text(want.token_id)
        assert entry.bytes == list(tokens.bytes(want.token_id))
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [tokens.text(i) for i, _ in want.top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the best, or tied
    # the tokens' bytes join into the answer's text
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == response.choices[0].message.content


def test_completion_logprobs_are_the_engines_in_the_legacy_shape(client, reference):
    expected = reference_logprobs(reference, PROMPT, 2)
    tokens = texts(reference)
    response = client.completions.create(model=MODEL_ID, prompt=PROMPT, logprobs=2, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [tokens.text(t) for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-4)
    for best, want in zip(logprobs.top_logprobs, expected.logprobs):
        names = {tokens.text(i) for i, _ in want.top} | {tokens.text(want.token_id)}
        assert set(best) == names and len(best) <= 3  # the top 2 and the sampled token
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(response.choices[0].text)


def test_streamed_logprobs_add_up_to_the_whole_answers(client):
    whole = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, logprobs=True,
                                           top_logprobs=2, **GREEDY)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, logprobs=True,
                                                top_logprobs=2, stream=True, **GREEDY):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    content = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)

    whole = client.completions.create(model=MODEL_ID, prompt=PROMPT, logprobs=1, **GREEDY).choices[0]
    tokens, offsets = [], []
    for chunk in client.completions.create(model=MODEL_ID, prompt=PROMPT, logprobs=1, stream=True,
                                           **GREEDY):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


# -- penalties -----------------------------------------------------------------------------------
def test_penalties_and_logit_bias_answer_what_the_engine_answers(client, reference):
    params = {"presence_penalty": 0.5, "frequency_penalty": 0.8, "repetition_penalty": 1.4,
              "min_tokens": 4}
    expected = reference.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0,
                                                           ignore_eos=True, **params))[0]
    response = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, temperature=0.0, max_tokens=8, presence_penalty=0.5,
        frequency_penalty=0.8, extra_body={"ignore_eos": True, "repetition_penalty": 1.4, "min_tokens": 4})
    assert response.choices[0].text == expected.text
    biased = client.completions.create(model=MODEL_ID, prompt=PROMPT, logit_bias={"77": 100}, **GREEDY)
    assert biased.choices[0].text == reference.model.tokenizer.decode([77] * 8)


# -- batches, echo, n ----------------------------------------------------------------------------
def test_a_batch_of_prompts_answers_each_as_alone_indexed_by_prompt_then_completion(client, reference):
    prompts = ["first prompt", "a second, longer prompt", "3"]
    alone = [client.completions.create(model=MODEL_ID, prompt=p, **GREEDY) for p in prompts]
    batch = client.completions.create(model=MODEL_ID, prompt=prompts, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 24
    ids = [reference.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]

    sampled = {"temperature": 1.0, "max_tokens": 6, "seed": 3, "n": 2, "extra_body": {"ignore_eos": True}}
    two_each = client.completions.create(model=MODEL_ID, prompt=prompts[:2], **sampled)
    assert [c.index for c in two_each.choices] == [0, 1, 2, 3]  # prompt i, completion j: i * n + j
    second = client.completions.create(model=MODEL_ID, prompt=prompts[1], **sampled)
    assert [c.text for c in two_each.choices[2:]] == [c.text for c in second.choices]


def test_echo_prepends_the_prompt_text_whole_and_streamed(client, reference):
    plain = client.completions.create(model=MODEL_ID, prompt=PROMPT, **GREEDY).choices[0].text
    echoed = client.completions.create(model=MODEL_ID, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain
    by_ids = client.completions.create(model=MODEL_ID, prompt=reference.encode(PROMPT), echo=True, **GREEDY)
    assert by_ids.choices[0].text == PROMPT + plain
    chunks = list(client.completions.create(model=MODEL_ID, prompt=[PROMPT, PROMPT], echo=True,
                                            stream=True, **GREEDY))
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {0: PROMPT + plain, 1: PROMPT + plain}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_streams_every_choice_indexed_and_ends_with_one_usage_chunk(client, kind):
    sampled = {"temperature": 1.0, "max_tokens": 6, "seed": 11, "n": 3, "extra_body": {"ignore_eos": True}}
    if kind == "chat":
        create, args = client.chat.completions.create, {"messages": MESSAGES}
        text_of = lambda choice: choice.message.content  # noqa: E731
        delta_of = lambda choice: choice.delta.content or ""  # noqa: E731
    else:
        create, args = client.completions.create, {"prompt": PROMPT}
        text_of = delta_of = lambda choice: choice.text  # noqa: E731
    whole = create(model=MODEL_ID, **args, **sampled)
    chunks = list(create(model=MODEL_ID, **args, stream=True, stream_options={"include_usage": True},
                         **sampled))
    streamed, finished = {0: "", 1: "", 2: ""}, []
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        streamed[choice.index] += delta_of(choice)
        if choice.finish_reason:
            finished.append(choice.index)
    assert streamed == {c.index: text_of(c) for c in whole.choices}
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_streamed_batch_sends_one_usage_chunk_over_all_prompts(server):
    body = {"model": MODEL_ID, "prompt": ["one", "two", "three"], "stream": True, "max_tokens": 4,
            "ignore_eos": True, "n": 2, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        payloads = sse_payloads(r.iter_lines())
    usages = [p for p in payloads if p.get("usage")]
    assert len(usages) == 1 and usages[0] is payloads[-1]
    assert usages[0]["usage"]["completion_tokens"] == 24
    finished = [c["index"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(6))


# -- what the server cannot do -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_chat_features_the_server_cannot_serve_are_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert param in info.value.body["message"]


def test_tool_messages_are_a_400_naming_the_message(client):
    messages = [*MESSAGES, {"role": "assistant", "content": None,
                            "tool_calls": [{"id": "1", "type": "function",
                                            "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "1", "content": "42"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2)
    assert info.value.body["param"] == "messages[1].tool_calls"


def test_echo_with_logprobs_is_a_400_saying_why(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, echo=True, logprobs=1, max_tokens=2)
    assert info.value.body["param"] == "echo"
    assert "prompt's log-probabilities" in info.value.body["message"]


def test_a_prompt_of_a_batch_that_cannot_fit_is_a_400_naming_it_and_nothing_runs(client, server, engine):
    capacity = engine.backend.num_blocks * engine.block_size
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=["fine", "x" * (capacity + 10)], max_tokens=2)
    assert info.value.body["message"].startswith("prompt[1]: ")
    assert info.value.body["code"] == "request_rejected"
    stats = httpx.get(server.url + "/admin/stats", timeout=10).json()
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_a_logit_bias_token_outside_the_vocabulary_is_a_400(client, engine):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2,
                                  logit_bias={str(engine.model.vocab_size): 1})
    assert info.value.body["param"] == "logit_bias" and info.value.body["code"] == "request_rejected"


# -- a real corekv serve -------------------------------------------------------------------------
def test_corekv_serve_answers_logprobs_batches_and_streamed_usage(tiny_model_folder, tmp_path):
    """~10 s: the shapes through the installed ``corekv serve`` command, as a user runs it."""
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_model_folder)))
    server = ServeProcess(path, free_port(), tmp_path / "serve.log", "--served-model-name", MODEL_ID)
    try:
        server.start().wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, logprobs=True,
                                              top_logprobs=2, **GREEDY)
        assert len(chat.choices[0].logprobs.content) == 8
        batch = client.completions.create(model=MODEL_ID, prompt=["a", "b"], logprobs=1, echo=False, **GREEDY)
        assert [len(c.logprobs.tokens) for c in batch.choices] == [8, 8]
        chunks = list(client.completions.create(model=MODEL_ID, prompt=["a", "b"], stream=True, n=2,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert chunks[-1].usage.completion_tokens == 32
        assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2, 3}
    finally:
        server.stop()


# -- rendering -----------------------------------------------------------------------------------
def test_a_bpe_tokenizers_token_bytes_join_into_the_text_and_offsets_point_at_each_token():
    """SmolLM2's byte-level BPE (its tokenizer only): a character split across tokens shows as
    U+FFFD in ``token`` but its bytes are exact, and ``text_offset`` counts whole characters."""
    from corekv.engine.models import load_tokenizer
    from corekv.engine.outputs import TokenLogprobs
    from corekv.server.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    text = "héllo 🦙 wörld, naïve café"
    ids = tokenizer(text)["input_ids"]
    tokens = TokenTexts(tokenizer)
    assert b"".join(tokens.bytes(i) for i in ids).decode("utf-8") == text
    assert any("\ufffd" in tokens.text(i) for i in ids), "the llama emoji must span several tokens here"
    logprobs = [TokenLogprobs(i, -1.0, ((i, -1.0),)) for i in ids]
    rendered = CompletionLogprobs(tokens).render(logprobs)
    whole_chars = [len(b"".join(tokens.bytes(i) for i in ids[:k]).decode("utf-8", errors="ignore"))
                   for k in range(len(ids))]
    assert rendered["text_offset"] == whole_chars
    on_boundary = [k for k in range(len(ids)) if "\ufffd" not in tokenizer.decode(ids[:k])]
    assert len(on_boundary) < len(ids)
    for k in on_boundary:  # where a token starts a character: the length of the text before it
        assert rendered["text_offset"][k] == len(tokenizer.decode(ids[:k]))
    chat = chat_logprobs(logprobs, tokens)
    assert [e["bytes"] for e in chat["content"]] == [list(tokens.bytes(i)) for i in ids]
