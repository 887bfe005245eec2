#!/usr/bin/env bash
# Builds quads and runs every test (GPU tests skip themselves when no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
ctest --output-on-failure -j "$(nproc)" --timeout 900
