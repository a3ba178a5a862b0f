"""corekv's KV events against vLLM 0.32's own: both directions of the wire format.

* corekv's ``kv_events`` plugin on a real engine publishes batches that vLLM's own decoder
  (``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``) reads into vLLM's event
  types, and that vLLM's encoder writes back byte for byte;
* a real vLLM (one process, SmolLM2, eager, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) publishes events
  that corekv's subscriber decodes, live and through vLLM's replay socket, into the router's view
  of that worker: its blocks are there, and a prompt sharing their prefix is routed to it.

The vLLM process is this file run as a script (:func:`serve_vllm`): it answers one JSON command a
line on stdin, so the test decides when each prompt runs relative to its subscriptions.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BS = 16            # the corekv engine's block size
VLLM_BS = 32       # the vLLM server's
SHARED = ("You are a careful assistant. A key-value cache keeps the attention keys and values of "
          "every token a transformer has processed, so generating the next token does not "
          "recompute them. Prefix caching goes further: requests that start with the same tokens "
          "reuse the blocks of the first one. Tiered caches keep blocks in host memory or on disk "
          "when the device runs out of room, and load them back when a later request needs them. "
          "Block hashes chain each block to the one before it, so equal hashes mean equal "
          "prefixes. ")
#: each long enough to fill blocks of its own after the shared ones
QUESTIONS = tuple(f"Question {n}: {q} Answer in one short sentence, in plain words, without lists, "
                  "code or numbers, as if to a student who has never heard of transformers." for n, q in
                  enumerate(("What does a key-value cache store?", "Why do block hashes chain?",
                             "Where do evicted blocks go?")))


# -- corekv publishes, vLLM decodes ------------------------------------------------------------

def replay_all(endpoint: str) -> list[bytes]:
    """Every buffered payload of a replay socket, from seq 0 (vLLM 0.32's replay protocol)."""
    import zmq

    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return payloads
            payloads.append(payload)
    finally:
        ctx.destroy(linger=0)


def test_vllms_decoder_reads_what_corekvs_publisher_sends(tiny_model_folder):
    import msgspec
    from vllm.distributed import kv_events as vllm_events

    from corekv.config import load_config
    from corekv.engine.llm_engine import Engine
    from corekv.engine.models import load_model
    from corekv.engine.sampling import SamplingParams
    from corekv.kv_event_wire import cache_salt_key, external_block_hash
    from corekv.plugins.kv_event_publisher import publisher_for

    config = load_config({"model": "tiny", "engine": {"num_blocks": 12, "block_size": BS},
                          "cache": {"backend": "radix"},
                          "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                                        "replay_endpoint": "tcp://127.0.0.1:0",
                                        "include_token_ids": True}}, env={})  # off by default
    prompts = [[3 + (40 * n + i) % 250 for i in range(3 * BS + 1)] for n in range(5)]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with Engine(config, model=load_model(str(tiny_model_folder), device="cpu")) as engine:
        engine.generate(prompts[0], greedy, cache_salt="tenant-a")
        for ids in prompts[1:]:             # through a 12-block pool: evictions
            engine.generate(ids, greedy)
        engine.backend.reset()
        engine.step()                       # the step publishes the reset
        payloads = replay_all(publisher_for(engine).replay_endpoint)
        salted = [external_block_hash(h)
                  for h in engine.prefix_key(prompts[0], "tenant-a").block_hashes]
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    batches = [decoder.decode(payload) for payload in payloads]
    assert [encoder.encode(batch) for batch in batches] == payloads   # nothing lost or reordered
    events = [e for batch in batches for e in batch.events]
    kinds = {type(e) for e in events}
    assert kinds == {vllm_events.BlockStored, vllm_events.BlockRemoved, vllm_events.AllBlocksCleared}
    assert all(batch.data_parallel_rank == 0 for batch in batches)
    for e in events:
        if isinstance(e, vllm_events.AllBlocksCleared):
            continue
        assert (e.medium, e.group_idx) == (vllm_events.MEDIUM_GPU, 0)
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e.block_hashes)
        if isinstance(e, vllm_events.BlockStored):
            assert (e.block_size, e.lora_id, e.lora_name) == (BS, None, None)
            assert e.kv_cache_spec_kind == "full_attention"
            assert len(e.token_ids) == BS * len(e.block_hashes)
            assert len(e.extra_keys) == len(e.block_hashes)
    [first] = [e for e in events if isinstance(e, vllm_events.BlockStored)
               and e.block_hashes[0] == salted[0]]
    assert first.block_hashes == salted and first.parent_block_hash is None
    assert first.extra_keys == [(cache_salt_key("tenant-a"),), None, None]   # where vLLM puts a salt
    assert first.token_ids == prompts[0][:3 * BS]


# -- vLLM publishes, corekv's subscriber and router read ----------------------------------------

