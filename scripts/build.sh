#!/usr/bin/env bash
# Configures and builds quads into build/ (Release). CUDA is compiled when nvcc is found
# (on PATH or in /usr/local/cuda); QUADS_CMAKE_ARGS adds options.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${QUADS_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$jobs"
