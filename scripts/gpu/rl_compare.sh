#!/usr/bin/env bash
# On the GPU machine: builds the quads binary (as test_and_bench.sh does, from the carried .debs) and
# runs the RL comparison of configs/gpu.toml on the GPU, timed; summary, report and metrics go to $OUT.
#   bash scripts/gpu/rl_compare.sh [extra quads compare arguments]     (carry: .debs)
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
prefix=/tmp/quads-deps
build=${QUADS_GPU_BUILD:-build-gpu}
out=${OUT:-/tmp/quads-gpu-logs}
mkdir -p "$prefix" "$out"
for f in .debs/*.deb; do dpkg -x "$f" "$prefix"; done
L=$prefix/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_SYSROOT_DIR=$prefix
export PKG_CONFIG_PATH=$L/pkgconfig:$L/openblas-pthread/pkgconfig
export LD_LIBRARY_PATH=$L:$L/openblas-pthread:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
if [ ! -x "$build/quads" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/usr" \
    -DQUADS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DQUADS_BUILD_BENCH=OFF \
    -DCMAKE_PROJECT_INCLUDE="$root/scripts/gpu/add_gpu_bench.cmake" >"$out/configure_rl.log" 2>&1 \
    || { tail -40 "$out/configure_rl.log"; exit 1; }
  cmake --build "$build" -j "$(nproc)" --target quads >"$out/build_rl.log" 2>&1 \
    || { grep -E "error|Error" "$out/build_rl.log" | head -40; exit 1; }
fi
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
