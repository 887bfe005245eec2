#!/usr/bin/env bash
# On the GPU machine: what each kernel of a decode step adds to the step's critical path (one
# replayed CUDA graph per batch; see `bench_model_gpu --step-trace`). Builds bench_model_gpu in
# build-steptrace with -DQUADS_STEP_TRACE (pdl.cuh's per-kernel record); QUADS_STEP_MARKS=1 builds
# with the marks inside the kernels too (-DQUADS_STEP_TRACE=2, build-stepmarks: each mark adds
# ~0.4 us to its kernel).
#   bash scripts/gpu/step_trace.sh [PRECISION ...]   # default: nvfp4 bf16; QUADS_STEP_TRACE_BATCHES=1,16,64
# (At batches 9-64 the experts' MLP runs as concurrent chains, whose "adds" interleave: set
# QUADS_GPU_MOE_CHAINS=1 for a one-chain listing.)
set -uo pipefail
source "$(dirname "$0")/env.sh"
level=1; build=build-steptrace
[ "${QUADS_STEP_MARKS:-0}" = 1 ] && level=2 && build=build-stepmarks
QUADS_GPU_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-DQUADS_STEP_TRACE=$level ${QUADS_GPU_CMAKE_ARGS:-}" gpu_build bench_model_gpu || exit 1
args=()
for p in "${@:-nvfp4 bf16}"; do for q in $p; do args+=(--step-trace "$q"); done; done
"$build/bench_model_gpu" "${args[@]}"
