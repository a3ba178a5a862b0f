"""``corekv route`` in front of servers that speak the OpenAI API as vLLM does, without vLLM: each
stub serves ``/health``, ``/v1/models`` and ``/v1/completions`` (streamed too) but no
``/admin/info``, and publishes KV events in vLLM 0.32's shape (int hashes, its own block size,
a salted chain's salt in clear in its first block's extra keys) with a replay socket. The real
route command names their publishers with ``--worker-events``. The same against a real vLLM
server: tests/vllm/test_vllm_route.py."""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from processes import free_port, wait_until
from router_helpers import BLOCK_SIZE, RouterThread, start_route

from corekv.engine.prompts import encode_prompt
from corekv.kv_event_wire import BlockStored, KVEventBatch, encode_batch

VLLM_BLOCK = 8     # the stubs' block size (vLLM's --block-size); the router's config says BLOCK_SIZE
SYSTEM = ("You are the support assistant of a company that sells garden tools. Answer politely, in "
          "one short sentence, and never promise a delivery date. Spades, rakes, hoes, trowels and "
          "watering cans are in stock; lawn mowers are sold out until spring. ") * 2


class VLLMStub:
    """What the router sees of a vLLM server: the OpenAI endpoints (each completion is `` ok``)
    and, per prompt, a BlockStored of its new full blocks as vLLM's block pool publishes it."""

    def __init__(self, tokenizer, folder: Path, name: str):
        import zmq

        self.tokenizer = tokenizer
        self.endpoint, self.replay_endpoint = f"ipc://{folder}/{name}-pub", f"ipc://{folder}/{name}-replay"
        self.ctx = zmq.Context()
        self.pub, self.replay = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind(self.endpoint)
        self.replay.bind(self.replay_endpoint)
        self.salts: list[str | None] = []          # of the completions it was sent, in order
        self.num_replays = 0
        self._buffer: list[tuple[int, bytes]] = []
        self._hashes: set[int] = set()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._replayer = threading.Thread(target=self._serve_replay, daemon=True)
        self._replayer.start()
        self.server = RouterThread(self._app(), free_port()).__enter__()   # NOTE: any app on a thread
        self.url = self.server.url

    def close(self) -> None:
        self.server.__exit__(None, None, None)
        self._stop.set()
        self._replayer.join(10)
        self.ctx.destroy(linger=0)

    def _app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def health(request):
            return Response(status_code=200)     # vLLM's: an empty 200

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model",
                                                             "owned_by": "vllm"}]})

        async def completions(request):
            body = await request.json()
            ids = encode_prompt(self.tokenizer, body["prompt"])
            self.salts.append(body.get("cache_salt"))
            num_cached = self._store(ids, body.get("cache_salt"))
            choice = {"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}
            answer = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
                      "choices": [choice]}
            if body.get("stream"):
                async def sse():
                    yield f"data: {json.dumps(answer)}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(sse(), media_type="text/event-stream")
            return JSONResponse({**answer, "usage": {
                "prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1,
                "prompt_tokens_details": {"cached_tokens": num_cached}}})

        return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                                 Route("/v1/completions", completions, methods=["POST"])])

    def _store(self, ids: list[int], salt: str | None) -> int:
        """Cache the prompt's full blocks (hashes chained over the salt, as vLLM's), publish the
        new ones; returns the tokens that were cached already."""
        hashes, parent = [], None
        for start in range(0, len(ids) - VLLM_BLOCK + 1, VLLM_BLOCK):
            key = repr((parent, ids[start:start + VLLM_BLOCK], salt if start == 0 else None))
            parent = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
            hashes.append(parent)
        num_cached = next((i for i, h in enumerate(hashes) if h not in self._hashes), len(hashes))
        new = hashes[num_cached:]
        if new:
            self._hashes.update(new)
            event = BlockStored(new, hashes[num_cached - 1] if num_cached else None,
                                ids[num_cached * VLLM_BLOCK:len(hashes) * VLLM_BLOCK], VLLM_BLOCK,
                                medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention",
                                extra_keys=[(salt,) if salt and num_cached == i == 0 else None
                                            for i in range(len(new))])
            payload = encode_batch(KVEventBatch(time.time(), [event], data_parallel_rank=0))
            with self._lock:
                seq = len(self._buffer)
                self._buffer.append((seq, payload))
            self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        return num_cached * VLLM_BLOCK

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.replay.poll(50):
                continue
            client, _, start = self.replay.recv_multipart()
            with self._lock:
                batches = [b for b in self._buffer if b[0] >= int.from_bytes(start, "big")]
            for seq, payload in batches:
                self.replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            self.num_replays += 1


