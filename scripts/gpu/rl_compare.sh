#!/usr/bin/env bash
# On the GPU machine: builds the quads binary (as test_and_bench.sh does, from the carried .debs) and
# runs the RL comparison of configs/gpu.toml on the GPU, timed; summary, report and metrics go to $OUT.
#   bash scripts/gpu/rl_compare.sh [extra quads compare arguments]     (carry: .debs)
set -uo pipefail
# shellcheck source=env.sh
source "$(dirname "$0")/env.sh"
out=$logdir
gpu_build quads || exit 1  # incremental: a warm machine may hold an older build
nvidia-smi --query-gpu=name --format=csv,noheader || true
start=$(date +%s)
"$build/quads" compare --config configs/gpu.toml --out runs/gpu "$@" >"$out/compare.log" 2>"$out/compare_progress.log"
rc=$?
tail -40 "$out/compare.log"
[ "$rc" = 0 ] || tail -c 3000 "$out/compare_progress.log"
echo "quads compare --config configs/gpu.toml: $(($(date +%s) - start)) s wall, exit code $rc"
mkdir -p "$out/gpu_rl"
cp runs/gpu/summary.json runs/gpu/report.md "$out/gpu_rl/" 2>/dev/null
for d in runs/gpu/*/; do
  [ -f "$d/metrics.jsonl" ] && mkdir -p "$out/gpu_rl/$(basename "$d")" && cp "$d/metrics.jsonl" "$out/gpu_rl/$(basename "$d")/"
done
cp runs/gpu/base/sft.json "$out/gpu_rl/" 2>/dev/null
exit "$rc"
