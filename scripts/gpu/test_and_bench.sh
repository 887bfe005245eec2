#!/usr/bin/env bash
# On the GPU machine (an H200 with CUDA 13, cmake 4, g++ 13, no network): builds the CUDA backend
# from the Debian packages carried in .debs/ (see /work/shared/GPU.md; unpacked into a prefix of our
# own, never into /), runs the CUDA tests, then prints the benchmark tables of docs/cuda.md: the
# rollout engine on the peer model (bench_model_gpu), then the kernels (bench_cuda).
#
#   bash scripts/gpu/test_and_bench.sh            # from the repository root, carry: .debs .gpufix
#
# Environment:
#   QUADS_GPU_BUILD   build folder (default build-gpu)
#   QUADS_GPU_BIN     folder holding already-built quads_cuda_tests and bench_cuda (skip the build;
#                     they must have been built for sm_90 against the same .debs)
#   QUADS_GPU_FILTER  gtest filter for the tests (default: all)
#   QUADS_GPU_BENCH   0 to skip the benchmarks; "model" or "kernels" for only one of them
#   QUADS_GPU_BENCH_ARGS  extra arguments of bench_model_gpu (e.g. --quick, --precisions nvfp4,
#                         --train-only for the training rows alone)
#   QUADS_GPU_PEER    1 (default): before bench_model_gpu, measure the transformers peer on this
#                     machine (scripts/gpu/peer_transformers.py, ~1-2 min; needs python3 with torch
#                     and transformers) and put it in the table; 0: the issue's figures
#   OUT               when set, logs are copied there
# Fixtures: the GPU machine has no ../shared, so the fixtures travel in .gpufix/ (copies of
# /work/shared/fixtures/nvfp4 and tiny_qwen3moe_a):
#   mkdir -p .gpufix && cp -r /work/shared/fixtures/nvfp4 /work/shared/fixtures/tiny_qwen3moe_a .gpufix/
set -uo pipefail
# shellcheck source=env.sh
source "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true

if [ -n "${QUADS_GPU_BIN:-}" ]; then
  bin=$QUADS_GPU_BIN
else
  gpu_build quads_cuda_tests bench_cuda bench_model_gpu || exit 1
  bin=$build
  [ -x "$bin/tests/quads_cuda_tests" ] && bin_tests=$bin/tests/quads_cuda_tests
fi
tests=${bin_tests:-$bin/quads_cuda_tests}
[ -x "$tests" ] || tests=$bin/tests/quads_cuda_tests

[ -f .gpufix/tiny_qwen3moe_a/model.safetensors ] || echo "note: .gpufix/tiny_qwen3moe_a missing: the model tests will fail to load the fixture"
rc=0
# Separate processes, so that a fault in the model tests (a sticky CUDA error) cannot take the kernel
# tests down with it. The model tests print their measured deviations (lines with "rel L2").
run_tests() {  # name filter
  local r=0
  timeout 150 "$tests" --gtest_filter="$2" >"$logdir/tests_$1.log" 2>&1 || r=$?
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|error|Expected|Which is|expected|actual|rel L2|greedy" \
    "$logdir/tests_$1.log" | head -60
  echo "tests ($1) exit code: $r"
  [ "$r" = 0 ] || rc=$r
}
if [ -n "${QUADS_GPU_FILTER:-}" ]; then
  run_tests filter "$QUADS_GPU_FILTER"
else
  run_tests kernels "-CudaModel*:CudaRl*:CudaTrain*"
  run_tests model "CudaModel*"
  run_tests train "CudaTrain*"  # the GPU trainer (and its kernels) against the CPU trainer and the fixture
  run_tests rl "CudaRl*"  # GRPO runs with GPU rollouts next to the same runs on the CPU
fi

bench=${QUADS_GPU_BENCH:-1}
if [ "$bench" = 1 ] || [ "$bench" = model ]; then
  peer_args=()
  if [ "${QUADS_GPU_PEER:-1}" != 0 ]; then
    rm -f "$logdir/peer.json"
    quick=(); case " ${QUADS_GPU_BENCH_ARGS:-} " in *" --quick "*) quick=(--quick) ;; esac
    timeout 300 python3 "$root/scripts/gpu/peer_transformers.py" --out "$logdir/peer.json" "${quick[@]}" \
      >"$logdir/peer.log" 2>&1 ||
      { echo "peer_transformers.py failed (the table keeps the issue's figures):"; tail -15 "$logdir/peer.log"; }
    grep "^peer:" "$logdir/peer.log"
    [ -s "$logdir/peer.json" ] && peer_args=(--peer "$logdir/peer.json")
  fi
  # shellcheck disable=SC2086
  timeout 300 "$bin/bench_model_gpu" "${peer_args[@]}" ${QUADS_GPU_BENCH_ARGS:-} 2>&1 | tee "$logdir/bench_model.log"
fi
if [ "$bench" = 1 ] || [ "$bench" = kernels ]; then
  timeout 100 "$bin/bench_cuda" 2>&1 | tee "$logdir/bench.log"
fi
exit $rc
