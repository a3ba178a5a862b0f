"""A separate engine process for the tier tests (restart, shared LMDB, SIGKILL during write-back).

Usage: ``python tier_worker.py '<json>'`` with ``{"config": mapping, "prompts": [...],
"max_tokens": n, "rounds": r}``. Runs the prompts ``rounds`` times, printing one JSON line per
output (``{"tokens", "by_tier", "computed"}``) and flushing, then closes the engine (which writes
the still-cached blocks to persistent tiers) and prints ``"closed"``.
"""
from __future__ import annotations

import json
import sys

from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams


def main() -> None:
    args = json.loads(sys.argv[1])
    params = SamplingParams(max_tokens=args.get("max_tokens", 4), temperature=0.0, ignore_eos=True)
    engine = Engine.from_config(args["config"])
    for _ in range(args.get("rounds", 1)):
        for prompt in args["prompts"]:
            before = engine.stats()["tokens_computed"]
            out = engine.generate(prompt, params)[0]
            print(json.dumps({"tokens": out.token_ids, "by_tier": out.cached_tokens_by_tier,
                              "computed": engine.stats()["tokens_computed"] - before}), flush=True)
    engine.close()
    print(json.dumps("closed"), flush=True)


if __name__ == "__main__":
    main()
