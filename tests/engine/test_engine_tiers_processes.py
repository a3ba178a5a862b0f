"""Tiers across processes: warm in one process, exit, and a new one reloads from LMDB (and from the
node-shared memory tier in /dev/shm, and from a real redis-server) with zero recomputed prefix tokens; two processes sharing one LMDB; a process
SIGKILLed during write-back leaves a store the next start reads consistently."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from corekv.engine.models import load_model
from tier_helpers import BLOCK, FILLERS, GREEDY, PROMPT, config_mapping, make_engine, tier_config

WORKER = str(Path(__file__).with_name("tier_worker.py"))


@pytest.fixture(scope="module")
def model_folder(tiny_model_folder):
    """The tiny Llama saved with save_pretrained, so separate processes load identical weights."""
    return str(tiny_model_folder)


@pytest.fixture(scope="module")
def saved_model(model_folder):
    return load_model(model_folder, dtype="float32", device="cpu")


def start_worker(model_folder, tier, prompts, rounds=1, write_policy="write_back", **engine) -> subprocess.Popen:
    args = {"config": config_mapping(model_folder, tier, write_policy=write_policy, **engine), "prompts": prompts, "rounds": rounds,
            "max_tokens": GREEDY.max_tokens}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, WORKER, json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def run_worker(model_folder, tier, prompts, **kwargs) -> list:
    child = start_worker(model_folder, tier, prompts, **kwargs)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith(("{", '"'))]
    assert lines[-1] == "closed", out
    return lines[:-1]


def no_tier_outputs(model, prompts) -> list[list[int]]:
    with make_engine(model, num_blocks=64) as engine:
        return [engine.generate(p, GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("kind", ["lmdb", "shm", "redis"])
def test_a_new_process_reloads_with_zero_recomputed_prefix_tokens(model_folder, saved_model, kind, tmp_path,
                                                                  request):
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    tier = tier_config(kind, tmp_path, url)
    [first] = run_worker(model_folder, tier, [PROMPT])
    [second] = run_worker(model_folder, tier, [PROMPT])
    num_prompt = len(saved_model.encode_prompt(PROMPT))
    cached = (num_prompt - 1) // BLOCK * BLOCK  # every full block (the last token is always computed)
    assert first["by_tier"] == {"device": 0} or first["by_tier"].get(kind, 0) == 0
    assert second["by_tier"] == {"device": 0, kind: cached}
    # computed: the prompt's partial last block, then one token per decode step
    assert second["computed"] == num_prompt - cached + GREEDY.max_tokens - 1
    assert second["tokens"] == first["tokens"] == no_tier_outputs(saved_model, [PROMPT])[0]


def test_two_processes_share_one_lmdb(model_folder, saved_model, tmp_path):
    tier = tier_config("lmdb", tmp_path)
    halves = [[PROMPT, FILLERS[0]], [FILLERS[1], FILLERS[2]]]
    children = [start_worker(model_folder, tier, half) for half in halves]
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
    prompts = halves[0] + halves[1]
    with make_engine(saved_model, [tier], num_blocks=64) as engine:
        outputs = [engine.generate(p, GREEDY)[0] for p in prompts]
        assert engine.stats()["tiers"]["lmdb"]["faults"] == 0
    for prompt, output in zip(prompts, outputs):
        expected = (len(saved_model.encode_prompt(prompt)) - 1) // BLOCK * BLOCK
        assert output.cached_tokens_by_tier == {"device": 0, "lmdb": expected}, prompt
    assert [o.token_ids for o in outputs] == no_tier_outputs(saved_model, prompts)


def test_sigkill_during_write_back_leaves_a_consistent_store(model_folder, saved_model, tmp_path):
    tier = tier_config("lmdb", tmp_path, sync=True)
    prompts = [PROMPT, *FILLERS]
    # write-through and a small pool: every step writes, so the kill lands amid writes
    child = start_worker(model_folder, tier, prompts, rounds=50, num_blocks=12,
                         write_policy="write_through")
    for _ in range(7):
        line = child.stdout.readline()
        assert line, f"the worker died: {child.stderr.read()[-3000:]}"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    with make_engine(saved_model, [tier]) as engine:
        outputs = [engine.generate(p, GREEDY)[0] for p in prompts]
        stats = engine.stats()["tiers"]["lmdb"]
    assert stats["faults"] == 0 and stats["reloads"] > 0
    assert [o.token_ids for o in outputs] == no_tier_outputs(saved_model, prompts)


def test_a_truncated_lmdb_store_never_kills_an_engine_by_a_signal(model_folder, tmp_path):
    """A store cut in half (a full disk, a bad copy): a new engine process starts without the
    tier, says why naming cache.tiers[0].path, and serves; with ``required: true`` it refuses to
    start with that message. Either way it exits by itself, never by SIGBUS."""
    tier = tier_config("lmdb", tmp_path)
    run_worker(model_folder, tier, [PROMPT, FILLERS[0]])
    data = Path(tier.options["path"]) / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    child = start_worker(model_folder, tier, [PROMPT])
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    assert "cache.tiers[0].path" in err and "truncated" in err
    assert json.loads(out.splitlines()[0])["by_tier"] == {"device": 0}
    args = {"config": config_mapping(model_folder, tier), "prompts": [PROMPT]}
    args["config"]["cache"]["tiers"][0]["required"] = True
    child = subprocess.run([sys.executable, WORKER, json.dumps(args)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 1, (child.returncode, child.stderr[-3000:])
    assert "ConfigError: cache.tiers[0].path:" in child.stderr and "truncated" in child.stderr
