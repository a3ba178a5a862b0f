#!/usr/bin/env bash
# Lay out the committed HEAD of this repository as an importable ``corekv`` package under $1 (default
# /tmp/corekv_snap), so benchmarks measure a consistent commit while others edit the working tree:
#   PYTHONPATH=$(benchmarks/snapshot_head.sh) python benchmarks/engine_w1_w2.py ...
# NOTE: PYTHONPATH entries come before the editable install's finder (appended to sys.meta_path).
set -euo pipefail
dest=${1:-/tmp/corekv_snap}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rm -rf "$dest" && mkdir -p "$dest/src" "$dest/site"
git -C "$repo" archive HEAD | tar -x -C "$dest/src"
cp -r "$dest/src/corekv" "$dest/site/corekv"
for sub in engine plugins tiers; do cp -r "$dest/src/$sub" "$dest/site/corekv/$sub"; done
git -C "$repo" rev-parse --short HEAD > "$dest/COMMIT"
echo "$dest/site"