@pytest.fixture
def stubs(tokenizer):
    pytest.importorskip("zmq")
    folder = Path(tempfile.mkdtemp(prefix="corekv-rv-"))   # NOTE: ipc paths must stay short
    made = []
    try:
        made.extend(VLLMStub(tokenizer, folder, f"w{i}") for i in range(2))
        yield made
    finally:
        for stub in made:
            stub.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_route_in_front_of_vllm_style_servers_follows_their_events_per_tenant(stubs, tokenizer,
                                                                             tiny_model_folder, tmp_path):
    config = tmp_path / "route.yaml"
    config.write_text(yaml.safe_dump({"model": str(tiny_model_folder), "device": "cpu",
                                      "engine": {"block_size": BLOCK_SIZE}}))
    named = [arg for s in stubs for arg in
             ("--worker-events", f"{s.url}={s.endpoint},replay={s.replay_endpoint},topic=kv")]
    router, url = start_route(["--config", str(config), "--workers", *[s.url for s in stubs], *named])

    def workers():
        return httpx.get(url + "/workers", timeout=10).json()["workers"]

    try:
        # subscribed (and replayed from the start) as the workers came up; no /admin/info: vLLM
        wait_until(lambda: all(s.num_replays for s in stubs), 30, "the router's replay requests")
        time.sleep(0.3)   # NOTE: the live subscription travels beside the replay request
        assert [(w["kind"], w["cache_view"], w["events_connected"], w["healthy"]) for w in workers()] == \
            [("vllm", "events", True, True)] * 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["stub"]

        prompt = SYSTEM + "Which rake suits a small lawn?"
        reply = client.completions.create(model="stub", prompt=prompt, max_tokens=1,
                                          extra_body={"cache_salt": "tenant-a"})
        assert reply.choices[0].text == " ok"
        [home] = [i for i, s in enumerate(stubs) if s.salts == ["tenant-a"]]
        num_blocks = len(encode_prompt(tokenizer, prompt)) // VLLM_BLOCK
        wait_until(lambda: workers()[home]["tree_blocks"] == num_blocks, 30, "the stub's events")
        assert workers()[home]["block_size"] == VLLM_BLOCK   # the events' block size, not the config's

        # the tenant's next prompt follows its prefix there, streamed back as the stub sent it
        question = SYSTEM + "Do you sell lawn mowers?"
        stream = client.completions.create(model="stub", prompt=question, max_tokens=1, stream=True,
                                           extra_body={"cache_salt": "tenant-a"})
        assert "".join(chunk.choices[0].text for chunk in stream) == " ok"
        assert stubs[home].salts == ["tenant-a", "tenant-a"]
        # the same prompt of another tenant is cached for it nowhere: the worker with the most free cache
        client.completions.create(model="stub", prompt=question, max_tokens=1,
                                  extra_body={"cache_salt": "tenant-b"})
        assert stubs[1 - home].salts == ["tenant-b"]
    finally:
        router.terminate()
        output = router.communicate(timeout=30)[0].decode()
    assert "tenant-a" not in output and "tenant-b" not in output   # the router's log keeps salts private
