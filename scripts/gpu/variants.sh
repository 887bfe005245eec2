#!/usr/bin/env bash
# On the GPU machine: an A/B of compile-time variants in one call. Builds bench_model_gpu once per
# variant (build-v0, build-v1, ... with the variant's extra CUDA flags), then runs
# `bench_model_gpu $QUADS_AB_ARGS` (default: --rollout-only --precisions nvfp4) for each, the
# variants interleaved $QUADS_AB_ROUNDS times (default 2).
#   bash scripts/gpu/variants.sh "-DMY_SWITCH=0" "-DMY_SWITCH=1"   (a macro the code tests with #if)
# QUADS_VARIANT_SASS=REGEX also prints, per variant, the SASS instruction counts (all, IMAD.MOV,
# CS2R, HMMA) of the w4a4_gemm.cu kernels whose mangled names match REGEX.
set -uo pipefail
source "$(dirname "$0")/env.sh"
i=0
for flags in "$@"; do
  build=build-v$i QUADS_GPU_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=$flags" gpu_build bench_model_gpu || exit 1
  if [ -n "${QUADS_VARIANT_SASS:-}" ]; then
    cuobjdump -sass "build-v$i/src/CMakeFiles/quads_cuda.dir/cuda/w4a4_gemm.cu.o" | awk -v re="$QUADS_VARIANT_SASS" -v tag="$flags" '
      /Function :/ { on = ($3 ~ re); if (on) { n++; name = $3 } }
      on && /\/\*[0-9a-f]+\*\// { all[name]++; if ($0 ~ /IMAD\.MOV/) mov[name]++; if ($0 ~ /CS2R/) cs[name]++; if ($0 ~ /HMMA/) mma[name]++ }
      END { for (k in all) printf "%s | %s | all %d | IMAD.MOV %d | CS2R %d | HMMA %d\n", tag, substr(k, 1, 70), all[k], mov[k], cs[k], mma[k] }'
  fi
  i=$((i + 1))
done
args=${QUADS_AB_ARGS:---rollout-only --precisions nvfp4}
for round in $(seq "${QUADS_AB_ROUNDS:-2}"); do
  i=0
  for flags in "$@"; do
    echo "== round $round: $flags"
    # shellcheck disable=SC2086
    "build-v$i/bench_model_gpu" $args 2>&1 | grep -E "^\|" | grep -vE "^\|---"
    i=$((i + 1))
  done
done
