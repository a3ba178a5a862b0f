"""One vLLM process for a test or a benchmark: ``python vllm_run.py SPEC.json OUT.json``.

SPEC: ``model``, ``block_size`` (32), ``max_model_len`` (4096), ``config`` (a corekv YAML: the
connector is loaded with it; absent: plain vLLM), ``connector`` (another connector class of
vLLM's, e.g. ``ExampleConnector``, with ``extra_config``), ``requests`` (each ``prompt`` text or
``prompt_token_ids``, optional ``cache_salt``, ``max_tokens``), ``repeat`` (runs of every
request, 1), ``reset_between`` (reset vLLM's prefix cache before every request, so only the
tiers can serve it), ``kv_events`` (``{"endpoint", "topic"}``).
OUT: per run of each request its output ``token_ids``, ``num_cached_tokens``, ``prompt_len`` and
``seconds`` (generate wall time), and ``init_seconds``.
"""
from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs = {}
    if spec.get("config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CoreKVConnector", kv_connector_module_path="corekv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"config": spec["config"], **spec.get("extra_config", {})})
    elif spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector=spec["connector"], kv_role="kv_both",
                                                        kv_connector_extra_config=spec.get("extra_config", {}))
    if spec.get("kv_events"):
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"]["endpoint"],
                                                    topic=spec["kv_events"].get("topic", "kv"))
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", block_size=spec.get("block_size", 32),
              max_model_len=spec.get("max_model_len", 4096), seed=0, enforce_eager=True, **kwargs)
    init_seconds = time.perf_counter() - start
    results = []
    for _ in range(spec.get("repeat", 1)):
        for req in spec["requests"]:
            prompt = ({"prompt_token_ids": req["prompt_token_ids"]} if "prompt_token_ids" in req
                      else {"prompt": req["prompt"]})
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            if spec.get("reset_between"):
                time.sleep(spec.get("pause", 0))
                llm.reset_prefix_cache()
            params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 16))
            start = time.perf_counter()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            results.append({"token_ids": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                            "prompt_len": len(out.prompt_token_ids), "seconds": time.perf_counter() - start})
    json.dump({"init_seconds": init_seconds, "runs": results}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
