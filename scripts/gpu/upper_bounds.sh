#!/usr/bin/env bash
# On the GPU machine: what the W4A4 emulation's arithmetic costs a decode step (docs/cuda.md Part 29).
# Builds bench_model_gpu three times - as is, with -DQUADS_EXPERIMENT_NODEQ (the E2M1 decode masked
# instead of dequantized) and with -DQUADS_EXPERIMENT_NOMMA (the tiles' MMAs gone too) - and runs
# them interleaved (variants.sh); then the one-chain step traces at batches 16 and 64, as is and
# NOMMA, each kernel shape's sum printed side by side. The switched builds give wrong results:
# timing only.
#   QUADS_UB_TRACE=0 bash scripts/gpu/upper_bounds.sh   # carry .debs .gpufix: the A/B, ~7 minutes
#   QUADS_UB_AB=0 bash scripts/gpu/upper_bounds.sh      # the traces alone, ~3 minutes
# (both in one call come near the device's 10 minutes a command). QUADS_AB_ARGS (default:
# --rollout-only --precisions bf16,nvfp4 --batches 8,32) and QUADS_AB_ROUNDS (default 2) as in
# variants.sh.
set -uo pipefail
# shellcheck source=env.sh
source "$(dirname "$0")/env.sh"
export QUADS_AB_ARGS=${QUADS_AB_ARGS:---rollout-only --precisions bf16,nvfp4 --batches 8,32}
if [ "${QUADS_UB_AB:-1}" != 0 ]; then
  bash "$root/scripts/gpu/variants.sh" "-DQUADS_NONE" "-DQUADS_EXPERIMENT_NODEQ" "-DQUADS_EXPERIMENT_NOMMA" 2>&1 |
    grep -E "^==|^\| (bf16|nvfp4) \| [0-9]+ " || exit 1
fi
[ "${QUADS_UB_TRACE:-1}" = 0 ] && exit 0
# CUDAFLAGS (read by cmake at a build folder's first configure) carries both macros in one word list
build=build-ub-trace CUDAFLAGS="-DQUADS_STEP_TRACE=1" gpu_build bench_model_gpu || exit 1
build=build-ub-nomma CUDAFLAGS="-DQUADS_STEP_TRACE=1 -DQUADS_EXPERIMENT_NOMMA" gpu_build bench_model_gpu || exit 1
export QUADS_GPU_MOE_CHAINS=1 QUADS_STEP_TRACE_BATCHES=${QUADS_STEP_TRACE_BATCHES:-16,64}
# each run writes its full listings to $OUT/step_trace_nvfp4_bB.txt: renamed after it, so that the
# second build's do not overwrite the first's
keep() { for f in "$logdir"/step_trace_nvfp4_b*[0-9].txt; do [ -e "$f" ] && mv "$f" "${f%.txt}_$1.txt"; done; }
build-ub-trace/bench_model_gpu --step-trace nvfp4 >"$logdir/ub_trace_asis.txt" 2>&1
keep asis
build-ub-nomma/bench_model_gpu --step-trace nvfp4 >"$logdir/ub_trace_nomma.txt" 2>&1
keep nomma
# the "by shape" blocks (sum of each kernel shape's 'adds' over the step) of the two builds
for f in "$logdir/ub_trace_asis.txt" "$logdir/ub_trace_nomma.txt"; do
  echo "== $(basename "$f" .txt)"
  awk '/records, first to last/ { p = 1 } /records$/ { p = 0 } p' "$f"
done
