"""Shared pieces of the engine-level tier tests: configs per tier kind, engines, a logits probe."""
from __future__ import annotations

import os
import uuid

from corekv.config import CacheConfig, Config, EngineConfig, TierConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
#: 75 byte tokens: 4 full blocks and a partial one
PROMPT = "a shared system prompt about caches, tiers and blocks; then the question: why"
#: each takes 5 blocks: four of them push PROMPT's blocks out of a 12-block pool
FILLERS = [f"filler {i}: unrelated text that pushes the first prompt out of the pool {i}" for i in range(4)]
KINDS = ("host", "lmdb", "shm", "fsspec-file", "fsspec-memory", "redis")
#: shm stores live in /dev/shm; the session fixture in tests/conftest.py removes this session's
#: (named by its process id: a session never removes another's stores that are in use)
SHM_TEST_PREFIX = f"/dev/shm/corekv-test-{os.getpid()}-"


def tier_config(kind: str, tmp_path, redis_url: str | None = None, **options) -> TierConfig:
    """One ``cache.tiers`` entry of ``kind``, stored under ``tmp_path`` (or in ``redis_url``)."""
    if kind == "host":
        opts = {"size": 4 << 20}
    elif kind == "lmdb":
        opts = {"path": str(tmp_path / "lmdb"), "size": 16 << 20, "sync": False}
    elif kind == "shm":
        opts = {"path": f"{SHM_TEST_PREFIX}{uuid.uuid4().hex[:12]}", "size": 16 << 20}
    elif kind == "fsspec-file":
        opts = {"url": f"file://{tmp_path / 'fs'}"}
    elif kind == "fsspec-memory":
        opts = {"url": f"memory://corekv-test-{uuid.uuid4().hex}"}
    elif kind == "redis":
        assert redis_url, "the redis kind needs a running server's URL"
        opts = {"url": redis_url, "retry_interval": 0.05, "socket_timeout": 0.5}
    else:
        raise ValueError(f"unknown tier kind {kind!r}; expected one of {KINDS}")
    type_name = kind.split("-")[0]
    return TierConfig(type=type_name, name=type_name, options={**opts, **options})


def make_config(tiers=(), *, num_blocks: int = 12, budget: int = 128, write_policy: str = "write_back",
                backend: str = "radix", model: str = "tiny", **engine_kwargs) -> Config:
    return Config(model=model,
                  engine=EngineConfig(num_blocks=num_blocks, block_size=BLOCK,
                                      max_num_batched_tokens=budget, **engine_kwargs),
                  cache=CacheConfig(backend=backend, write_policy=write_policy, tiers=tuple(tiers)))


def make_engine(model, tiers=(), **kwargs) -> Engine:
    return Engine(make_config(tiers, **kwargs), model=model)


def config_mapping(model_folder: str, tier: TierConfig, *, write_policy: str = "write_back", **engine) -> dict:
    """The same engine config as a mapping, for :mod:`tier_worker` processes."""
    return {"model": model_folder, "dtype": "float32", "device": "cpu",
            "engine": {"num_blocks": 12, "block_size": BLOCK, "max_num_batched_tokens": 128, **engine},
            "cache": {"backend": "radix", "write_policy": write_policy,
                      "tiers": [{"type": tier.type, "name": tier.name, **tier.options}]}}


class LogitsProbe:
    """Records the logits every ``ModelRunner.execute`` of ``engine`` returns (a wrapper around
    the real method, which still runs)."""

    def __init__(self, engine: Engine):
        self.calls = []
        execute = engine.runner.execute

        def recording(chunks):
            logits = execute(chunks)
            self.calls.append(logits.detach().clone())
            return logits

        engine.runner.execute = recording

    def first_token_logits(self, engine: Engine, prompt, params=GREEDY, **kwargs):
        """Generate ``prompt`` alone; returns its output and the logits of its first sampled token
        (the budget fits the uncached prompt in one step, so that is the first forward's row)."""
        self.calls = []
        output = engine.generate(prompt, params, **kwargs)[0]
        return output, self.calls[0][0]


def evict(engine: Engine, fillers=FILLERS, cache_salt=None) -> None:
    """Run unrelated prompts one at a time until the pool has reused every earlier block."""
    for filler in fillers:
        engine.generate(filler, GREEDY, cache_salt=cache_salt)
    if engine.offload is not None:
        engine.offload.flush()  # the background writer has stored what was evicted
