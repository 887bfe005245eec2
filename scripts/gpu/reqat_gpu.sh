#!/usr/bin/env bash
# On the GPU machine: the built-in ReQAT experiment with its evaluation rollouts (FP, W4A4 and W4A4KV4
# with the Q-FIT transform) on the GPU; the training stages run on the CPU cores. Timed; summary and
# report go to $OUT.
#   bash scripts/gpu/reqat_gpu.sh [extra quads reqat arguments]      (carry: .debs)
set -uo pipefail
# shellcheck source=env.sh
source "$(dirname "$0")/env.sh"
gpu_build quads || exit 1  # incremental: a warm machine may hold an older build
start=$(date +%s)
"$build/quads" reqat --device cuda --out runs/reqat_gpu --quiet --no-checkpoints "$@" >"$logdir/reqat.log" 2>&1
rc=$?
grep -v '^ ' "$logdir/reqat.log" | tail -5
echo "quads reqat --device cuda: $(($(date +%s) - start)) s wall, exit code $rc"
mkdir -p "$logdir/reqat_gpu"
cp runs/reqat_gpu/summary.json runs/reqat_gpu/report.md "$logdir/reqat_gpu/" 2>/dev/null
exit "$rc"
