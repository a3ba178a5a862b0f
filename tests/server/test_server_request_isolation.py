"""No request can fail another's (issue 37): an attacker's value in any sampling field is a 400
naming the field while innocent requests stream on undisturbed; and a request whose sampling
fails in the engine anyway gets the error alone, the requests in its step finishing as if it had
never come. Real HTTP through the real app and engine thread (the tiny model)."""
from __future__ import annotations

import asyncio
import math
import threading

import httpx
import pytest
from server_helpers import MODEL_ID, sse_payloads

from corekv.engine.sampling import SamplingParams
from corekv.server.async_engine import EngineStepError

INNOCENT_PROMPTS = ["an innocent prompt", "another innocent one", "a third, longer innocent prompt"]
INNOCENT_BODY = {"model": MODEL_ID, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                 "stream": True}

#: (field, attacker's value, extra body fields); each must be a 400 with param == field
POISON = [
    ("temperature", 10**20, {}), ("temperature", 10**400, {}), ("temperature", 1e-300, {}),
    ("temperature", -1, {}), ("top_p", 10**20, {}), ("top_p", 1e-400, {}), ("top_k", -(10**20), {}),
    ("min_p", 10**20, {}), ("seed", 2**64, {}), ("seed", -(10**30), {}),
    ("max_tokens", 10**30, {}), ("n", 10**20, {}), ("min_tokens", 10**20, {}),
    ("presence_penalty", 10**20, {}), ("frequency_penalty", -(10**400), {}),
    ("repetition_penalty", 10**20, {}), ("repetition_penalty", 1e-300, {}),
    ("repetition_penalty", 10**400, {}), ("logit_bias", {"5": 10**20}, {}),
    ("logit_bias", {"9" * 40: 1}, {}), ("logprobs", 10**20, {}), ("stop_token_ids", [-(10**30)], {}),
    ("stop", [10**20], {}), ("ignore_eos", 10**20, {}),
    # costs every step of every request pays: bounded (4,000 stop strings were ~5 ms a token)
    ("stop", ["x"] * 17, {}), ("stop", ["x" * 1025], {}), ("stop_token_ids", list(range(257)), {}),
    ("logit_bias", {str(i): 1 for i in range(1025)}, {}),
]


def stream_text(url: str, prompt: str, started: threading.Event, results: dict) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**INNOCENT_BODY, "prompt": prompt},
                      timeout=120) as response:
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            started.set()
        results[prompt] = (response.status_code, lines)


@pytest.fixture(scope="module")
def expected(reference):
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    return {p: o.text for p, o in zip(INNOCENT_PROMPTS, reference.generate(INNOCENT_PROMPTS, params))}


def run_beside_innocents(server, poison) -> tuple[dict, object]:
    """Start the innocent streams, run ``poison()`` once each has produced a chunk, let them end."""
    results: dict = {}
    events = [threading.Event() for _ in INNOCENT_PROMPTS]
    threads = [threading.Thread(target=stream_text, args=(server.url, p, e, results))
               for p, e in zip(INNOCENT_PROMPTS, events)]
    for thread in threads:
        thread.start()
    for event in events:
        assert event.wait(60), "an innocent stream produced nothing"
    outcome = poison()
    for thread in threads:
        thread.join(120)
    return results, outcome


def assert_innocents_whole(results: dict, expected: dict) -> None:
    for prompt in INNOCENT_PROMPTS:
        status, lines = results[prompt]
        payloads = sse_payloads(lines)
        assert status == 200 and all("error" not in p for p in payloads), payloads[-1:]
        text = "".join(p["choices"][0]["text"] for p in payloads if p.get("choices"))
        assert text == expected[prompt]
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("field, value, extra", POISON,
                         ids=[f"{f}={str(v)[:12]}" for f, v, _ in POISON])
def test_an_attackers_value_is_a_400_and_innocent_requests_go_on(server, expected, field, value, extra):
    body = {"model": MODEL_ID, "prompt": "poison", field: value, **extra}

    def poison():
        return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    results, response = run_beside_innocents(server, poison)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert len(error["message"]) < 600  # one readable line, not a 400-digit echo
    assert_innocents_whole(results, expected)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 10**20), ("temperature", math.nan)])
def test_a_request_failing_inside_the_step_fails_alone(server, expected, field, value):
    """The second wall: a value the checks missed (written past them, since they now hold) fails
    only its own request, with the error; the innocent streams in its steps finish whole."""
    runner = server.app.state.async_engine
    params = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    object.__setattr__(params, field, value)

    async def submit_poisoned():
        handle = await runner.submit("poison", params)
        with pytest.raises(EngineStepError, match="sampling this request failed") as info:
            await handle.result()
        return info.value

    results, error = run_beside_innocents(server, lambda: asyncio.run(submit_poisoned()))
    assert isinstance(error, EngineStepError)
    assert_innocents_whole(results, expected)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
