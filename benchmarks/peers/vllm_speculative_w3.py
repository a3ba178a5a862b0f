"""vLLM's CPU build with and without its ``ngram`` speculative decoding on speculative_w3.py's W3:
the same token ids, greedy, the same lengths, each request alone.

    python benchmarks/speculative_w3.py --dump-prompts w3.json           # corekv's venv
    python benchmarks/peers/vllm_speculative_w3.py --prompts w3.json --model /path/to/smollm2_hf --runs 3

Each setting gets one ``vllm.LLM`` in its own child process; one untimed warm-up request, then per
run the four requests one at a time (prefix cache reset before each). Reported: decode tokens/s
(output tokens after the first over the time after the first token, from vLLM's request metrics,
summed over the requests), vLLM's own acceptance counters where it keeps them, and the tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (see peers/__init__.py)
from peers import runner  # noqa: E402


def child(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(Path(args.prompts).read_text())
    speculative = None
    if args.setting == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 5}
    result = {"setting": args.setting}
    try:
        llm = LLM(model=args.model, dtype="float32", block_size=32, max_model_len=2048, seed=0,
                  speculative_config=speculative, disable_log_stats=False)
    except Exception as e:  # noqa: BLE001 (report why vLLM refused, whatever it raised)
        result["refused"] = f"{type(e).__name__}: {e}"
        Path(args.out).write_text(json.dumps(result))
        raise
    params = SamplingParams(temperature=0.0, max_tokens=data["max_tokens"])
    llm.generate([TokensPrompt(prompt_token_ids=data["W3"][0][:32])], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    runs = []
    for _ in range(args.runs):
        decode_s, decode_tokens, tokens = 0.0, 0, []
        for prompt in data["W3"]:
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - t0
            m = out.metrics
            ttft = m.first_token_latency if m is not None and getattr(m, "first_token_latency", 0) > 0 else None
            tokens.append(list(out.outputs[0].token_ids))
            decode_s += elapsed - (ttft or 0.0)
            decode_tokens += len(tokens[-1]) - 1
        runs.append(dict(decode_tok_s=decode_tokens / decode_s, tokens=tokens))
        print(f"[vllm child] {args.setting}: {runs[-1]['decode_tok_s']:.1f} decode tok/s", file=sys.stderr, flush=True)
    result.update(decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs), runs=len(runs),
                  tokens=runs[0]["tokens"], deterministic=all(r["tokens"] == runs[0]["tokens"] for r in runs))
    try:
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
        result["spec_decode_metrics"] = metrics
    except Exception as e:  # noqa: BLE001 (metrics are a nicety)
        result["spec_decode_metrics"] = f"unavailable: {e}"
    Path(args.out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", required=True, help="HF folder of SmolLM2-135M-Instruct")
    ap.add_argument("--settings", default="off,ngram")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ld-preload", default=None,
                    help="LD_PRELOAD for vLLM's processes ('auto': tcmalloc and the venv's Intel OpenMP, as in "
                         "vllm_w1_w2.py; '' for none; default: the environment's, as BENCHMARKS.md's W3 rows were measured)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setting", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for setting in args.settings.split(","):
        out = Path(f"{args.json or 'vllm_w3'}.{setting}.part")
        cmd = [sys.executable, __file__, "--child", "--setting", setting, "--out", str(out), "--prompts", args.prompts,
               "--model", args.model, "--k", str(args.k), "--runs", str(args.runs)]
        code = runner.run(cmd, env=runner.peer_env(preload=args.ld_preload)).returncode
        row = json.loads(out.read_text()) if out.exists() else {"setting": setting, "refused": f"exit code {code}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    base = next((r for r in rows if r["setting"] == "off" and "tokens" in r), None)
    for r in rows:
        if base is not None and "tokens" in r:
            r["same_tokens_as_off"] = r["tokens"] == base["tokens"]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
