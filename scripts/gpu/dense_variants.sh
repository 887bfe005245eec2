#!/usr/bin/env bash
# On the GPU machine: what the dense skinny W4A4 calls' fixed phases cost. Builds bench_cuda three
# times (build-v0..2: as is; -DQUADS_EXPERIMENT_NOX: the dense tiles skip X's copy and
# dequantization; -DQUADS_EXPERIMENT_NOSUM=2: that and the sums across warps and CTAs; both wrong
# results, timing only, see w4a4_skinny.cuh) and runs `bench_cuda --dense-sweep` with each: every
# split of K (warps a row tile x CTAs a cluster) at the peer model's q/k/v and o_proj, 16 / 32 / 64
# rows of X, beside cuBLAS's BF16 GEMM of the same shape. Prints the 16-row rows and, for 32 and
# 64 rows, Auto and cuBLAS; the whole tables go to $OUT/sweep_v*.txt.
#   bash scripts/gpu/dense_variants.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
variants=("-DQUADS_NOTHING" "-DQUADS_EXPERIMENT_NOX" "-DQUADS_EXPERIMENT_NOSUM=2")
for i in "${!variants[@]}"; do
  build=build-v$i QUADS_GPU_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=${variants[$i]}" gpu_build bench_cuda || exit 1
done
for i in "${!variants[@]}"; do
  echo "== ${variants[$i]}"
  "build-v$i/bench_cuda" --dense-sweep >"${OUT:-/tmp}/sweep_v$i.txt" 2>&1
  grep -E "^\| dense" "${OUT:-/tmp}/sweep_v$i.txt" | awk -F'|' '$4+0==16 || $5 ~ /auto|cuBLAS/'
done
