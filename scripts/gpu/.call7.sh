#!/usr/bin/env bash
set -uo pipefail
export OUT=${OUT:-/tmp/out}
QUADS_GPU_FILTER='CudaTrain*:CudaRl*' QUADS_GPU_BENCH=model QUADS_GPU_BENCH_ARGS='--rollout-only --precisions bf16,fp8,nvfp4,nvfp4+rac --batches 4,8,32' bash scripts/gpu/test_and_bench.sh > $OUT/run.txt 2>&1
echo "rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |exit code|tests from .* ran" $OUT/run.txt | head
grep -E "^\|" $OUT/run.txt | grep -vE "^\|---" | cut -c1-160 | head -60
