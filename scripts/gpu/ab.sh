#!/usr/bin/env bash
# On the GPU machine: an A/B of environment settings in one call. Builds bench_model_gpu (and any
# extra targets in $QUADS_AB_TARGETS), then runs `bench_model_gpu $QUADS_AB_ARGS` (default:
# --rollout-only --precisions nvfp4) once per setting, the settings interleaved $QUADS_AB_ROUNDS
# times (default 2), so that a machine's drift shows as the spread between rounds.
#   bash scripts/gpu/ab.sh "QUADS_GPU_L2PF=0" "QUADS_GPU_L2PF=1"
# A setting is a space-separated list of VAR=VALUE (or "-" for none).
set -uo pipefail
source "$(dirname "$0")/env.sh"
gpu_build bench_model_gpu ${QUADS_AB_TARGETS:-} || exit 1
args=${QUADS_AB_ARGS:---rollout-only --precisions nvfp4}
for round in $(seq "${QUADS_AB_ROUNDS:-2}"); do
  for setting in "$@"; do
    echo "== round $round: $setting"
    envs=(); [ "$setting" = - ] || read -ra envs <<<"$setting"
    env "${envs[@]}" "$build/bench_model_gpu" $args 2>&1 | grep -E "^\|" | grep -vE "^\|---"
  done
done
