"""How much of a worker's SSE stream the router reads before it answers the client: the opening
(chat's role announcement, sent before the prompt is computed) and the first real event, so a
worker that dies during the prefill can still be replaced. Fed the bytes a corekv server sends."""
from __future__ import annotations

import asyncio
import json

from corekv.router.app import _opening


def event(delta: dict, finish_reason=None) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def read_opening(pieces: list[bytes]) -> tuple[bytes, list[bytes]]:
    async def run():
        async def chunks():
            for piece in pieces:
                yield piece
        iterator = chunks()
        first = await _opening(iterator)
        return first, [piece async for piece in iterator]
    return asyncio.run(run())


ROLE = event({"role": "assistant", "content": ""})
TOKEN = event({"content": "Hel"})
MORE = event({"content": "lo"})
DONE = b"data: [DONE]\n\n"


def test_the_role_announcement_is_held_back_until_the_first_token():
    first, rest = read_opening([ROLE, TOKEN, MORE, DONE])
    assert first == ROLE + TOKEN and rest == [MORE, DONE]


def test_a_completion_stream_is_answered_at_its_first_event():
    first, rest = read_opening([TOKEN, MORE, DONE])
    assert first == TOKEN and rest == [MORE, DONE]


def test_an_event_split_across_chunks_is_read_whole():
    first, rest = read_opening([ROLE[:10], ROLE[10:] + TOKEN[:7], TOKEN[7:], DONE])
    assert first == ROLE + TOKEN and rest == [DONE]


def test_a_stream_with_only_an_opening_and_a_finish_ends_at_the_finish():
    finish = event({}, finish_reason="length")
    first, rest = read_opening([ROLE, finish, DONE])
    assert first == ROLE + finish and rest == [DONE]


def test_a_stream_that_ends_early_is_returned_whole():
    first, rest = read_opening([ROLE])
    assert first == ROLE and rest == []
