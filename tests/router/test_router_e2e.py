"""The router in front of three real ``corekv serve`` workers (tests/router/conftest.py), driven
with the official ``openai`` client: cache-aware placement, stream passthrough, errors passed
through, retries when a worker is SIGKILLed mid-run, its return to the rotation, and KV events."""
from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from processes import free_port, wait_until
from router_helpers import BLOCK_SIZE, NUM_BLOCKS

from corekv.router.app import prompt_token_ids

SYSTEM = "{tenant}: you are this tenant's support assistant. Answer in one short sentence, politely. "


def client_for(router) -> openai.OpenAI:
    # NOTE: max_retries=0: a request that completes was completed by the router, not the client
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_id(worker_url: str) -> str:
    return httpx.get(worker_url + "/v1/models").json()["data"][0]["id"]


def requests_per_worker(router) -> list[int]:
    return [w["requests"] for w in router.workers_state()]


def test_prefix_sharing_prompts_go_to_one_worker(workers, make_router, tokenizer):
    router = make_router([w.url for w in workers])
    client, model = client_for(router), model_id(workers[0].url)
    for tenant in ("alpha", "beta"):
        system = SYSTEM.format(tenant=f"{tenant}-{uuid.uuid4().hex[:8]}")
        usages = [client.completions.create(model=model, prompt=system + f"Question {i}?",
                                            max_tokens=2).usage for i in range(4)]
        shared = len(tokenizer(system)["input_ids"]) // BLOCK_SIZE * BLOCK_SIZE
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        assert all(u.prompt_tokens_details.cached_tokens >= shared for u in usages[1:])
    # each tenant's four requests on one worker, the second tenant where nothing was cached
    assert sorted(requests_per_worker(router)) == [0, 4, 4]


def test_round_robin_spreads_a_shared_prefix_over_every_worker(workers, make_router):
    router = make_router([w.url for w in workers], policy="round_robin")
    client, model = client_for(router), model_id(workers[0].url)
    system = SYSTEM.format(tenant=uuid.uuid4().hex)
    usages = [client.completions.create(model=model, prompt=system + f"Question {i}?",
                                        max_tokens=2).usage for i in range(4)]
    assert [u.prompt_tokens_details.cached_tokens > 0 for u in usages] == [False, False, False, True]
    assert requests_per_worker(router) == [2, 1, 1]