def serve_vllm(model: str, endpoint: str, replay_endpoint: str, topic: str) -> None:
    """The vLLM process: build the engine with KV events on, say ``{"ready": true}``, then per
    stdin line run ``{"prompt": text}`` (one token, greedy), ``{"tokenize": text}`` (the prompt's
    token ids, nothing run) or ``{"reset": true}`` (the prefix cache), and answer with a JSON
    line; an empty line ends it."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    llm = LLM(model=model, dtype="float32", block_size=VLLM_BS, enforce_eager=True,
              max_model_len=1024, seed=0,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=endpoint, replay_endpoint=replay_endpoint,
                                              topic=topic))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        command = json.loads(line)
        if command.get("reset"):
            answer = {"reset": llm.reset_prefix_cache()}
        elif "tokenize" in command:
            answer = {"prompt_token_ids": llm.get_tokenizer().encode(command["tokenize"])}
        else:
            (out,) = llm.generate([command["prompt"]], SamplingParams(max_tokens=1, temperature=0.0),
                                  use_tqdm=False)
            answer = {"prompt_token_ids": list(out.prompt_token_ids),
                      "num_cached_tokens": out.num_cached_tokens}
        print(json.dumps(answer), flush=True)


class VLLMProcess:
    """``serve_vllm`` in a subprocess, spoken to a JSON line at a time."""

    def __init__(self, model: Path, scratch: Path, endpoint: str, replay_endpoint: str, topic: str):
        from vllm_env import vllm_env

        env = vllm_env(scratch, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(model), endpoint, replay_endpoint, topic],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.read() == {"ready": True}

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"vLLM exited with {self.proc.wait()} (its log is above)"
            if line.startswith("{"):   # NOTE: vLLM prints to stdout too
                return json.loads(line)

    def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def run_loop_until(loop: asyncio.AbstractEventLoop, condition, what: str) -> None:
    for _ in range(400):
        loop.run_until_complete(asyncio.sleep(0.05))   # the worker's batches apply on the loop
        if condition():
            return
    raise AssertionError(f"timed out waiting for {what}")


def test_the_router_follows_a_real_vllm_through_its_kv_events(vllm_model, vllm_scratch):
    from corekv.kv_event_subscriber import KVEventSubscriber
    from corekv.kv_event_wire import MEDIUM_GPU, AllBlocksCleared, BlockStored
    from corekv.router.policy import CacheAwarePolicy
    from corekv.router.workers import Worker

    # NOTE: vLLM binds only wildcard and ipc addresses (it connects to tcp://127.0.0.1:PORT)
    folder = Path(tempfile.mkdtemp(prefix="corekv-ev-"))
    endpoint, replay_endpoint = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
    vllm = VLLMProcess(vllm_model, vllm_scratch, endpoint, replay_endpoint, "kv")
    loop = asyncio.new_event_loop()
    worker = Worker(0, "http://127.0.0.1:8001", block_size=VLLM_BS, max_tree_blocks=1000)
    other = Worker(1, "http://127.0.0.1:8002", block_size=VLLM_BS, max_tree_blocks=1000)
    batches, recorder = [], None
    try:
        first = vllm.ask(prompt=SHARED + QUESTIONS[0])["prompt_token_ids"]
        # subscribed after the first prompt ran: its batches come through vLLM's replay socket
        worker.set_info({"model": "smollm2", "block_size": VLLM_BS, "kv_events": {
            "endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": "kv"}})
        worker.start_events(loop)
        assert worker.subscriber is not None
        recorder = KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint, topic="kv",
                                     start_seq=0, on_batch=lambda seq, b: batches.append(b)).start()
        num_first = len(first) // VLLM_BS
        run_loop_until(loop, lambda: worker.events_tree.num_blocks == num_first,
                       "the replayed blocks of the first prompt")
        assert worker.subscriber.num_replayed >= 1
        # live: a second prompt sharing the first one's prefix adds only its own blocks
        second = vllm.ask(prompt=SHARED + QUESTIONS[1])
        num_shared = next(i for i, (a, b) in enumerate(zip(first, second["prompt_token_ids"]))
                          if a != b) // VLLM_BS
        assert second["num_cached_tokens"] == num_shared * VLLM_BS
        num_blocks = num_first + len(second["prompt_token_ids"]) // VLLM_BS - num_shared
        assert num_shared >= 1 and num_blocks > num_first
        run_loop_until(loop, lambda: worker.events_tree.num_blocks == num_blocks,
                       "the live blocks of the second prompt")
        assert worker.match(second["prompt_token_ids"], None) == \
            len(second["prompt_token_ids"]) // VLLM_BS * VLLM_BS
        # a new prompt sharing the prefix is routed to this worker, for its cache
        third = vllm.ask(tokenize=SHARED + QUESTIONS[2])["prompt_token_ids"]
        assert vllm.ask(tokenize=SHARED + QUESTIONS[0])["prompt_token_ids"] == first
        choice = CacheAwarePolicy().choose([other, worker], third)
        assert (choice.worker, choice.reason) == (worker, "cache")
        assert choice.matched_tokens >= num_shared * VLLM_BS > 0
        # NOTE: vLLM publishes a reset's AllBlocksCleared with the next step's events
        vllm.ask(reset=True)
        after = vllm.ask(prompt=QUESTIONS[2])["prompt_token_ids"]
        run_loop_until(loop, lambda: worker.events_tree.num_blocks == len(after) // VLLM_BS,
                       "AllBlocksCleared")
        assert len(after) >= VLLM_BS and worker.match(first, None) == 0
        run_loop_until(loop, lambda: recorder.last_seq == worker.subscriber.last_seq, "the recorder")
        for subscriber in (worker.subscriber, recorder):
            assert (subscriber.num_decode_errors, subscriber.num_missed) == (0, 0)
    finally:
        if recorder is not None:
            recorder.close()
        worker.stop_events(wait=True)
        vllm.close()
        loop.close()
        shutil.rmtree(folder, ignore_errors=True)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tuple(first[:num_first * VLLM_BS])
    assert all(e.medium == MEDIUM_GPU and e.block_size == VLLM_BS for e in stored)
    assert all(isinstance(h, int) for e in stored for h in e.block_hashes)   # vLLM's default
    assert stored[1].parent_block_hash == stored[0].block_hashes[num_shared - 1]
    assert any(isinstance(e, AllBlocksCleared) for e in batches[-1].events)


if __name__ == "__main__":   # NOTE: the vLLM process; the guard lets vLLM spawn workers safely
    serve_vllm(*sys.argv[1:5])
