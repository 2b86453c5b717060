#!/usr/bin/env bash
# The accuracy benchmark on the GPU machine, which allows 10 minutes per call while the benchmark takes about 25:
#   start    build the ops for sm_90, generate the benchmark set (about 6.5 min on 16 cores), then start
#            scripts/accuracy.py in the background (setsid: it outlives the call while the machine stays held)
#   collect  wait up to WAIT seconds (default 560) for it, report, and copy accuracy.{json,md,png} and the runs'
#            metrics.jsonl, final.json, config.yaml and train.log (no checkpoints) to $OUT/acc_runs.tgz
# Call `collect` again (within the machine's idle release) until it reports `rc=0`. ACC_ARGS are scripts/accuracy.py's
# arguments; the default is the table of docs/accuracy.md (6 processes of 2 data workers each on 16 cores:
# 2,000 steps take about 7 minutes, 4,000 about 12).
#   device run (carry .whl): bash scripts/gpu_accuracy.sh start; then: bash scripts/gpu_accuracy.sh collect
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
ACC=${ACC_OUT:-/tmp/lss-accuracy}
ACC_ARGS=${ACC_ARGS:-"--recipe paper --recipe default --recipe paper_4k --recipe default_4k --seeds 0,1,2 \
--steps 2000 --eval-every 500 --parallel 6"}
case "${1:-}" in
start)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ( python3 -c "
from pathlib import Path
from lss.benchmarks._runs import ensure_synthetic_set
from lss.benchmarks.accuracy import BENCHMARK_SET as B
print(f'benchmark set {B.describe()} ready after {ensure_synthetic_set(Path(\"data/benchmark_accuracy\"), B, 16):.0f} s')" \
    > "$OUT/generate.log" 2>&1; echo "generate rc=$? at $((SECONDS - T0)) s: $(tail -n 1 "$OUT/generate.log")" ) &
  GEN=$!
  if ! ls lss/_C*.so > /dev/null 2>&1; then
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }
    echo "build done at $((SECONDS - T0)) s"
  fi
  python3 -m lss env | grep -E "^torch |lss|GPU"
  wait $GEN
  rm -f "$ACC.rc"
  setsid bash -c "python3 scripts/accuracy.py $ACC_ARGS --workers ${ACC_WORKERS:-2} --data-dir data/benchmark_accuracy \
    --out-dir $ACC > $ACC.log 2>&1; echo \$? > $ACC.rc" < /dev/null > /dev/null 2>&1 &
  sleep 15
  echo "accuracy.py started at $((SECONDS - T0)) s: $ACC_ARGS"
  ;;
collect)
  end=$((SECONDS + ${WAIT:-560}))
  while [ $SECONDS -lt $end ] && [ ! -f "$ACC.rc" ]; do sleep 10; done
  echo "rc=$(cat "$ACC.rc" 2>/dev/null || echo running)"
  grep "^accuracy:" "$ACC.log"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  cp "$ACC"/accuracy.{json,md,png} "$OUT"/ 2>/dev/null
  [ -d "$ACC/runs" ] && (cd "$ACC" && tar czf "$OUT/acc_runs.tgz" --exclude='*.pt' --exclude=tensorboard runs)
  cat "$OUT/accuracy.md" 2>/dev/null
  ;;
*)
  echo "usage: bash scripts/gpu_accuracy.sh start|collect" >&2
  exit 2
  ;;
esac
