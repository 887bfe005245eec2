#!/usr/bin/env bash
# On the GPU machine: where the time of the skinny W4A4 launches goes (phase stamps, see
# `bench_cuda --skinny-trace`). Builds bench_cuda in build-trace with -DQUADS_SKINNY_TRACE.
set -uo pipefail
source "$(dirname "$0")/env.sh"
build=build-trace QUADS_GPU_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-DQUADS_SKINNY_TRACE ${QUADS_GPU_CMAKE_ARGS:-}" \
  gpu_build bench_cuda || exit 1
build-trace/bench_cuda --skinny-trace "$@"
