"""A ``.gguf`` model converted once into a Hugging Face folder (safetensors), so later starts skip
the GGUF parse.

transformers reads a GGUF file by parsing its metadata and de-quantizing every tensor to float32,
for the config, the tokenizer and the weights separately: tens of seconds per start for a 135M
model on a small machine. :func:`converted_folder` does that once per file and writes the result
where a plain ``from_pretrained`` reads it back in about a second: ``config.json``,
``generation_config.json``, the tokenizer's files and ``model.safetensors`` (the de-quantized
float32 weights; another ``dtype`` is converted from them at load, as from the GGUF).

NOTE: corekv writes the folder itself (``save_pretrained`` of the config and tokenizer, the
``safetensors`` package for the weights) because transformers refuses ``save_pretrained`` on a
model it loaded from a GGUF file.

The folder is ``$COREKV_CACHE_DIR/models/<file stem>-<key>`` (default ``~/.cache/corekv``), keyed by
a digest of the file's bytes and transformers' version (which decides the conversion), so a changed
file or another transformers converts again. It is written under a temporary name and renamed
into place: a reader never sees half a folder, and of two processes converting at once one keeps
its folder, the other uses it. Where the cache cannot be written the model is loaded from the
GGUF file on every start, as before (logged once).

A later start builds the model class from the folder's config and hands it the stored float32
weights (:func:`load_model_from`), which is what ``from_pretrained`` gives for this folder without
its loading machinery (its conversion rules, key renames, device maps and checks take about half
a second of a warm start for a folder corekv wrote itself, in the one layout it writes).

The folder also keeps the model's fingerprint per dtype (:func:`remembered`, :func:`remember`), which
otherwise costs a pass over every weight at each start: its writer, like anyone who can write here,
decides what the model is.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from corekv.engine import progress

#: bump when what is written changes, so older folders are not read as this format
_FORMAT = "1"
#: written last: a folder without it is not a finished conversion
_DONE = "corekv-converted"
_CHUNK = 16 << 20
logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """Where converted models live (``$COREKV_CACHE_DIR/models``, default ``~/.cache/corekv/models``)."""
    return Path(os.environ.get("COREKV_CACHE_DIR") or Path.home() / ".cache" / "corekv") / "models"


def existing_folder(gguf_path: Path) -> Path | None:
    """The converted folder of ``gguf_path`` when one is already there, else ``None``."""
    folder = _folder_for(gguf_path)
    return folder if (folder / _DONE).is_file() else None


def converted_folder(gguf_path: Path) -> Path | None:
    """The converted folder of ``gguf_path``, converting it first if needed; ``None`` where the
    cache cannot be written (the caller then loads the GGUF file itself)."""
    folder = _folder_for(gguf_path)
    if (folder / _DONE).is_file():
        return folder
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)  # NOTE: fails before the long conversion
        with progress.phase(f"converting {gguf_path.name} to safetensors (once per file)"):
            _convert(gguf_path, tmp)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _DONE).is_file():  # NOTE: else another process converted it first
                raise
    except OSError as exc:
        logger.warning("could not cache the converted model in %s (%s); reading %s on every start",
                       folder, exc, gguf_path.name)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _folder_for(gguf_path: Path) -> Path:
    import transformers
    import xxhash

    digest = xxhash.xxh3_128()
    digest.update(f"{_FORMAT}|transformers {transformers.__version__}|".encode())
    with open(gguf_path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return cache_root() / f"{gguf_path.stem}-{digest.hexdigest()[:20]}"


def _convert(gguf_path: Path, folder: Path) -> None:
    """Read ``gguf_path`` with transformers (float32) and write it to ``folder`` as a HF folder."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, kwargs = str(gguf_path.parent), {"gguf_file": gguf_path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(source, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # NOTE: save_model, not save_file: it writes a tied weight (lm_head = embed_tokens) once
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / _DONE).write_text(f"converted from {gguf_path}\n")


def is_converted(path: Path) -> bool:
    """Whether ``path`` is a finished converted folder (which :func:`load_model_from` reads)."""
    return path.is_dir() and (path / _DONE).is_file()


def load_model_from(folder: Path, config: Any, dtype: Any) -> Any | None:
    """The causal LM in a converted ``folder`` (:func:`is_converted`) with ``config`` (read from
    it), or ``None`` where this shortcut does not apply: another dtype than the stored float32, or
    weights that are not exactly the model class's parameters (the caller then uses
    ``from_pretrained``).

    The model class is built from the config without initialising its weights, the stored tensors
    become its parameters (a weight written once for two tied names, as ``safetensors.save_model``
    records in the file's metadata, goes to both), and the ties are restored: the same parameters,
    buffers, config and generation config as ``from_pretrained(folder, dtype=torch.float32)``
    (tests/engine/test_engine_gguf_cache.py compares the two).
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    weights = folder / "model.safetensors"
    if dtype != torch.float32 or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or not weights.is_file():
        return None
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_file(weights)
    with safe_open(weights, "pt") as f:
        aliases = f.metadata() or {}
    for alias, stored in aliases.items():
        if stored in state and alias not in state:
            state[alias] = state[stored]
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    expected |= {name for name, _ in model.named_buffers(remove_duplicate=False)} & set(model.state_dict())
    if set(state) != expected or any(t.dtype != dtype for t in state.values()):
        logger.info("%s does not hold exactly %s's weights; loading it with from_pretrained", folder,
                    type(model).__name__)
        return None
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def remembered(folder: Path, name: str) -> str | None:
    """What :func:`remember` kept in ``folder`` under ``name``, or ``None``."""
    try:
        return (folder / f"corekv-{name}").read_text().strip() or None
    except OSError:
        return None


def remember(folder: Path, name: str, value: str) -> None:
    """Keep ``value`` in ``folder`` under ``name`` (written whole or not at all; a folder that cannot
    be written keeps nothing, and the value is computed again next time)."""
    tmp = folder / f"corekv-{name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(value + "\n")
        os.replace(tmp, folder / f"corekv-{name}")
    except OSError as exc:
        logger.debug("could not keep %s in %s: %s", name, folder, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()
