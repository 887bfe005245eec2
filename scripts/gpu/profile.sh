#!/usr/bin/env bash
# On the GPU machine: per-kernel GPU time of one prefill (16 x 1024) and one decode step (batch 64)
# of the peer model, through Nsight Compute (ncu; its duration metric only, clocks left alone),
# summed by kernel name. Builds bench_model_gpu first (scripts/gpu/env.sh).
#   bash scripts/gpu/profile.sh [PRECISION ...]      # default: nvfp4 bf16
# QUADS_NCU_DECODE_BATCH=N profiles the decode step at batch N; QUADS_NCU_WHAT="decode" skips the
# prefill; QUADS_NCU_WHAT=train profiles one 8 x 1024 training step of each precision (bf16, qat):
# our kernels only.
set -uo pipefail
source "$(dirname "$0")/env.sh"
gpu_build bench_model_gpu || exit 1
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine"; exit 1; }
# QUADS_NCU_DETAIL=REGEX: instead, Nsight Compute's speed-of-light, warp-state, occupancy and memory
# sections for the first 3 decode-step kernels whose names match REGEX (what limits one kernel);
# QUADS_NCU_STALLS=1 adds the stall reasons (cycles a warp waits per issued instruction, by reason)
# and the instructions executed. QUADS_NCU_SKIP=N skips the first N matching kernels and
# QUADS_NCU_COUNT=N profiles N (default 0 and 3: in a decode step the W4A4 kernels come as q/k/v,
# o_proj, the experts' gate/up, down, layer after layer).
stall_metrics=smsp__inst_executed.sum,smsp__thread_inst_executed_per_inst_executed.ratio
for r in long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle barrier not_selected \
  selected dispatch_stall no_instruction tex_throttle branch_resolving drain membar sleeping imc_miss misc; do
  stall_metrics+=,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
if [ -n "${QUADS_NCU_DETAIL:-}" ]; then
  extra=(); [ "${QUADS_NCU_STALLS:-0}" = 1 ] && extra=(--metrics "$stall_metrics")
  for p in "${@:-nvfp4}"; do
    out=$logdir/ncu_detail_${p//+/_}_b${QUADS_NCU_DECODE_BATCH:-64}.txt
    timeout 300 "$ncu" --profile-from-start off --clock-control none --kernel-name "regex:$QUADS_NCU_DETAIL" \
      --launch-skip "${QUADS_NCU_SKIP:-0}" --launch-count "${QUADS_NCU_COUNT:-3}" --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
      --section MemoryWorkloadAnalysis "${extra[@]}" "$build/bench_model_gpu" --ncu-decode "$p" >"$out" 2>&1 \
      || echo "ncu failed for $p"
    [ "${QUADS_NCU_STALLS:-0}" = 1 ] && grep -E "stalled|inst_executed" "$out" | head -40
    grep -E "^  [a-z_:]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Size|Grid Size|Waves Per SM|Stall|Warp Cycles Per Issued" "$out" | head -60
  done
  exit 0
fi
precisions=("$@")
[ ${#precisions[@]} -gt 0 ] || precisions=(nvfp4 bf16)
for p in "${precisions[@]}"; do
  for what in ${QUADS_NCU_WHAT:-prefill decode}; do
    flag=--ncu; [ $what = decode ] && flag=--ncu-decode; [ $what = train ] && flag=--ncu-train
    csv=$logdir/ncu_${p//+/_}_$what${QUADS_NCU_DECODE_BATCH:+_b$QUADS_NCU_DECODE_BATCH}.csv
    # train: ~10k kernels, most of them cuBLAS GEMMs that the trainer's own profile already times;
    # only ours (and cuBLASLt's split-K reductions) are profiled, to keep ncu's replay short.
    filt=(); [ $what = train ] && filt=(--kernel-name regex:_kernel)
    timeout 300 "$ncu" --profile-from-start off --clock-control none "${filt[@]}" --metrics gpu__time_duration.sum --csv \
      --print-units base "$build/bench_model_gpu" $flag "$p" >"$csv" 2>"$logdir/ncu_${p//+/_}_$what.err" \
      || { echo "ncu failed for $p $what"; tail -5 "$logdir/ncu_${p//+/_}_$what.err"; }
    python3 - "$csv" "$p $what" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 2: print(f"{sys.argv[2]}: no kernels profiled"); sys.exit()
h, rows = rows[0], rows[1:]
iname, ival = h.index("Kernel Name"), h.index("Metric Value")
by = collections.defaultdict(lambda: [0.0, 0])
for r in rows:
    k = r[iname].replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    k = k.split("(")[0].split("<")[0].replace("void ", "").strip()
    by[k][0] += float(r[ival].replace(",", "")) / 1e3; by[k][1] += 1
tot = sum(v[0] for v in by.values())
print(f"\n{sys.argv[2]}: {len(rows)} kernels, {tot/1e3:.2f} ms of GPU time (sum of kernel durations)")
print("| kernel | calls | us | % |\n|---|---|---|---|")
for k, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:20]:
    print(f"| {k[:70]} | {n} | {t:.0f} | {100*t/tot:.1f} |")
PY
  done
done
