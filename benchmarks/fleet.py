"""A fleet on one box: three ``corekv serve`` processes (stand-ins for three machines) behind
``corekv route``, sharing a Redis Cluster tier (or S3 on moto), against the same fleet without a
shared tier; a cluster primary is killed mid-run.

    python benchmarks/fleet.py --shared none,cluster,s3 --markdown

About 10 minutes with SmolLM2 on 2 shared cores at these defaults (BENCHMARKS.md's run used
``--docs 7``: 16 minutes at load average 5-10, beside another benchmark).

Workload: ``--docs`` documents of about ``--doc-tokens`` tokens (cut from the seed documents),
each asked ``--questions`` questions, one request at a time through the router, whose policy is
``round_robin``: request ``i`` goes to server ``i % 3``, and the requests run question by
question over the documents, so each question on a document lands on another server than the
one before. A prefix first computed on one server can then only hit on another through the
shared tier (each server also has its own ``host`` tier, as a machine would). Requests are
completions of ``document + question`` with ``max_tokens`` tokens, greedy, streamed; TTFT is the
client's time to the first streamed token; ``usage.prompt_tokens_details.cached_tokens_by_tier``
says where each request's cached tokens came from.

Fleets, each started fresh (empty servers, empty stores):

* ``none``: tiers ``[host]`` on each server: the reference. Every other fleet's outputs must
  equal its outputs, request by request (greedy: a reloaded prefix is the same bytes).
* ``cluster``: ``[host, redis cluster]``, a 6-node Redis Cluster on loopback (3 primaries, 3
  replicas; tests/redis_cluster.py). After half the requests one primary is killed (SIGKILL);
  its replica takes over after the cluster's node timeout (1.5 s). Reported: failed requests
  (must be 0), wrong outputs (must be 0), and the cluster tier's hit tokens before the kill,
  in the requests right after it, and from the first hit after it on (hits resume).
* ``s3``: ``[host, fsspec s3://]`` on moto's S3 server (loopback, in this process).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from processes import free_port  # noqa: E402  (the tests' helpers: real servers on loopback)
from redis_cluster import RedisCluster  # noqa: E402
from s3_server import FAKE_CREDENTIALS  # noqa: E402
from seed_documents import add_seeds_argument, read_seeds  # noqa: E402  (benchmarks/ is sys.path[0])
from corekv_servers import start, stop, tiny_model_folder, wait_healthy  # noqa: E402

QUESTIONS = ["What is the main idea of this text?", "Which component is described first?",
             "Name one trade-off the text mentions.", "Summarise the text in one sentence.",
             "What would you measure first?", "Which term is defined here?"]


def documents(seed_text: str, num_docs: int, doc_chars: int) -> list[str]:
    """``num_docs`` consecutive, distinct slices of the seed text of ``doc_chars`` characters."""
    while len(seed_text) < num_docs * doc_chars:
        seed_text += "\n\n" + seed_text
    return [f"Document {d}:\n" + seed_text[d * doc_chars:(d + 1) * doc_chars] for d in range(num_docs)]


def worker_config(model: str, shared: str, stores: dict, num_blocks: int) -> dict:
    tiers = [{"type": "host", "size": "512MiB"}]
    if shared == "cluster":
        tiers.append({"type": "redis", "name": "cluster", "url": stores["cluster"].url, "cluster": True,
                      "retry_interval": 1.0, "socket_timeout": 2.0})
    elif shared == "s3":
        tiers.append({"type": "fsspec", "name": "s3", "url": f"s3://{stores['bucket']}/kv",
                      "storage_options": {"endpoint_url": stores["s3_endpoint"]}, "timeout": 10.0})
    return {"model": model, "device": "cpu", "dtype": "float32",
            "engine": {"block_size": 16, "num_blocks": num_blocks},
            "cache": {"backend": "radix", "write_policy": "write_through", "tiers": tiers}}


def stream_completion(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: its text, TTFT, usage; ``error`` set instead when it failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    started, first, text, usage = time.perf_counter(), None, [], None
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {response.read()[:300]!r}"}
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": json.dumps(chunk["error"])[:300]}
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or time.perf_counter()
                    text.append(chunk["choices"][0]["text"])
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"text": "".join(text), "ttft_s": (first or time.perf_counter()) - started,
            "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens") or 0,
            "by_tier": details.get("cached_tokens_by_tier") or {}}


def run_fleet(shared: str, model: str, docs: list[str], opts, folder: Path, stores: dict) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.worker_threads), TQDM_DISABLE="1", **FAKE_CREDENTIALS,
               AWS_EC2_METADATA_DISABLED="true")
    workers, urls = [], []
    for i in range(3):
        path = folder / f"{shared}-server{i}.yaml"
        path.write_text(yaml.safe_dump(worker_config(model, shared, stores, opts.num_blocks)))
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        workers.append(start(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning"],
                             folder / f"{shared}-server{i}.log", env))
    router = None
    try:
        for url, process in zip(urls, workers):
            wait_healthy(url, process, 900)
        port = free_port()
        router = start(["route", "--config", str(folder / f"{shared}-server0.yaml"), "--workers", *urls,
                        "--port", str(port), "--policy", "round_robin"], folder / f"{shared}-router.log", env)
        router_url = f"http://127.0.0.1:{port}"
        wait_healthy(router_url, router, 300)
        model_id = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        requests = [(d, q) for q in range(opts.questions) for d in range(len(docs))]
        kill_at = len(requests) // 2 if shared == "cluster" and opts.kill else None
        records = []
        with httpx.Client(timeout=600) as client:
            for i, (d, q) in enumerate(requests):
                if i == kill_at:
                    # NOTE: not the node the servers' url names (they found the others through it)
                    cluster = stores["cluster"]
                    victim = next(p for p in cluster.primary_ports() if p != cluster.ports[0])
                    cluster.kill(victim)
                    print(f"{shared}: killed the cluster primary on port {victim} before request {i}",
                          file=sys.stderr, flush=True)
                record = stream_completion(client, router_url, model_id,
                                           f"{docs[d]}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}\nAnswer:",
                                           opts.max_tokens)
                record.update(index=i, doc=d, question=q, after_kill=kill_at is not None and i >= kill_at,
                              at_s=time.time())
                records.append(record)
                print(f"{shared} {i}: {record.get('error') or record['by_tier']} "
                      f"{record.get('ttft_s', 0):.3f} s", file=sys.stderr, flush=True)
        return records
    finally:
        stop([router] if router is not None else [])
        stop(workers)


def summarize(shared: str, records: list[dict], reference: list[dict] | None) -> dict:
    ok = [r for r in records if "error" not in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    by_tier: dict[str, int] = {}
    for r in ok:
        for tier, n in r["by_tier"].items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    out = {"shared": shared, "requests": len(records), "failed": len(records) - len(ok),
           "errors": [r["error"] for r in records if "error" in r][:5],
           "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "hit_tokens_by_tier": by_tier,
           "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
           "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None}
    if reference is not None:
        expected = {(r["doc"], r["question"]): r.get("text") for r in reference}
        out["wrong_outputs"] = sum(1 for r in ok if r["text"] != expected[(r["doc"], r["question"])])
    tier = {"cluster": "cluster", "s3": "s3"}.get(shared)
    if tier and any(r["after_kill"] for r in records):
        before = [r for r in ok if not r["after_kill"]]
        after = [r for r in ok if r["after_kill"]]
        first_hit = next((i for i, r in enumerate(after) if r["by_tier"].get(tier)), None)
        out["kill"] = {
            "hit_tokens_before": sum(r["by_tier"].get(tier, 0) for r in before),
            "requests_before": len(before),
            "requests_after": len(after),
            "requests_after_until_first_hit": first_hit,
            "seconds_until_first_hit": (after[first_hit]["at_s"] - after[0]["at_s"]) if first_hit is not None else None,
            "hit_tokens_after": sum(r["by_tier"].get(tier, 0) for r in after),
            "hit_tokens_from_first_hit_on": sum(r["by_tier"].get(tier, 0) for r in after[first_hit:])
            if first_hit is not None else 0}
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| shared tier | requests | failed | wrong outputs | prompt tokens | hit tokens by tier "
             "| mean TTFT s | p90 TTFT s |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(r["hit_tokens_by_tier"].items())) or "none"
        lines.append(f"| {r['shared']} | {r['requests']} | {r['failed']} | {r.get('wrong_outputs', '-')} "
                     f"| {r['prompt_tokens']} | {tiers} | {r['mean_ttft_s']:.3f} | {r['p90_ttft_s']:.3f} |")
    for r in rows:
        if "kill" in r:
            k = r["kill"]
            lines += ["", f"{r['shared']}: a primary killed after {k['requests_before']} requests "
                          f"({k['hit_tokens_before']} hit tokens from the cluster before); of the "
                          f"{k['requests_after']} after, the first cluster hit came "
                          f"{k['requests_after_until_first_hit']} requests "
                          f"({k['seconds_until_first_hit'] if k['seconds_until_first_hit'] is None else round(k['seconds_until_first_hit'], 1)} s) "
                          f"after the kill; {k['hit_tokens_from_first_hit_on']} hit tokens from there on."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the servers' model")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead (text is noise)")
    parser.add_argument("--shared", default="none,cluster,s3", help="fleets to run: none, cluster, s3")
    parser.add_argument("--docs", type=int, default=5,
                        help="documents (not a multiple of 3, so a document's next question goes to another server)")
    parser.add_argument("--doc-chars", type=int, default=2400, help="characters per document (~600 SmolLM2 tokens)")
    parser.add_argument("--questions", type=int, default=3, help="questions per document")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256, help="each server's device pool in blocks")
    parser.add_argument("--worker-threads", type=int, default=1, help="OMP_NUM_THREADS per server")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="do not kill a cluster primary")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    add_seeds_argument(parser)
    opts = parser.parse_args()
    if opts.docs < 1 or opts.docs % 3 == 0:
        parser.error(f"--docs: got {opts.docs}; expected a number >= 1 that is not a multiple of 3 (with "
                     "round_robin over 3 servers, every question on a document would go to one server)")
    fleets = [s.strip() for s in opts.shared.split(",") if s.strip()]
    if not fleets or any(s not in ("none", "cluster", "s3") for s in fleets):
        parser.error(f"--shared: got {opts.shared!r}; expected a list of none, cluster, s3")
    if "none" in fleets:  # the reference runs first
        fleets = ["none"] + [s for s in fleets if s != "none"]
    docs = documents(read_seeds(opts.seeds), opts.docs, opts.doc_chars)
    started = time.strftime("%H:%M:%S UTC", time.gmtime())
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="corekv-fleet-") as tmp:
        folder = Path(tmp)
        model = tiny_model_folder(folder) if opts.tiny else opts.model
        for shared in fleets:
            stores: dict = {}
            moto = cluster = None
            try:
                if shared == "cluster":
                    (folder / "cluster").mkdir(exist_ok=True)
                    cluster = stores["cluster"] = RedisCluster(folder / "cluster").start()
                elif shared == "s3":
                    import logging

                    import boto3
                    from moto.server import ThreadedMotoServer

                    logging.getLogger("werkzeug").setLevel(logging.ERROR)
                    os.environ.update(FAKE_CREDENTIALS)
                    port = free_port()
                    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
                    moto.start()
                    stores["s3_endpoint"] = f"http://127.0.0.1:{port}"
                    stores["bucket"] = f"corekv-fleet-{uuid.uuid4().hex[:12]}"
                    boto3.client("s3", endpoint_url=stores["s3_endpoint"]).create_bucket(Bucket=stores["bucket"])
                print(f"running the fleet with shared tier: {shared} ...", file=sys.stderr, flush=True)
                try:
                    results[shared] = run_fleet(shared, model, docs, opts, folder, stores)
                except Exception:
                    for log in sorted(folder.glob(f"{shared}-*.log")):
                        print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
                    raise
            finally:
                if cluster is not None:
                    cluster.stop()
                if moto is not None:
                    moto.stop()
            rows.append(summarize(shared, results[shared], results.get("none") if shared != "none" else None))
            if opts.json:
                Path(opts.json).write_text(json.dumps({"rows": rows, "records": results}, indent=1))
    meta = {"started": started, "ended": time.strftime("%H:%M:%S UTC", time.gmtime()),
            "load_average_end": os.getloadavg(), "model": "tiny" if opts.tiny else opts.model,
            "docs": opts.docs, "questions": opts.questions, "max_tokens": opts.max_tokens}
    print(json.dumps(meta))
    print(markdown(rows) if opts.markdown else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
