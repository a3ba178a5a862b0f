"""``engine.compile``: the model's forward compiled by torch.compile (inductor, a real C++ build),
with corekv's paged attention as one opaque op, serves the same greedy tokens as transformers'
generate; the loaded model itself stays eager for plain Hugging Face use."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.model_runner import ModelRunner
from corekv.engine.sampling import SamplingParams
from corekv.errors import CoreKVError
from test_engine_generate import hf_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_compiled_engine_serves_generates_tokens_and_leaves_the_model_eager(tiny_llama, hf_attention):
    shared = [7, 8, 9, 10] * 12  # three blocks shared by two prompts: prefill chunks and decodes of several lengths
    prompts = [shared + [20, 21, 22], shared + [30] * 9, [40, 41, 42, 43, 44]]
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=64,
                                                   compile=True), cache=CacheConfig(backend="radix"))
    engine = Engine(cfg, model=tiny_llama)  # compiles: the runner warms up the step shapes
    assert engine.runner._forward is not tiny_llama.model
    assert engine.runner._native is not None  # attention runs through the native kernels
    graphs = dict(counters["stats"])
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert dict(counters["stats"]) == graphs  # serving compiled nothing new: the warm-up covered it
    assert got == [hf_greedy(tiny_llama, hf_attention, p, GREEDY.max_tokens) for p in prompts]
    # the compiled forward only runs inside a runner step; the model itself is still plain HF
    with pytest.raises(CoreKVError, match="outside a ModelRunner step"), torch.inference_mode():
        engine.runner._forward(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    with torch.no_grad():
        assert tiny_llama.model(torch.tensor([[5, 6, 7]]), use_cache=False).logits.shape[-1] == tiny_llama.vocab_size
    engine.close()


def test_models_of_one_class_compiled_in_one_process_each_get_their_own_graph(tiny_llama, hf_attention):
    """A float32 and a bfloat16 model share their forward's code but not their weights' layouts
    (float32 weights are stored transposed): each engine must run a graph built for its own model,
    so dynamo must keep guarding on the modules (skipping those guards ran the float32 graph on the
    bfloat16 model, found by the W1/W2 benchmark)."""
    from corekv.engine.tiny_model import make_tiny_llama

    prompts = [[7, 8, 9, 10] * 5, [40, 41, 42]]
    for loaded in (tiny_llama, make_tiny_llama(dtype="bfloat16")):
        cfg = Config(model="tiny", engine=EngineConfig(num_blocks=32, block_size=16, compile=True))
        with Engine(cfg, model=loaded) as engine:
            got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        if loaded.dtype == torch.float32:
            assert got == [hf_greedy(loaded, hf_attention, p, GREEDY.max_tokens) for p in prompts]
        else:  # the graph built for the float32 model fails on this one's weight layout (a stride assertion)
            assert all(len(t) == GREEDY.max_tokens for t in got)


def start_compiled_tiny_engine(env: dict, prelude: str = "", engine: str = "compile=True") -> subprocess.CompletedProcess:
    """A fresh process that builds an engine (``EngineConfig(num_blocks=16, <engine>)``, compiled by
    default) on the tiny model under ``env`` (after running ``prelude``), printing ``ERROR <message>``
    if that raises a ConfigError, else ``NATIVE <whether its runner has native kernels>``."""
    code = (
        prelude
        + "from corekv.config import Config, EngineConfig\n"
        "from corekv.engine.llm_engine import Engine\n"
        "from corekv.engine.tiny_model import make_tiny_llama\n"
        "from corekv.errors import ConfigError\n"
        "try:\n"
        f"    e = Engine(Config(model='tiny', engine=EngineConfig(num_blocks=16, {engine})), model=make_tiny_llama())\n"
        "    print('NATIVE', e.runner._native is not None)\n"
        "except ConfigError as e:\n"
        "    print('ERROR', e)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **env),
                          timeout=600)


def test_compile_without_a_cpp_compiler_is_a_clear_config_error(tmp_path):
    """A real inductor build pointed at a compiler that does not exist (in a fresh process with an
    empty inductor cache, so nothing compiled earlier is reused)."""
    out = start_compiled_tiny_engine({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                                      "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"},
                                     prelude="import torch._inductor.config as c; c.cpp.cxx = ('/nonexistent/c++',)\n")
    assert "ERROR engine.compile: torch.compile could not compile tiny" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "set engine.compile: false" in out.stdout


def test_a_failed_native_build_is_a_clear_config_error_only_where_native_kernels_are_required(tmp_path):
    """A real build of the native kernels in a fresh process and an empty extension cache, with
    $CXX naming a compiler that does not exist: ``engine.cpu_kernels: native`` refuses to start
    naming the field and the fix; the default (auto) serves on the torch path and says why."""
    env = {"CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = start_compiled_tiny_engine(env, engine="cpu_kernels='native'")
    assert "ERROR engine.cpu_kernels: could not build corekv's native kernels" in out.stdout, \
        out.stdout + out.stderr[-2000:]
    assert "set engine.cpu_kernels: auto or torch" in out.stdout
    out = start_compiled_tiny_engine(env, engine="cpu_kernels='auto'")
    assert "NATIVE False" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "could not build corekv's native kernels" in out.stderr and "serving on the torch path" in out.stderr


def test_compile_flag_is_validated(tiny_llama):
    from corekv.engine.kv_pool import KVPool

    pool = KVPool(tiny_llama.num_layers, 4, 16, tiny_llama.num_kv_heads, tiny_llama.head_dim, tiny_llama.dtype,
                  tiny_llama.device)
    with pytest.raises(CoreKVError, match="compile must be True or False"):
        ModelRunner(tiny_llama, pool, compile="yes")
