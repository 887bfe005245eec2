#!/usr/bin/env bash
# On the GPU machine: builds the quads binary (as test_and_bench.sh does, from the carried .debs) and
# runs the RL comparison of configs/gpu.toml on the GPU, timed; summary, report and metrics go to $OUT.
#   bash scripts/gpu/rl_compare.sh [extra quads compare arguments]     (carry: .debs)
set -uo pipefail
# shellcheck source=env.sh
source "$(dirname "$0")/env.sh"
out=$logdir
gpu_build quads || exit 1  # incremental: a warm machine may hold an older build
nvidia-smi --query-gpu=name --format=csv,noheader || true
start=$(date +%s)
"$build/quads" compare --config configs/gpu.toml --out runs/gpu "$@" >"$out/compare.log" 2>"$out/compare_progress.log"
rc=$?
tail -40 "$out/compare.log"
[ "$rc" = 0 ] || tail -c 3000 "$out/compare_progress.log"
echo "quads compare --config configs/gpu.toml: $(($(date +%s) - start)) s wall, exit code $rc"
# Where each run's time goes: the setup (to its first row), the steps' own timers, and what lies
# between rows beyond them (checkpoints, waits for a background checkpoint write).
python3 - <<'PY'
import glob, json
for f in sorted(glob.glob('runs/gpu/runs/*/metrics.jsonl')):
    rows = [json.loads(l) for l in open(f)]
    if not rows:
        continue
    tr = [r for r in rows if r.get('kind') == 'train']
    tot = lambda k: sum(r.get(k, 0) for r in rows)
    gaps, prev = [], rows[0]['elapsed_s']
    for r in rows[1:]:
        own = sum(r.get(k, 0) for k in ('t_sync', 't_rollout', 't_train', 't_diag', 't_eval'))
        if r['elapsed_s'] - prev - own > 0.3:
            gaps.append('%s %d: +%.1f s' % (r['kind'], r['step'], r['elapsed_s'] - prev - own))
        prev = r['elapsed_s']
    print('%s: first row at %.1f s, last at %.1f s; %d steps: t_sync %.1f t_rollout %.1f t_train %.1f t_diag %.1f '
          's, evaluations %.1f s; beyond the timers: %s' % (f.split('/')[-2], rows[0]['elapsed_s'], rows[-1]['elapsed_s'],
          len(tr), tot('t_sync'), tot('t_rollout'), tot('t_train'), tot('t_diag'), tot('t_eval'), ', '.join(gaps) or 'none'))
PY
mkdir -p "$out/gpu_rl"
cp runs/gpu/summary.json runs/gpu/report.md "$out/gpu_rl/" 2>/dev/null
for d in runs/gpu/*/; do
  [ -f "$d/metrics.jsonl" ] && mkdir -p "$out/gpu_rl/$(basename "$d")" && cp "$d/metrics.jsonl" "$out/gpu_rl/$(basename "$d")/"
done
cp runs/gpu/base/sft.json "$out/gpu_rl/" 2>/dev/null
exit "$rc"
