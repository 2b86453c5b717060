#!/usr/bin/env bash
# Multi-GPU scaling; run it from the repository root on a CUDA machine of 2 or more GPUs: builds the ops, runs the
# CUDA tests of the captured DDP step (tests/test_ddp_step.py: 2 processes over NCCL against one process;
# DDP_TESTS=0 skips them), then `lss bench --suite ddp` (benchmarks/ddp.py): the synthetic set made once, `lss train`
# on 1 GPU and under torchrun on 2 (4, 8 where the machine has them) at batch 4 per GPU, eager DDP steps on 2 GPUs as
# the peer, and the 1 vs 2 GPU loss curves at equal global batch. Writes $OUT/ddp/bench.{json,md} (the summary),
# $OUT/ddp.log, every run's log and metrics under $OUT/ddp_runs/ ($OUT: default runs/gpu), and prints the table last.
# DDP_STEPS, DDP_GPUS (e.g. 1,2) and DDP_TOL pass on to the suite; DDP_SECONDS bounds the suite's time.
#   bash scripts/gpu_ddp.sh
#   DDP_GPUS=1,2,4 bash scripts/gpu_ddp.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
build_ops || exit 1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m > "$OUT/gpu_topology.txt" 2>&1
if [ "${DDP_TESTS:-1}" != 0 ]; then
  timeout 150 python3 -m pytest -q -m cuda tests/test_ddp_step.py > "$OUT/ddp_tests.log" 2>&1
  echo "== CUDA tests of the captured DDP step: rc=$? at $((SECONDS - t0)) s"; tail -n 3 "$OUT/ddp_tests.log"
fi
export LSS_DDP_OUT=/tmp/lss-ddp LSS_DDP_DATA=/tmp/lss-ddp-data LSS_DDP_STEPS=${DDP_STEPS:-600}
[ -n "${DDP_GPUS:-}" ] && export LSS_DDP_GPUS=$DDP_GPUS
[ -n "${DDP_TOL:-}" ] && export LSS_DDP_TOL=$DDP_TOL
limit=()
[ -n "${DDP_SECONDS:-}" ] && limit=(timeout "$DDP_SECONDS")
${limit[@]+"${limit[@]}"} python3 -m lss bench --suite ddp --out "$OUT/ddp" > "$OUT/ddp.log" 2>&1
rc=$?
mkdir -p "$OUT/ddp_runs"
for run in "$LSS_DDP_OUT"/run_* "$LSS_DDP_OUT"/curve_*; do  # the log and metrics of every run
  [ -d "$run" ] || continue
  name=$(basename "$run")
  cp "$run/train.log" "$OUT/ddp_runs/$name.log" 2> /dev/null
  cp "$run/metrics.jsonl" "$OUT/ddp_runs/$name.metrics.jsonl" 2> /dev/null
done
echo "== lss bench --suite ddp: rc=$rc (124: past DDP_SECONDS), $((SECONDS - t0)) s in all (build included)"
[ $rc -eq 0 ] || tail -n 30 "$OUT/ddp.log"
if [ -f "$OUT/ddp/bench.md" ]; then cat "$OUT/ddp/bench.md"; else grep '^{' "$OUT/ddp.log"; fi  # rows done so far
