#!/usr/bin/env bash
# The main job on its built-in default: builds quads, then runs the comparison experiment
# (BF16 vs FP8 vs naive NVFP4 vs QUADS RL) into runs/default and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec ./build/quads compare --out runs/default "$@"
