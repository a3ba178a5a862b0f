"""KV shared between ``corekv serve`` processes through one Redis tier.

Two real worker subprocesses serve the tiny model with the same ``redis`` tier (a real
redis-server on loopback, ``write_through``): a prefix one worker computed is reloaded from Redis,
not recomputed, by the other, with the same greedy output. Then Redis is killed mid-run (every
request still completes, counted as tier faults/misses) and restarted on its port (sharing resumes
once the tier reconnects).
"""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import yaml
from redis_server import RedisServer
from processes import ServeProcess, free_port, running, wait_until
from router_helpers import BLOCK_SIZE

NUM_BLOCKS = 64
PROMPT = ("Shared system prompt for every tenant of this deployment: answer briefly. " * 2
          + "Question one?")


def _client(worker: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(worker: ServeProcess, prompt: str):
    client = _client(worker)
    model = client.models.list().data[0].id  # the served model id (the config's model path)
    return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0)


def _redis_stats(worker: ServeProcess) -> dict:
    return httpx.get(worker.url + "/admin/stats", timeout=10).json()["tiers"]["redis"]


def _cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """One redis-server for the module (the last test kills and restarts it)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_workers(tiny_model_folder, tmp_path_factory, redis):
    """Two servers started once for the module (a start costs seconds of torch import)."""
    tmp_path = tmp_path_factory.mktemp("shared-kv")
    config = {"model": str(tiny_model_folder), "device": "cpu",
              "engine": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS},
              "cache": {"write_policy": "write_through",
                        "tiers": [{"type": "redis", "url": redis.url, "retry_interval": 0.2,
                                   "socket_timeout": 0.5}]}}
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(config))
    procs = [ServeProcess(path, free_port(), tmp_path / f"worker{i}.log", "--log-level", "warning")
             for i in range(2)]
    with running(procs):
        yield procs


def _wait_offloaded(worker: ServeProcess, at_least: int) -> None:
    wait_until(lambda: _redis_stats(worker)["offloaded_blocks"] >= at_least, 60,
               f"{at_least} blocks written to redis by {worker.url}", 0.1)


def test_a_prefix_computed_by_one_server_is_reloaded_by_another(two_workers):
    a, b = two_workers
    first = _complete(a, PROMPT)
    assert _cached(first) == 0
    full_blocks = (first.usage.prompt_tokens - 1) // BLOCK_SIZE
    _wait_offloaded(a, full_blocks)

    second = _complete(b, PROMPT)
    # every full block but the one holding the last prompt token (always computed) came from redis
    assert _cached(second) == full_blocks * BLOCK_SIZE
    assert _redis_stats(b)["reloaded_blocks"] == full_blocks
    assert second.choices[0].text == first.choices[0].text


def test_servers_keep_serving_while_redis_is_down_and_share_again_after_it_returns(two_workers, redis):
    a, b = two_workers
    prompt = "Another tenant's system prompt, which neither server has seen yet. " * 2
    reference = _complete(a, prompt)
    _wait_offloaded(a, (reference.usage.prompt_tokens - 1) // BLOCK_SIZE)

    redis.kill()  # its data is gone with it (no persistence), and the tiers see errors
    during = _complete(b, prompt)  # a miss, not an error: b computes what a stored in redis
    assert _cached(during) == 0
    assert during.choices[0].text == reference.choices[0].text
    assert all(_complete(w, f"{prompt} (redis down, {i})").choices[0].finish_reason in ("stop", "length")
               for i, w in enumerate(two_workers))
    assert _redis_stats(b)["errors"] > 0  # counted, not raised

    redis.start()  # the same port: each tier reconnects after its retry interval
    attempt = iter(range(1000))

    def shared_again() -> bool:
        # a fresh prompt per try: writes attempted before a's tier reconnected are not retried
        fresh = f"{prompt} (after the restart, try {next(attempt)})"
        before = _redis_stats(a)["offloaded_blocks"]
        stored = _complete(a, fresh)
        full_blocks = (stored.usage.prompt_tokens - 1) // BLOCK_SIZE
        # write-through stores the blocks a computed; its device hits (the shared head) it had already
        wanted = before + full_blocks - _cached(stored) // BLOCK_SIZE
        for _ in range(50):  # up to ~5 s for a's write-through; false when it was not written
            if _redis_stats(a)["offloaded_blocks"] >= wanted:
                return _cached(_complete(b, fresh)) == full_blocks * BLOCK_SIZE
            time.sleep(0.1)
        return False

    wait_until(shared_again, 90, "worker b to reload a prefix worker a wrote after redis restarted", 0.5)
