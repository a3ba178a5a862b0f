"""Session-wide test settings and fixtures: keep plugin loading hermetic (only corekv's own entry
points), keep OpenMP's threads from spinning on a shared CPU, and save the tiny model once for the
tests that start engines from a model folder. The per-test timeout and the slowest-tests list are
pytest options in pyproject.toml."""
import importlib.util
import os

import pytest

os.environ.setdefault("COREKV_DISABLE_PLUGIN_AUTOLOAD", "1")
# NOTE: before anything imports torch (OpenMP reads it once, when it starts), for this process and
# every engine, server and worker the tests start: the suite shares its CPU with the processes it
# starts (and on CI with nothing else), where OpenMP's spin-waiting threads stall each other.
# `import corekv` sets the same; said here so no import order can undo it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# tests/vllm runs under the vLLM venv's python (.ci/run); the main venv has no vllm. NOTE: the
# folder tests/vllm itself is found as a namespace package "vllm" (no origin), not the library.
_vllm = importlib.util.find_spec("vllm")
collect_ignore = [] if _vllm is not None and _vllm.origin else ["vllm"]

# a real redis-server on a free loopback port per test (fails, not skips, when CI=true and absent)
from redis_server import redis_server  # noqa: E402,F401  (fixture)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    """A tiny random Llama and its byte tokenizer, saved as a Hugging Face model folder."""
    from corekv.engine.tiny_model import make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny = make_tiny_llama()
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _remove_shm_test_stores():
    """shm tier stores this session's tests made in /dev/shm (memory the machine keeps until
    removed); only this session's, since another session may be using its own right now."""
    yield
    import glob
    import shutil

    for path in glob.glob(f"/dev/shm/corekv-test-{os.getpid()}-*"):
        shutil.rmtree(path, ignore_errors=True)
