#!/usr/bin/env bash
# On the GPU machine: the ReQAT experiment with every training stage (base SFT, stage 1, the stage-2
# variants), Q-FIT's calibration, every evaluation rollout (FP, W4A4, W4A4KV4 with the Q-FIT
# transform) and the divergence analysis on the GPU (`quads reqat --device cuda`).
# Timed; summary and report go to $OUT/<name>/ (name: the output folder's, default reqat_gpu).
#   bash scripts/gpu/reqat_gpu.sh [extra quads reqat arguments]      (carry: .debs)
#   QUADS_REQAT_OUT=runs/reqat_big bash scripts/gpu/reqat_gpu.sh --config configs/reqat_gpu.toml
#   QUADS_REQAT_DEVICE=cpu ...   the same run on the CPU cores (the comparison)
set -uo pipefail
# shellcheck source=env.sh
source "$(dirname "$0")/env.sh"
gpu_build quads || exit 1  # incremental: a warm machine may hold an older build
out=${QUADS_REQAT_OUT:-runs/reqat_gpu}
device=${QUADS_REQAT_DEVICE:-cuda}
name=$(basename "$out")
start=$(date +%s)
"$build/quads" reqat --device "$device" --out "$out" --quiet --no-checkpoints "$@" >"$logdir/$name.log" 2>&1
rc=$?
grep -v '^ ' "$logdir/$name.log" | tail -5
echo "quads reqat --device $device $*: $(($(date +%s) - start)) s wall, exit code $rc"
mkdir -p "$logdir/$name"
cp "$out/summary.json" "$out/report.md" "$logdir/$name/" 2>/dev/null
exit "$rc"
