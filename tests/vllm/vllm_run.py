"""One vLLM process for a test or a benchmark: ``python vllm_run.py SPEC.json OUT.json``.

SPEC: ``model``, ``block_size`` (32), ``enable_prefix_caching`` (true), ``max_model_len`` (4096), ``config`` (a corekv YAML: the
connector is loaded with it; absent: plain vLLM), ``connector`` (another connector class of
vLLM's, e.g. ``ExampleConnector``, with ``extra_config``), ``requests`` (each ``prompt`` text or
``prompt_token_ids``, optional ``cache_salt``, ``max_tokens``), ``repeat`` (runs of every
request, 1), ``reset_between`` (reset vLLM's prefix cache before every request, so only the
tiers can serve it), ``pause`` (seconds before each reset), ``kv_events`` (``{"endpoint",
"topic"}``: the events are also received here and written to OUT), ``progress`` (print ``done N``
after each request).
OUT: per run of each request its output ``token_ids``, ``num_cached_tokens``, ``prompt_len`` and
``seconds`` (generate wall time), ``init_seconds``, and ``events`` (``[type, medium, num hashes]``
of every event received, when ``kv_events`` is given).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def run_vllm(spec: dict, folder: Path, scratch: Path, *, multiprocess: bool = False,
             timeout: float = 600) -> tuple[dict, str]:
    """Run ``spec`` in a fresh vLLM process (the engine core in it, or with ``multiprocess`` in
    vLLM's own engine-core and worker processes); returns OUT and the process's log."""
    from vllm_env import vllm_env

    folder.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = folder / "spec.json", folder / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = vllm_env(scratch, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(f"vLLM run failed ({done.returncode}):\n{log[-6000:]}")
    return json.loads(out_path.read_text()), log


def receive_events(endpoint: str, frames: list, stop: threading.Event) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    while not stop.is_set():
        if sock.poll(50):
            frames.append(sock.recv_multipart())
    sock.close(0)


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    from corekv.integrations.vllm import transfer_config

    kwargs = {}
    if spec.get("config"):
        kwargs["kv_transfer_config"] = transfer_config(spec["config"], **spec.get("extra_config", {}))
    elif spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector=spec["connector"], kv_role="kv_both",
                                                        kv_connector_extra_config=spec.get("extra_config", {}))
    if spec.get("kv_events"):
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"]["endpoint"],
                                                    topic=spec["kv_events"].get("topic", "kv"))
    frames, stop = [], threading.Event()
    if spec.get("kv_events"):
        receiver = threading.Thread(target=receive_events, args=(spec["kv_events"]["endpoint"], frames, stop))
        receiver.start()
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", block_size=spec.get("block_size", 32),
              max_model_len=spec.get("max_model_len", 4096), seed=0, enforce_eager=True,
              enable_prefix_caching=spec.get("enable_prefix_caching", True), **kwargs)
    init_seconds = time.perf_counter() - start
    results = []
    for _ in range(spec.get("repeat", 1)):
        for req in spec["requests"]:
            prompt = ({"prompt_token_ids": req["prompt_token_ids"]} if "prompt_token_ids" in req
                      else {"prompt": req["prompt"]})
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            if spec.get("reset_between") or req.get("reset"):
                time.sleep(spec.get("pause", 0))
                llm.reset_prefix_cache()
            params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 16))
            start = time.perf_counter()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            results.append({"token_ids": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                            "prompt_len": len(out.prompt_token_ids), "seconds": time.perf_counter() - start})
            if spec.get("progress"):
                print(f"done {len(results)}", flush=True)
    events = []
    if spec.get("kv_events"):
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        time.sleep(1.0)
        stop.set()
        receiver.join()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        for _, _, payload in frames:
            events += [[type(e).__name__, getattr(e, "medium", None), len(getattr(e, "block_hashes", None) or [])]
                       for e in decoder.decode(payload).events]
    json.dump({"init_seconds": init_seconds, "runs": results, "events": events}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