def test_chat_stream_is_relayed_as_the_worker_sent_it(workers, make_router, tokenizer):
    router = make_router([w.url for w in workers])
    model = model_id(workers[0].url)
    messages = [{"role": "system", "content": SYSTEM.format(tenant=uuid.uuid4().hex)},
                {"role": "user", "content": "What is a KV cache?"}]
    direct = openai.OpenAI(base_url=workers[0].url + "/v1", api_key="unused", max_retries=0)
    expected = direct.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content
    chunks = list(client_for(router).chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    # the router tokenized the chat exactly as the worker's engine did
    routed_ids, _ = prompt_token_ids(tokenizer, {"messages": messages}, chat=True)
    assert chunks[-1].usage.prompt_tokens == len(routed_ids)


def test_sse_bytes_end_with_done(workers, make_router):
    router = make_router([w.url for w in workers])
    # NOTE: ignore_eos: the tiny random model may sample its EOS first, ending the stream after
    # one chunk; the test is about the stream's framing, so it asks for all three tokens
    body = {"model": model_id(workers[0].url), "prompt": "Once upon a time", "max_tokens": 3,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.parametrize("body", [b'{"prompt": "hi", "max_token": 4}', b"{not json"])
def test_worker_errors_pass_through_unchanged(workers, make_router, body):
    router = make_router([w.url for w in workers])
    headers = {"content-type": "application/json"}
    direct = httpx.post(workers[0].url + "/v1/completions", content=body, headers=headers)
    routed = httpx.post(router.url + "/v1/completions", content=body, headers=headers)
    assert direct.status_code == 400
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())


def test_models_health_and_workers(workers, make_router):
    dead = f"http://127.0.0.1:{free_port()}"
    router = make_router([workers[0].url, dead])
    assert httpx.get(router.url + "/v1/models").json() == httpx.get(workers[0].url + "/v1/models").json()
    health = httpx.get(router.url + "/health")
    assert (health.status_code, health.json()["healthy_workers"]) == (200, 1)
    state = {w["url"]: w for w in router.workers_state()}
    assert state[workers[0].url]["healthy"] and not state[dead]["healthy"]
    assert state[workers[0].url]["cache_view"] == "routed_prompts"


def test_no_live_worker_answers_503_health_and_502_requests(make_router):
    router = make_router([f"http://127.0.0.1:{free_port()}"])
    assert httpx.get(router.url + "/health").status_code == 503
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert response.status_code == 502
    assert "no worker answered" in response.json()["error"]["message"]


def test_killed_worker_loses_no_request_and_rejoins_after_restart(workers, make_router):
    """~15 s: twelve 200-token requests, and a worker restarted (it loads its model again)."""
    router = make_router([w.url for w in workers], health_interval_s=0.2, use_events=True)
    client, model = client_for(router), model_id(workers[0].url)
    victim = workers[1]

    def ask(i):
        return client.completions.create(model=model, prompt=f"{uuid.uuid4().hex} request {i}",
                                          max_tokens=200, extra_body={"ignore_eos": True})

    try:
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(ask, i) for i in range(12)]
            wait_until(lambda: router.workers_state()[1]["in_flight"] > 0, 60,
                       "a request in flight on the victim")
            victim.kill()
            completions = [f.result() for f in futures]
        assert all(c.usage.completion_tokens == 200 for c in completions)
        state = router.workers_state()[1]
        assert state["failures"] >= 1 and not state["healthy"] and state["in_flight"] == 0
    finally:
        if victim.process.poll() is not None:  # NOTE: killed (else the session keeps it as is)
            victim.start()
    wait_until(victim.is_ready, 120, "the restarted worker", 0.2)
    wait_until(lambda: router.workers_state()[1]["healthy"], 30, "the router to see it healthy")
    state = router.workers_state()[1]
    assert (state["tree_blocks"], state["cache_view"]) == (0, "events")
    ask(99)  # a new prefix goes where the least is cached: the restarted (empty) worker
    assert router.workers_state()[1]["requests"] == state["requests"] + 1
    # its new process's events feed the view again
    wait_until(lambda: router.workers_state()[1]["tree_blocks"] > 0, 30, "the restarted worker's events")


def test_kv_events_feed_the_cache_view(workers, make_router, tokenizer):
    router = make_router([w.url for w in workers], use_events=True)
    wait_until(lambda: all(w["cache_view"] == "events" for w in router.workers_state()), 30,
               "every worker's events subscribed")
    client, model = client_for(router), model_id(workers[0].url)
    system = SYSTEM.format(tenant=uuid.uuid4().hex)
    first = system + "Question 0?"
    client.completions.create(model=model, prompt=first, max_tokens=2)
    target = next(i for i, w in enumerate(router.workers_state()) if w["requests"] == 1)
    num_blocks = len(tokenizer(first)["input_ids"]) // BLOCK_SIZE
    wait_until(lambda: router.workers_state()[target]["tree_blocks"] >= num_blocks, 30,
               "the stored blocks' events")
    usage = client.completions.create(model=model, prompt=system + "Question 1?",
                                      max_tokens=2).usage
    assert router.workers_state()[target]["requests"] == 2
    shared = len(tokenizer(system)["input_ids"]) // BLOCK_SIZE * BLOCK_SIZE
    assert usage.prompt_tokens_details.cached_tokens >= shared


def test_kv_events_removals_keep_the_view_within_the_worker_pool(workers, make_router, tokenizer):
    router = make_router([workers[2].url], use_events=True)
    wait_until(lambda: router.workers_state()[0]["events_connected"], 30, "events subscribed")
    client, model = client_for(router), model_id(workers[0].url)
    prompts = [f"{uuid.uuid4().hex} " * 3 for _ in range(8)]  # 8 x 99 tokens: ~200 blocks > 128
    for prompt in prompts:
        client.completions.create(model=model, prompt=prompt, max_tokens=2)
    last_blocks = len(tokenizer(prompts[-1])["input_ids"]) // BLOCK_SIZE
    state = wait_until(lambda: (lambda s: s if s["tree_blocks"] >= last_blocks else None)(
        router.workers_state()[0]), 30, "the last prompt's events")
    # with only the stores, the view would hold every prompt's blocks (~200 of them)
    assert state["tree_blocks"] <= NUM_BLOCKS
    assert state["events"]["missed"] == 0
